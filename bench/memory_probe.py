"""What does vLLM keep on the GPU after sleep(level=2)? (bench/README.md, "Memory: what sleep gives back")

Builds the engine as grpo_colocate.py does (the same process group, the same LLM() arguments from the same
options), then prints device-wide GPU memory in use, relative to the start, after every stage:

    start          CUDA context + the NCCL process group (as grpo_colocate.main makes it), before anything else
    trainer warm-up (--warmup) one forward/backward/AdamW step of the model with plain transformers, then
                   everything freed: the library state (cuBLAS workspaces, attention kernels) a trainer
                   creates anyway, whether or not vLLM exists
    LLM()          and inside it vLLM's worker stages (init_device, load_model, ..., compile_or_warm_up_model)
    sleep(2)       + torch.cuda.empty_cache(), as grpo_colocate.setup does when it measures
    wake/sleep     one more cycle: does the residue grow per cycle?
    del LLM        engine gone: what stays for the life of the process

    torchrun --nproc_per_node 1 bench/memory_probe.py [--warmup] [--eager_nccl] [--snapshot] [grpo_colocate options]
    torchrun --nproc_per_node 2 bench/memory_probe.py --model /tmp/random-1.5b --vllm_tensor_parallel_size 2
    # other LLM() arguments (bench/llm_kwargs.py):
    LLM_KWARGS='{"compilation_config": {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}}' \\
        torchrun --nproc_per_node 1 bench/llm_kwargs.py bench/memory_probe.py --warmup

Without --model: the offline copy of grpo_colocate's default model (SmolLM2-135M-Instruct, built once into
~/.cache/grpo_colocate by offline_model.py).
--eager_nccl binds the process group to the GPU (init_process_group(device_id=...)): torch then creates the
NCCL communicator of every new group at once, vLLM's included, and that memory (2.3 GiB on an H200) stays
through sleep. grpo_colocate.main leaves device_id unset, so communicators are made on first use.
--snapshot records PyTorch's allocations from LLM() on and, after sleep, prints what stays: PyTorch's segments by
pool (vLLM's CUDA-graph pool is one), the live blocks grouped by the line outside torch that allocated them, and the
device memory PyTorch does not hold (CUDA graph objects, loaded kernels, communicators).
GPU only.
"""

import collections
import gc
import os
import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo_colocate as g  # noqa: E402 (from the folder above, put on sys.path just above)
import offline_model  # noqa: E402 (from the folder above, put on sys.path just above)

flags = {a for a in sys.argv[1:] if a in ("--warmup", "--eager_nccl", "--snapshot")}
cfg = g.parse_config([a for a in sys.argv[1:] if a not in flags])
local_rank = int(os.environ.get("LOCAL_RANK", 0))
torch.cuda.set_device(local_rank)
device = torch.device("cuda", local_rank)
model_path = cfg.model
if cfg.model == g.Config.model:  # built by local rank 0 before the process group; the all_gather below waits for it
    model_path = offline_model.build() if local_rank == 0 else offline_model.folder()
dist.init_process_group("nccl", device_id=device if "--eager_nccl" in flags else None, timeout=timedelta(seconds=600))
# as preflight's first collective (and the model is built)
dist.all_gather_object([None] * dist.get_world_size(), model_path)
torch.cuda.synchronize()
FREE0 = torch.cuda.mem_get_info()[0]
last = [0.0]


def mark(label: str) -> None:
    """Device-wide GiB in use relative to the start, the change since the previous mark, and the part
    PyTorch's caching allocator reserves (vLLM's sleep pool is outside it)."""
    torch.cuda.synchronize()
    used = (FREE0 - torch.cuda.mem_get_info()[0]) / 2**30
    if dist.get_rank() == 0:
        print(
            f"[mem] {label:44s} used {used:7.3f} GiB  (+{used - last[0]:7.3f})  torch reserved "
            f"{torch.cuda.memory_reserved() / 2**30:6.3f}  allocated {torch.cuda.memory_allocated() / 2**30:6.3f}",
            flush=True,
        )
    last[0] = used


