"""Where one training micro-batch's time goes (bench/README.md, "Performance"): forward and backward of
grpo_colocate.sequence_logprobs on a plain transformers model and on the ZeRO-3 engine the script builds, each
with logits for every position (`AllPositions`: what a forward without `logits_to_keep` costs) and with logits
for the scored positions only (what the script does); then a torch.profiler table of one ZeRO-3 forward + backward.

    torchrun --nproc_per_node 1 bench/profile_train.py /tmp/random-1.5b      # MB=16 rows, T=512 completion tokens
    MB=8 T=256 torchrun --nproc_per_node 1 bench/profile_train.py            # the offline copy of the default model

Prompts are the script's real chat prompts (~130 tokens with SmolLM2's tokenizer); completions are random
token ids. Runs on CPU too (float32, gloo), for checking the script, not for timing.
"""

import os
import random
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo_colocate as g  # noqa: E402 (from the folder above, put on sys.path just above)
import offline_model  # noqa: E402 (from the folder above, put on sys.path just above)

# default: the offline copy of SmolLM2-135M-Instruct, built before the process group (save_pretrained then writes)
MODEL = sys.argv[1] if len(sys.argv) > 1 else offline_model.build()
MB, T = int(os.environ.get("MB", "16")), int(os.environ.get("T", "512"))
CUDA = torch.cuda.is_available()
dev = torch.device("cuda", 0) if CUDA else torch.device("cpu")
dtype = torch.bfloat16 if CUDA else torch.float32


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


tokenizer = AutoTokenizer.from_pretrained(MODEL)
source = g.prompt_source(g.Config())
prompts = [g.chat_prompt_ids(tokenizer, source[i]["prompt"]) for i in range(MB)]
rng = random.Random(0)
completions = [[rng.randrange(1000, min(40000, len(tokenizer))) for _ in range(T)] for _ in range(MB)]
print(
    f"{MB} rows: prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens + {T} completion tokens", flush=True
)


class AllPositions:
    """The model computing logits for every position of every row (the cost measured), of which
    sequence_logprobs is handed the positions it asked for."""

    def __init__(self, model):
        self.model = model

    def __call__(self, logits_to_keep, **inputs):
        out = self.model(**inputs)
        out.logits = out.logits[:, -logits_to_keep:]
        return out


def bench(name, model, backward, reps=4):
    """Mean forward and backward milliseconds over `reps` runs after one warm-up."""
    fwd, bwd = [], []
    for r in range(reps + 1):
        sync()
        t0 = time.perf_counter()
        logp, _ = g.sequence_logprobs(model, prompts, completions, 1.0, dev, 0)
        sync()
        t1 = time.perf_counter()
        backward(logp.sum() / logp.numel())
        sync()
        if r:
            fwd.append(t1 - t0)
            bwd.append(time.perf_counter() - t1)
    peak = ""
    if CUDA:
        peak = f"  torch peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
        torch.cuda.reset_peak_memory_stats()
    print(f"{name:26s} fwd {1000 * sum(fwd) / reps:7.1f} ms  bwd {1000 * sum(bwd) / reps:7.1f} ms{peak}", flush=True)


def plain_backward(loss) -> None:
    loss.backward()


# 1. the plain transformers model: what the matmuls cost without DeepSpeed
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=dtype).to(dev)
model.config.use_cache = False
model.train()
bench("plain, all positions", AllPositions(model), plain_backward)
bench("plain, logits_to_keep", model, plain_backward)
del model
if CUDA:
    torch.cuda.empty_cache()

# 2. the ZeRO-3 engine exactly as grpo_colocate builds it (grpo_colocate.setup)
dist.init_process_group("nccl" if CUDA else "gloo")
import deepspeed  # noqa: E402 (after grpo_colocate, which sets DeepSpeed's environment: DS_ACCELERATOR on CPU)
import deepspeed.ops  # noqa: E402 (the same)

if not CUDA:  # DeepSpeed would JIT-compile a shared-memory comm op that gloo does not use
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
deepspeed.init_distributed(dist_backend="nccl" if CUDA else "gloo")  # joins the process group
cfg = g.Config(model=MODEL, per_device_train_batch_size=MB, gradient_accumulation_steps=16)
engine = g.build_trainer(cfg, MODEL, g.fill_ds_config(cfg, dist.get_world_size(), CUDA), dtype)
engine.train()


def step(loss) -> None:
    engine.backward(loss, scale_wrt_gas=False)


bench("zero3, all positions", AllPositions(engine), step)
bench("zero3, logits_to_keep", engine, step)
with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])) as prof:
    logp, _ = g.sequence_logprobs(engine, prompts, completions, 1.0, dev, 0)
    step(logp.sum() / logp.numel())
    sync()
sort_by = "cuda_time_total" if CUDA else "cpu_time_total"
print(prof.key_averages().table(sort_by=sort_by, row_limit=20, max_name_column_width=60))
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
dist.destroy_process_group()
