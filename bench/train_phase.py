"""The train phase against its ceiling (bench/README.md, "Performance"): grpo_colocate.train_on_rollouts (the ZeRO-3
engine's forward, backward and optimizer step over one step's micro-batches, exactly as the loop runs it) for
ds_zero3.json and variants of its zero_optimization section, beside the plain transformers model's forward + backward
over the same micro-batches (no DeepSpeed, no optimizer): the ceiling the train phase is measured against.

    torchrun --nproc_per_node 1 bench/train_phase.py --model /tmp/random-1.5b --per_device_train_batch_size 16 \\
        --gradient_accumulation_steps 4 --max_completion_length 256          # the 1.5B 64 x 256 step
    VARIANTS=bench/zero3_variants.json torchrun --nproc_per_node 2 bench/train_phase.py ...   # 2 GPUs, same options

Rollouts are the script's real chat prompts with random completion tokens of --max_completion_length (what the
random-weight models generate: every completion runs to full length; `LEN=40` for shorter ones). A variant is a dict
of zero_optimization overrides; `"compile": {"deepcompile": true}` sets that top-level section and calls
engine.compile() (DeepCompile, GPU only); `"z3_leaf_modules": false` (not a DeepSpeed key) builds the engine without
build_trainer's decoder-layer leaf modules, so ZeRO-3 hooks every submodule; `"optimizer_params"` is merged into the
optimizer's params (`{"fused": false}`: torch's foreach AdamW instead of its fused kernel). Each variant: one warm-up
step, then REPEATS (3) timed steps; the median. The warm-up step's loss and gradient norm are printed: the same
weights and rollouts, so they agree across variants to bf16 rounding (a variant that breaks the gradients shows
there). `BEST=path` writes the fastest variant's full config there. Variants run one after the other in one process,
after the plain model, and what an engine leaves allocated stays (DeepSpeed keeps references to it): at 1.5B each
takes ~20 GiB, so an H200 runs five variants, then goes out of memory. Without --model: the offline copy of the
default model (offline_model.py).
Runs on CPU too (float32, gloo), for checking, not for timing.
"""

import copy
import functools
import json
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo_colocate as g  # noqa: E402 (from the folder above, put on sys.path just above)
import offline_model  # noqa: E402 (from the folder above, put on sys.path just above)

CUDA = torch.cuda.is_available()


def sync():
    if CUDA:
        torch.cuda.synchronize()


