"""The peer in bench/README.md "Ours vs TRL": TRL's GRPOTrainer (tested: TRL 1.16.0) on exactly grpo_colocate.py's
task and settings -- the same rows (the built-in task's chat prompts, system prompt + few-shot, as they are), reward
functions (as they are) and weights, completions per step, completion length, optimizer, ZeRO-3 config
(ds_zero3.json), vLLM memory share, sleep level 2, no dropout, and the same importance-sampling correction (per token,
min(exp(logp_trainer - logp_vllm), 3): TRL's "token_truncate"; TRL's default is "sequence_mask") -- so that the two
step times compare like for like. Needs `pip install trl datasets` beside requirements.txt.

  colocate, 1 GPU:  MODEL=path STEPS=20 BS=32 GAS=1 G=8 MAXTOK=128 torchrun --nproc_per_node 1 bench/trl_peer.py
    (= torchrun --nproc_per_node 1 grpo_colocate.py --model path --max_steps 20 --per_device_train_batch_size 32
       --gradient_accumulation_steps 1 --num_generations 8 --max_completion_length 128)
  server mode:      CUDA_VISIBLE_DEVICES=1 trl vllm-serve --model path --gpu_memory_utilization 0.9 \\
                        --max_model_len 768 &
                    SLEEP=0 MODE=server CUDA_VISIBLE_DEVICES=0 MODEL=path STEPS=8 BS=16 GAS=4 G=8 MAXTOK=256 \\
                        torchrun ...
    (`trl vllm-serve` runs vLLM's OpenAI server: it needs uvicorn, fastapi, watchfiles, ... beyond requirements.txt)
env: MODEL (default: the offline copy of SmolLM2-135M-Instruct that offline_model.py builds, ~/.cache/grpo_colocate),
STEPS, BS (completions per micro-batch), GAS, G, MAXTOK, LR (1e-5), MODE (colocate|server), DS (1: ZeRO-3), SLEEP
(1), GC (0: gradient checkpointing), OUTJ (append the result line to this file).
Prints one line `TRLPEER {json}`: the seconds of steps 2..N (each optimizer step = one generation round; a
callback stamps the end of each step, so step 1 has no start) and their median without step 2, as samples/s, and
rank 0's peak torch.cuda.max_memory_reserved() in GiB (max_memory_reserved_gib). A run that raises (CUDA out of
memory) prints `TRLPEER {json}` with `error`, its steps done and that peak, then raises on.
Importing it needs no TRL and builds nothing: peer_rows(n) and peer_reward_funcs() are what main() hands TRL."""

import dataclasses
import json
import os
import statistics
import sys
import time

import torch
from transformers import TrainerCallback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # grpo_colocate, offline_model
import grpo_colocate as g  # noqa: E402 (from the folder above, put on sys.path just above)
import offline_model  # noqa: E402 (from the folder above, put on sys.path just above)

NUM_ROWS = 4000  # the peer's dataset: enough prompts for its steps (TRL starts it over when they run out)


def peer_rows(n: int) -> list[dict]:
    """The first n training rows of grpo_colocate's built-in task (its default seed and eval set) as they are: TRL's
    conversational form, `prompt` the chat messages (system prompt, few-shot turns, question), `answer` the
    reference -- what goes into the peer's datasets.Dataset.from_list."""
    cfg = g.Config()
    task = g.ArithmeticTask(cfg.seed, cfg.num_eval_prompts)
    return [task[i] for i in range(n)]


def peer_reward_funcs() -> list[tuple]:
    """(reward function, weight) pairs: ours and their default weights. They take TRL's keyword arguments and its
    conversational completions as they are; TRL names their metrics by __name__ (rewards/correctness_reward/...)."""
    return [
        (fn, g.DEFAULT_REWARD_WEIGHTS.get(name, 1.0))
        for name, fn in [("correctness", g.correctness_reward), ("format", g.format_reward)]
    ]


def max_memory_reserved_gib() -> float | None:
    """This process's peak of torch's reserved GPU memory (the trainer's and, in colocate mode, vLLM's pool), as
    grpo_colocate.py logs it in memory/max_reserved_gib; None on CPU."""
    return round(torch.cuda.max_memory_reserved() / 2**30, 2) if torch.cuda.is_available() else None


