"""Where the price of co-location goes (bench/README.md, "Performance"): the training engine and the vLLM engine the
script builds, taking turns as the loop does -- train step (grpo_colocate.train_on_rollouts on one step's rollouts),
wake_up(weights), weight push, wake_up(kv_cache), a short generation, sleep(level=2) -- each phase timed alone, for
five ways of doing the turn:

  per-parameter, empty_cache   one GatheredParameters per parameter; torch's cached blocks returned before each wake
                               (and, by vLLM's sleep, after it); vLLM's layer-wise reload_weights loads them
  buckets, empty_cache         the gather in buckets of grpo_colocate.PUSH_BUCKET_BYTES
  buckets, make_room           the trainer keeps its cached blocks at wake when vLLM fits beside them
  load_weights, vLLM's sleep   the same, loaded by the model's own load_weights (copied in place, no layer-wise
                               rebuild and re-processing)
  the script                   what grpo_colocate.py does on GPU: the same, asleep by grpo_colocate.sleep_vllm (vLLM's
                               sleep without its closing torch.cuda.empty_cache(): the trainer keeps its cached blocks)

and the gather alone (no vLLM) for both gathers. The KV cache is the script's (one step's batch); `KV=util` builds
vLLM with the share --vllm_gpu_memory_utilization of the GPU instead (vLLM's default sizing, the script's before).

    torchrun --nproc_per_node 1 bench/colocation_cost.py --model /tmp/random-1.5b --per_device_train_batch_size 16 \\
        --gradient_accumulation_steps 4 --max_completion_length 256           # the 1.5B 64 x 256 step
    KV=util torchrun --nproc_per_node 1 bench/colocation_cost.py ...          # the same with a 0.3 x GPU engine

Prints one `COLOC {name}` line per way: median milliseconds per phase over REPEATS (3) cycles after a warm-up one,
the GPU memory free when the weights wake, and the weight-sync check of the loop: the mean |trainer - vLLM| log-prob
of the short generation's tokens after each push (bf16 kernel rounding, ~0.02 at 1.5B, if the engine holds the
trained weights). Without --model: the offline copy of the default model (offline_model.py). GPU only (sleep mode is
CUDA-only).
"""

import functools
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from train_phase import default_model_path, fake_rollouts  # noqa: E402 (this script's folder, put on sys.path above)

import grpo_colocate as g  # noqa: E402 (from the folder above, put on sys.path just above)


def main():
    cfg = g.parse_config(sys.argv[1:])
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    model_path = default_model_path(cfg, local)
    dist.init_process_group("nccl")
    import deepspeed
    from transformers import AutoTokenizer

    deepspeed.init_distributed(dist_backend="nccl")
    if os.environ.get("KV") == "util":  # vLLM sizes its KV cache from gpu_memory_utilization
        import vllm

        LLM = vllm.LLM

        def llm_sized_by_utilization(*args, kv_cache_memory_bytes=None, **kwargs):
            return LLM(*args, **kwargs)

        vllm.LLM = llm_sized_by_utilization
    dist.barrier()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    free0 = torch.cuda.mem_get_info()[0]
    llm = g.build_vllm(cfg, model_path, True, torch.bfloat16)
    awake = free0 - torch.cuda.mem_get_info()[0]
    llm.sleep(level=2)
    torch.cuda.empty_cache()
    wake_bytes = awake - (free0 - torch.cuda.mem_get_info()[0])
    kv = f"util {cfg.vllm_gpu_memory_utilization}" if os.environ.get("KV") == "util" else "sized to the batch"
    g.say(f"COLOC vLLM awake {awake / 2**30:.2f} GiB, wake maps {wake_bytes / 2**30:.2f} GiB (KV {kv})", rank0=True)
    engine = g.build_trainer(cfg, model_path, g.fill_ds_config(cfg, dist.get_world_size(), True), torch.bfloat16)
    r, adv = fake_rollouts(cfg, tokenizer, dist.get_rank(), cfg.max_completion_length)
    pad = tokenizer.pad_token_id or 0
    prompt = [g.chat_prompt_ids(tokenizer, "What is 2 + 3?")]
    short = g.sampling_params(cfg.num_generations, 1.0, 16)
    B = g.PUSH_BUCKET_BYTES  # (bucket bytes, make_room at wake, reload_weights, sleep_vllm)
    ways = {
        "per-parameter, empty_cache": (0, False, True, False),
        "buckets, empty_cache": (B, False, True, False),
        "buckets, make_room": (B, True, True, False),
        "load_weights, vLLM's sleep": (B, True, False, False),
        "the script": (B, True, False, True),
    }
    apply = llm.apply_model

    def via_reload(fn):  # the push's model.load_weights -> vLLM's reload_weights of the same gathered tensors
        weights = g.gathered_params(engine.module)
        return llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=weights, is_checkpoint_format=True))

    gather = g.gathered_params
    repeats = int(os.environ.get("REPEATS", "3"))

    def timed(t, name, fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        t[name].append(1000 * (time.perf_counter() - t0))

    def train():
        g.train_on_rollouts(engine, None, r, adv, cfg, dev, pad, g.Stats())

    def gather_all(bucket_bytes: int) -> int:
        return sum(1 for _ in gather(engine.module, bucket_bytes=bucket_bytes))

    for name, (bucket, room, reload, keep) in ways.items():
        t, llm.apply_model = defaultdict(list), via_reload if reload else apply
        for i in range(repeats + 1):
            timed(t, "train", train)
            t["free_at_wake_gib"].append(torch.cuda.mem_get_info()[0] / 2**30)
            g.gathered_params = functools.partial(gather, bucket_bytes=bucket)  # what push_weights_to_vllm streams
            timer = g.PhaseTimer(sync=True)
            push = functools.partial(
                g.push_weights_to_vllm, llm, engine.module, True, timer, wake_bytes if room else 0
            )
            timed(t, "wake+push+wake", push)
            for k, v in timer.t.items():
                t[k].append(1000 * v)
            outputs = llm.generate([{"prompt_token_ids": prompt[0]}], short, use_tqdm=False)
            ro = g.collect_rollouts([{"answer": ""}], prompt, outputs, tokenizer)
            with torch.no_grad():
                lp = g.sequence_logprobs(engine, ro.prompts, ro.completions, 1.0, dev, pad)[0]
            # lp's rows are padded to the longest completion: zip stops at each completion's own length
            diffs = [abs(a - b) for i, v in enumerate(ro.vllm_logps) for a, b in zip(lp[i].tolist(), v, strict=False)]
            t["logp_diff"].append(statistics.mean(diffs))
            sleep = functools.partial(g.sleep_vllm, llm) if keep else functools.partial(llm.sleep, level=2)
            timed(t, "sleep", sleep)
            timed(t, "gather alone", functools.partial(gather_all, bucket))
            if i == 0:  # the warm-up cycle
                t.clear()
        g.gathered_params, llm.apply_model = gather, apply
        med = {k: statistics.median(v) for k, v in t.items()}
        phases = "  ".join(f"{k} {v:.1f}" if k != "logp_diff" else f"{k} {v:.4f}" for k, v in med.items())
        coloc = med["wake+push+wake"] + med["sleep"]
        g.say(f"COLOC {name:28s} {phases}  | co-location (wake+push+sleep) {coloc:.0f} ms", rank0=True)
    dist.barrier()


if __name__ == "__main__":
    main()