def fake_rollouts(cfg, tokenizer, rank: int, length: int) -> tuple:
    """One step's Rollouts for this rank (real prompts, random completion tokens, vLLM log-probs of 0) and
    advantages."""
    source, G = g.prompt_source(cfg), cfg.num_generations
    step_examples = g.prompts_for_step(source, 0, cfg.completions_per_rank // G, dist.get_world_size())
    examples = [ex for ex in step_examples for _ in range(G)]
    rng = random.Random(rank)
    prompts = [g.chat_prompt_ids(tokenizer, ex["prompt"]) for ex in examples]
    comps = [[rng.randrange(1000, min(40000, len(tokenizer))) for _ in range(length)] for _ in examples]
    r = g.Rollouts(
        prompts,
        comps,
        [[0.0] * length for _ in comps],
        [""] * len(comps),
        [ex["answer"] for ex in examples],
        [length >= cfg.max_completion_length] * len(comps),
    )
    return r, torch.randn(len(comps), generator=torch.Generator().manual_seed(rank))


def default_model_path(cfg, local_rank: int) -> str:
    """--model, or without it the offline copy of the default model, built by local rank 0. Call it before the
    process group exists (transformers' save_pretrained writes from global rank 0 only once one does) and wait in a
    barrier before the other ranks read the folder."""
    if cfg.model != g.Config.model:
        return cfg.model
    return offline_model.build() if local_rank == 0 else offline_model.folder()


def apply_variant(ds: dict, variant: dict) -> bool:
    """ds (a DeepSpeed config) updated in place with a variant's optimizer params and zero_optimization overrides;
    returns whether the engine keeps build_trainer's decoder-layer leaf modules ("z3_leaf_modules" is not a DeepSpeed
    key)."""
    variant = dict(variant)
    leaf = variant.pop("z3_leaf_modules", True)
    if "compile" in variant:  # a top-level DeepSpeed section (DeepCompile)
        ds["compile"] = variant.pop("compile")
    ds["optimizer"]["params"].update(variant.pop("optimizer_params", {}))
    ds["zero_optimization"].update(variant)
    return leaf


def time_steps(fn, repeats: int) -> list[float]:
    """Seconds of each call after one warm-up call."""
    out = []
    for i in range(repeats + 1):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i:
            out.append(time.perf_counter() - t0)
    return out


def peak_gib() -> float:
    if not CUDA:
        return 0.0
    p = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return p


def plain_fwd_bwd(model, r, mb: int, dev, pad: int) -> None:
    """The plain model's forward + backward over the rollouts' micro-batches of mb rows."""
    for s in [slice(i, i + mb) for i in range(0, len(r.completions), mb)]:
        logp, _ = g.sequence_logprobs(model, r.prompts[s], r.completions[s], 1.0, dev, pad)
        (logp.sum() / logp.numel()).backward()


def train_step(engine, r, adv, cfg, dev, pad: int, runs: list) -> None:
    """One train phase, as the loop runs it; its Stats (this rank's loss and gradient norm) appended to runs."""
    stats = g.Stats()
    g.train_on_rollouts(engine, None, r, adv, cfg, dev, pad, stats)
    runs.append(stats)


def no_leaf_modules(*args, **kwargs) -> list:
    """deepspeed.utils.set_z3_leaf_modules doing nothing: ZeRO-3 hooks every submodule."""
    return []


def main():
    cfg = g.parse_config(sys.argv[1:])
    rank, local = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    if CUDA:
        torch.cuda.set_device(local)
    dev = torch.device("cuda", local) if CUDA else torch.device("cpu")
    model_path = default_model_path(cfg, local)
    dist.init_process_group("nccl" if CUDA else "gloo")
    import deepspeed
    import deepspeed.ops
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not CUDA:
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if CUDA else "gloo")
    dist.barrier()
    tokenizer, world = AutoTokenizer.from_pretrained(model_path), dist.get_world_size()
    dtype = torch.bfloat16 if CUDA else torch.float32
    r, adv = fake_rollouts(cfg, tokenizer, rank, int(os.environ.get("LEN", cfg.max_completion_length)))
    repeats, pad = int(os.environ.get("REPEATS", "3")), tokenizer.pad_token_id or 0
    base = g.fill_ds_config(cfg, world, bf16=CUDA)
    variants = {"ds_zero3.json": {}}
    if os.environ.get("VARIANTS"):
        with open(os.environ["VARIANTS"]) as f:
            variants.update(json.load(f))
    # the ceiling: the plain model's forward + backward over the same micro-batches (no ZeRO-3, no optimizer)
    plain = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(dev)
    plain.config.use_cache = False
    mb = cfg.per_device_train_batch_size
    plain_s = statistics.median(time_steps(functools.partial(plain_fwd_bwd, plain, r, mb, dev, pad), repeats))
    g.say(
        f"PLAIN fwd+bwd {plain_s:.3f} s over the same {len(r.completions)} rows ({len(r.completions) // mb} "
        f"micro-batches), peak allocated {peak_gib():.1f} GiB",
        rank0=True,
    )
    del plain
    results, set_leaves = {}, deepspeed.utils.set_z3_leaf_modules
    for name, override in variants.items():
        ds = copy.deepcopy(base)
        leaf = apply_variant(ds, override)
        deepspeed.utils.set_z3_leaf_modules = set_leaves if leaf else no_leaf_modules  # hooks on every submodule
        engine = g.build_trainer(cfg, model_path, ds, dtype)
        deepspeed.utils.set_z3_leaf_modules = set_leaves
        if ds.get("compile", {}).get("deepcompile"):  # DeepCompile: ZeRO-3 as compiled graph passes, no hooks
            engine.compile()
        peak_gib()
        runs = []  # each step's Stats; the warm-up step's loss and gradient norm: equal across variants
        t = time_steps(functools.partial(train_step, engine, r, adv, cfg, dev, pad, runs), repeats)
        results[name] = (statistics.median(t), peak_gib(), ds)
        first_loss, first_grad_norm = float(runs[0].totals["loss"]), float(runs[0].totals["grad_norm"])
        g.say(
            f"TRAIN {name:40s} {statistics.median(t):7.3f} s/step (train phase)  {min(t):.3f}-{max(t):.3f}  "
            f"peak allocated {results[name][1]:.1f} GiB  first step: loss {first_loss:.6e} grad_norm "
            f"{first_grad_norm:.6e}  {json.dumps(variants[name])}  all: {' '.join(f'{x:.3f}' for x in t)}",
            rank0=True,
        )
        engine.destroy()
        del engine
        if CUDA:
            torch.cuda.empty_cache()
    best = min(results, key=lambda k: results[k][0])
    for name, (s, _peak, _) in results.items():
        fastest = "  (fastest)" if name == best else ""
        g.say(f"RATIO {name:40s} train phase / plain fwd+bwd = {s / plain_s:.2f}{fastest}", rank0=True)
    if rank == 0 and os.environ.get("BEST"):
        with open(cfg.deepspeed_config) as f:  # the file, "auto" values kept, with the fastest variant's overrides
            ds = json.load(f)
        apply_variant(ds, variants[best])
        with open(os.environ["BEST"], "w") as f:
            json.dump(ds, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