class StepClock(TrainerCallback):
    def __init__(self):
        self.t = []

    def on_step_end(self, args, state, control, **kw):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.t.append(time.perf_counter())


def main() -> None:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    E = os.environ
    STEPS, BS, GAS, G = int(E.get("STEPS", "8")), int(E.get("BS", "32")), int(E.get("GAS", "1")), int(E.get("G", "8"))
    MAXTOK = int(E.get("MAXTOK", "128"))
    # the default model: built here once per machine (or by offline_model.py, run.sh, bench/vs_trl.py)
    MODEL = E.get("MODEL") or offline_model.build()
    reward_funcs, reward_weights = zip(*peer_reward_funcs(), strict=True)
    # the cap of the per-token weight: vllm_importance_sampling_clip_max in TRL >= 1.6 (the older name is deprecated)
    IS_CAP = "vllm_importance_sampling_cap"
    if "vllm_importance_sampling_clip_max" in {f.name for f in dataclasses.fields(GRPOConfig)}:
        IS_CAP = "vllm_importance_sampling_clip_max"
    args = GRPOConfig(
        output_dir=E.get("OUT_DIR", "/tmp/trl_peer"),
        max_steps=STEPS,
        per_device_train_batch_size=BS,
        gradient_accumulation_steps=GAS,
        num_generations=G,
        max_completion_length=MAXTOK,
        temperature=1.0,
        learning_rate=float(E.get("LR", "1e-5")),
        adam_beta2=0.99,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        beta=0.0,
        loss_type="dapo",
        gradient_checkpointing=E.get("GC", "0") == "1",
        bf16=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
        use_vllm=True,
        vllm_mode=E.get("MODE", "colocate"),
        vllm_gpu_memory_utilization=0.3,
        vllm_enable_sleep_mode=E.get("SLEEP", "1") == "1",
        vllm_max_model_length=256 + MAXTOK,
        reward_weights=list(reward_weights),
        disable_dropout=True,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_truncate",
        **{IS_CAP: 3.0},
        deepspeed=(os.path.join(ROOT, "ds_zero3.json") if E.get("DS", "1") == "1" else None),
    )
    clock = StepClock()
    tr = GRPOTrainer(
        model=MODEL,
        reward_funcs=list(reward_funcs),
        args=args,
        train_dataset=Dataset.from_list(peer_rows(NUM_ROWS)),
        callbacks=[clock],
    )
    t0 = time.perf_counter()
    try:
        tr.train()
    except Exception as e:
        # at the users' scale a side may run out of memory: bench/vs_trl.py still shows how far it got and its peak
        if tr.accelerator.is_main_process:
            failed = dict(error=f"{type(e).__name__}: {e}"[:500], steps_done=len(clock.t))
            print("TRLPEER", json.dumps({**failed, "max_memory_reserved_gib": max_memory_reserved_gib()}), flush=True)
        raise
    wall = time.perf_counter() - t0
    if tr.accelerator.is_main_process:
        d = [b - a for a, b in zip(clock.t, clock.t[1:], strict=False)]
        med = statistics.median(d[1:] if len(d) > 2 else d)
        world = tr.accelerator.num_processes
        samples = BS * GAS * world
        dsp = tr.accelerator.state.deepspeed_plugin
        out = dict(
            zero_stage=dsp.zero_stage if dsp else None,
            gc=args.gradient_checkpointing,
            mode=args.vllm_mode,
            ds=E.get("DS", "1"),
            model=MODEL,
            steps=STEPS,
            samples_per_step=samples,
            maxtok=MAXTOK,
            world=world,
            train_wall_s=round(wall, 1),
            step_s=[round(x, 3) for x in d],
            median_step_s=round(med, 3),
            samples_per_s=round(samples / med, 2),
            max_memory_reserved_gib=max_memory_reserved_gib(),
        )
        logs = [h for h in tr.state.log_history if "loss" in h]
        if logs:
            out["last_log"] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in logs[-1].items()}
            out["mean_completion_length"] = [round(h.get("completions/mean_length", -1), 1) for h in logs]
        print("TRLPEER", json.dumps(out), flush=True)
        if E.get("OUTJ"):
            with open(E["OUTJ"], "a") as f:
                f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