def process_mib() -> str:
    """nvidia-smi's per-process figure (includes the CUDA context)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        mine = (
            line.split(",")[1].strip() for line in out.splitlines() if line.split(",")[0].strip() == str(os.getpid())
        )
        return next(mine, "?")
    except Exception as e:
        return f"? ({e})"


def time_stamp_worker_stages() -> None:
    """A mark after each of vLLM's worker stages (the worker runs in this process: external_launcher)."""
    from vllm.v1.worker import gpu_worker

    def wrap(fn, name):
        def inner(*a, **k):
            out = fn(*a, **k)
            mark(f"  vLLM worker.{name}")
            return out

        return inner

    for name in (
        "init_device",
        "load_model",
        "determine_available_memory",
        "initialize_from_config",
        "compile_or_warm_up_model",
    ):
        if hasattr(gpu_worker.Worker, name):
            setattr(gpu_worker.Worker, name, wrap(getattr(gpu_worker.Worker, name), name))


def residue(top: int = 12) -> None:
    """After sleep: PyTorch's segments by pool (vLLM's sleep pool is unmapped: listed, not in use), the live blocks
    outside it by the first frame outside torch that allocated them, and device memory outside PyTorch."""
    from vllm.device_allocator.cumem import CuMemAllocator

    slept = set(CuMemAllocator.get_instance().pointer_to_data)
    pools, sites, held = collections.Counter(), collections.Counter(), 0
    for seg in torch.cuda.memory._snapshot()["segments"]:
        if seg["address"] in slept:
            pools["vLLM sleep pool (unmapped while asleep)"] += seg["total_size"]
            continue
        pool_id = tuple(seg.get("segment_pool_id", (0, 0)))
        pools["default" if pool_id == (0, 0) else f"private pool {pool_id} (CUDA graphs)"] += seg["total_size"]
        held += seg["total_size"]
        for b in seg["blocks"]:
            if b["state"] != "active_allocated":
                continue
            frames = [f for f in b.get("frames", []) if "/torch/" not in f["filename"] and f["filename"] != "??"]
            f = frames[0] if frames else {"filename": "(before recording, or from C++ alone)", "line": 0, "name": ""}
            sites[f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"] += b["size"]
    if dist.get_rank() == 0:
        used = FREE0 - torch.cuda.mem_get_info()[0]
        for name, n in pools.most_common():
            print(f"[residue] {n / 2**20:9.1f} MiB  torch segments, {name}", flush=True)
        print(
            f"[residue] {(used - held) / 2**20:9.1f} MiB  outside PyTorch (graph objects, kernels, communicators)",
            flush=True,
        )
        for site, n in sites.most_common(top):
            print(f"[residue] {n / 2**20:9.1f} MiB  live, allocated at {site}", flush=True)


print(
    f"[env] CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING')} NCCL_NVLS_ENABLE="
    f"{os.environ.get('NCCL_NVLS_ENABLE')} flags={sorted(flags)} process {process_mib()}",
    flush=True,
)
mark("start")

if "--warmup" in flags:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    prompt = g.chat_prompt_ids(tok, "What is 12 + 30?")
    logp, _ = g.sequence_logprobs(model, [prompt] * 8, [[100] * 256] * 8, 1.0, device, 0)
    logp.mean().backward()
    opt.step()
    del model, opt, logp
    gc.collect()
    torch.cuda.empty_cache()
    mark("trainer warm-up (then freed)")

time_stamp_worker_stages()
if "--snapshot" in flags:
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
before = last[0]  # the summary counts from here: the trainer warm-up's library state is not vLLM's
llm = g.build_vllm(cfg, model_path, True, torch.bfloat16)  # sleep mode on, as in training
mark("LLM() built")
awake = last[0]
print(f"[mem] process after LLM(): {process_mib()}", flush=True)
llm.sleep(level=2)
mark("sleep(level=2)")
torch.cuda.empty_cache()
mark("+ empty_cache")
asleep = last[0]
if "--snapshot" in flags:
    residue()
print(f"[mem] process asleep: {process_mib()}", flush=True)
llm.wake_up(tags=["weights"])
llm.wake_up(tags=["kv_cache"])
mark("wake_up(weights), wake_up(kv_cache)")
llm.sleep(level=2)
torch.cuda.empty_cache()
mark("second sleep(level=2) + empty_cache")
del llm
gc.collect()
torch.cuda.empty_cache()
mark("LLM deleted")
awake, asleep = awake - before, asleep - before
warmup_note = " (counted from after the trainer warm-up)" if "--warmup" in flags else ""
print(
    f"[mem] summary: LLM() {awake:.2f} GiB, asleep {asleep:.2f} GiB -> sleep gives back "
    f"{100 * (1 - asleep / awake):.1f}%{warmup_note}; after deleting the engine {last[0] - before:.2f} GiB stays",
    flush=True,
)
dist.destroy_process_group()
