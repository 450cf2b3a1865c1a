"""Where vLLM's sleep(level=2) and wake_up spend their time: cProfile over cycles of the engine grpo_colocate.py
builds.

The engine alone (no trainer): wake_up(weights), the weights pushed from a plain transformers copy of --model by the
model's own load_weights (as the script does on GPU), wake_up(kv_cache), one step's batch generated, sleep(level=2);
six cycles, the first not profiled. Prints each cycle's phases in ms (`CYCLE` lines), then the cumulative and
own-time tables of sleep and of the two wake_ups over cycles 1-5. 1 GPU, sleep mode (CUDA only):

  torchrun --nproc_per_node 1 bench/sleep_profile.py --model /tmp/random-1.5b --per_device_train_batch_size 32 \\
      --gradient_accumulation_steps 2 --max_completion_length 256

Options are grpo_colocate.py's; without --model, the offline copy of the default model (offline_model.py). With no
trainer in the process, torch's allocator caches little: what vLLM's sleep costs the training loop beyond this (its
closing torch.cuda.empty_cache() returns the trainer's cached blocks) shows in the loop's time/sleep and time/train
(bench/README.md, "Sleep").
"""

import cProfile
import io
import os
import pstats
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo_colocate as g  # noqa: E402 (from the folder above, put on sys.path just above)
import offline_model  # noqa: E402 (from the folder above, put on sys.path just above)


def print_tables(name: str, profile: cProfile.Profile) -> None:
    """The cumulative and the own-time table of one profile."""
    s = io.StringIO()
    pstats.Stats(profile, stream=s).sort_stats("cumulative").print_stats(28)
    print(f"==== {name} (5 cycles)\n" + s.getvalue()[-9000:])
    s = io.StringIO()
    pstats.Stats(profile, stream=s).sort_stats("tottime").print_stats(15)
    print(f"==== {name} tottime\n" + s.getvalue()[-5000:])


def main() -> None:
    cfg = g.parse_config(sys.argv[1:])
    if cfg.model == g.Config.model:  # before the process group: save_pretrained then writes on every rank
        cfg.model = offline_model.build()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", timeout=g.DDP_TIMEOUT)
    source = g.preflight(cfg, 1).source
    model_path = cfg.model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    llm = g.build_vllm(cfg, model_path, True, torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(model_path)
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).cuda()
    ex = g.prompts_for_step(source, 0, cfg.completions_per_rank // cfg.num_generations, 1)
    ids, _ = g.encode_prompts(tok, [e["prompt"] for e in ex], cfg.max_prompt_length)
    sp = g.sampling_params(cfg.num_generations, cfg.temperature, cfg.max_completion_length)
    llm.sleep(level=2)
    ps, pw = cProfile.Profile(), cProfile.Profile()

    def load_weights(model):
        return model.load_weights(iter(hf.named_parameters()))

    for c in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if c:
            pw.enable()
        llm.wake_up(tags=["weights"])
        if c:
            pw.disable()
        t1 = time.perf_counter()
        llm.apply_model(load_weights)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if c:
            pw.enable()
        llm.wake_up(tags=["kv_cache"])
        if c:
            pw.disable()
        llm.reset_prefix_cache()
        t3 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in ids], sp, use_tqdm=False)
        t4 = time.perf_counter()
        torch.cuda.synchronize()
        t5 = time.perf_counter()
        if c:
            ps.enable()
        llm.sleep(level=2)
        if c:
            ps.disable()
        t6 = time.perf_counter()
        print(
            f"CYCLE {c}: wake_w {1e3 * (t1 - t0):.1f} push {1e3 * (t2 - t1):.1f} wake_kv {1e3 * (t3 - t2):.1f} gen "
            f"{1e3 * (t4 - t3):.0f} sync {1e3 * (t5 - t4):.1f} sleep {1e3 * (t6 - t5):.1f} ms",
            flush=True,
        )
    for name, p in (("SLEEP", ps), ("WAKE", pw)):
        print_tables(name, p)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
