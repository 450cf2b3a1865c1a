"""GPU memory over a few training steps, with the phases marked: what the trainer holds, what the vLLM engine holds
awake, and how sleep gives it back. Records rank 0 of a grpo_colocate.py run (any of its options); plot.py draws it.

    MEMORY_TIMELINE=/tmp/t135m.json torchrun --nproc_per_node 1 bench/memory_timeline.py --max_steps 8 --eval_steps 0
    MEMORY_TIMELINE=/tmp/t1p5b.json torchrun --nproc_per_node 1 bench/memory_timeline.py --model /tmp/random-1.5b \\
        --max_steps 8 --per_device_train_batch_size 32 --gradient_accumulation_steps 2 --max_completion_length 256 \\
        --reward_funcs brevity --eval_steps 0
    python bench/plot.py --memory /tmp/t135m.json /tmp/t1p5b.json --labels "SmolLM2-135M" "random 1.5B"

Recording samples every 10 ms, from a thread: the GPU's used memory (cudaMemGetInfo: every process and allocator),
vLLM's (its sleep-mode allocator's allocations while mapped: weights and KV cache) and the trainer's (torch's reserved
memory less vLLM's pool). The rest is the CUDA context, NCCL, cuBLAS and vLLM's CUDA graphs. The phases are the
loop's own timer (PhaseTimer). At the end it prints the peaks (the fits-on-one-GPU table in the README).
"""

import json
import os
import statistics
import sys
import threading
import time
from contextlib import contextmanager

GiB = 2**30


def record(out: str) -> None:
    import torch
    import vllm

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import grpo_colocate as g

    t0 = time.perf_counter()
    samples, spans, steps = [], [], []  # (t, used, vllm, trainer) bytes; (phase, start, end); step start times
    awake = {}  # vLLM allocation tag -> mapped, from LLM.sleep / wake_up (level 2 unmaps every tag)

    def now():
        return time.perf_counter() - t0

    def vllm_allocations():
        from vllm.device_allocator.cumem import CuMemAllocator

        return [(d.tag, d.handle[1]) for d in list(CuMemAllocator.get_instance().pointer_to_data.values())]

    def sample(stop: threading.Event, device: int) -> None:
        while not stop.is_set():
            try:
                allocations = vllm_allocations()
            except RuntimeError:  # (the dict changed while it was read)
                continue
            free, total = torch.cuda.mem_get_info(device)
            mapped = sum(size for tag, size in allocations if awake.get(tag, True))
            trainer = torch.cuda.memory_reserved(device) - sum(size for _, size in allocations)
            samples.append((now(), total - free, mapped, trainer))
            time.sleep(0.01)

    sleep = vllm.LLM.sleep
    wake_up = vllm.LLM.wake_up
    timer_call = g.PhaseTimer.__call__
    push = g.wake_and_push_weights

    def sleep_and_note(self, *args, **kwargs):
        sleep(self, *args, **kwargs)
        awake.update(dict.fromkeys([tag for tag, _ in vllm_allocations()], False))

    def wake_up_and_note(self, tags=None):
        wake_up(self, tags=tags)
        awake.update(dict.fromkeys(tags or [tag for tag, _ in vllm_allocations()], True))

    opened = {}  # phase -> its start, while it runs

    @contextmanager
    def timed(self, name):
        with timer_call(self, name):
            start = opened[name] = now()
            yield
        del opened[name]
        spans.append((name, start, now()))

    def push_and_note(*args, **kwargs):
        if not steps:  # sampling from a thread while vLLM captures its CUDA graphs at start-up would break the capture
            threading.Thread(target=sample, args=(stop, torch.cuda.current_device()), daemon=True).start()
        steps.append(opened.get("push", now()))  # a step starts with its push phase (the final eval's push: untimed)
        return push(*args, **kwargs)

    vllm.LLM.sleep = sleep_and_note
    vllm.LLM.wake_up = wake_up_and_note
    g.PhaseTimer.__call__ = timed
    g.wake_and_push_weights = push_and_note
    stop = threading.Event()
    g.main(sys.argv[1:])
    stop.set()
    if g.RANK != 0:
        return
    peak = max(samples, key=lambda s: s[1])
    trainer_peak = max(s[3] for s in samples)
    vllm_peak = max(s[2] for s in samples)
    print(
        f"[memory_timeline] peak GPU memory {peak[1] / GiB:.1f} GiB; trainer up to {trainer_peak / GiB:.1f} GiB, vLLM "
        f"up to {vllm_peak / GiB:.2f} GiB awake; {torch.cuda.get_device_name()}; {len(samples)} samples",
        flush=True,
    )
    with open(out, "w") as f:
        json.dump({"argv": sys.argv[1:], "samples": samples, "spans": spans, "steps": steps}, f)


def summary(run: dict) -> dict:
    """Peak memory and the median step (steps 1 to the last but one) split by phase, from a recording."""
    steps = run["steps"]
    seconds = {"step": [], "generate": [], "co-location": [], "train": []}
    for start, end in zip(steps[1:-1], steps[2:], strict=True):
        spans = [(name, b - a) for name, a, b in run["spans"] if start <= a < end]
        seconds["step"].append(end - start)
        seconds["generate"].append(sum(d for name, d in spans if name == "generate"))  # (the TP exchange included)
        seconds["co-location"].append(sum(d for name, d in spans if name in ("push", "sleep")))  # (with wake-ups)
        seconds["train"].append(sum(d for name, d in spans if name in ("reward", "train")))
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    peak = max(s[1] for s in run["samples"]) / GiB
    return {"peak_gib": peak, "vllm_awake_gib": max(s[2] for s in run["samples"]) / GiB, **medians}


if __name__ == "__main__":
    record(os.environ.get("MEMORY_TIMELINE", "memory_timeline.json"))
