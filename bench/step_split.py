"""A run's step time split as the READMEs' tables give it, from its metrics.jsonl: the median over steps 1..N-1 (step
0 warms up: CUDA graphs, the first wake) of time/step and of its phases -- gen = time/generate (the TP prompt exchange,
generation, decoding), co-loc = time/push (its wake-ups included) + time/sleep (the price of co-location), train =
time/train -- with samples/s, tok/s, the co-location share of the step, the generation rate, the weight-sync check,
vLLM's memory awake / asleep and the run's peak torch.cuda.max_memory_reserved() (memory/max_reserved_gib, rank 0's;
runs that log it). Runs logged before the exchange and the wake-ups were timed within generate and push (time/exchange,
time/wake) split the same: those count in gen and push.

    python bench/step_split.py runs/grpo "runs/1 H200"        # run folders (output_dir) or metrics.jsonl files
    python bench/step_split.py /tmp/run --model /tmp/random-1.5b-qwen --gradient_checkpointing  # + TFLOP/s

With --model (the run's model) it also prints the train phase's achieved TFLOP/s, over time/train, against the
card's measured bf16 peak (--peak_tflops), from the work the trainer's pass computes:
F = k N T + k layers hidden sum(L^2) + 8 V hidden C per step: k = 6 (8 with --gradient_checkpointing: the forward
again), N the parameters without the embedding and the LM head, T the tokens the decoder computes
(`train/decoder_tokens`: pads included when the rows are padded), L each row's length (`train/decoder_tokens_squared`:
each sequence's length when packed, the micro-batch's longest when padded; causal attention is half of 4 L^2 hidden a
layer forward), and V hidden C the LM head over the C completion tokens (its chunks are recomputed in backward: always
8). Runs that log no `train/decoder_tokens` get no TFLOP/s.

Prints one `SPLIT {json}` line and one readable line per run.
"""

import argparse
import json
import os
import statistics


def timed_steps(rows: list[dict]) -> list[dict]:
    """The steps the medians run over: 1..N-1 (eval-only lines, without time/step, are skipped)."""
    steps = [r for r in rows if "time/step" in r]
    return steps[1:] or steps  # a 1-step run has only its warm-up step


def split(rows: list[dict]) -> dict:
    """The table's figures for one run's metrics lines."""
    steps = [r for r in rows if "time/step" in r]
    timed = timed_steps(rows)

    def med(f) -> float:
        return statistics.median(f(r) for r in timed)

    def t(r: dict, *keys: str) -> float:
        return sum(r.get(f"time/{k}", 0.0) for k in keys)

    # (older runs: time/exchange apart from time/generate, time/wake apart from time/push)
    gen, push = ("generate", "exchange"), ("push", "wake")
    step = med(lambda r: r["time/step"])
    coloc = med(lambda r: t(r, *push, "sleep"))
    evals = [r.get("eval/rewards/correctness", r.get("eval/accuracy")) for r in rows]  # (older runs: eval/accuracy)
    evals = [e for e in evals if e is not None]
    return {
        "steps": len(steps),
        "step_s": step,
        "gen_s": med(lambda r: t(r, *gen)),
        "coloc_s": coloc,
        "train_s": med(lambda r: t(r, "train")),
        "push_s": med(lambda r: t(r, *push)),
        "sleep_s": med(lambda r: t(r, "sleep")),
        "coloc_share": coloc / step,
        "samples_per_sec": med(lambda r: r["samples_per_sec"]),
        "tokens_per_sec": med(lambda r: r["tokens_per_sec"]),
        "generate_tokens_per_sec": med(lambda r: r["generate_tokens_per_sec"]),
        "logp_diff_mean": statistics.mean(r["sampling/logp_diff_mean"] for r in steps),
        "logp_diff_max": max(r["sampling/logp_diff_max"] for r in steps),
        "vllm_awake_gib": steps[0].get("memory/vllm_awake_gib"),
        "vllm_asleep_gib": steps[0].get("memory/vllm_asleep_gib"),
        # the peak so far at each step: the run's peak is the largest (older runs log none)
        "max_memory_reserved_gib": max(
            (r["memory/max_reserved_gib"] for r in steps if "memory/max_reserved_gib" in r), default=None
        ),
        "eval_accuracy": (evals[0], evals[-1], max(evals)) if evals else None,
    }


def model_shape(model_dir: str) -> dict:
    """What the FLOP count needs of a model: its parameters without the embedding and the LM head, layers, hidden
    size and vocabulary."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):  # shapes only, no memory
        model = AutoModelForCausalLM.from_config(config)
    vocabulary_sized = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    body = sum(p.numel() for p in model.parameters() if id(p) not in vocabulary_sized)
    text = config.get_text_config()
    return {
        "body_params": body,
        "layers": text.num_hidden_layers,
        "hidden": text.hidden_size,
        "vocab": text.vocab_size,
    }


def train_tflops(rows: list[dict], shape: dict, gradient_checkpointing: bool) -> float | None:
    """The train phase's achieved TFLOP/s: the median over steps 1..N-1 of F / time/train (see the docstring)."""
    k = 8 if gradient_checkpointing else 6
    rates = []
    for r in timed_steps(rows):
        if "train/decoder_tokens" not in r:
            return None
        dense = k * shape["body_params"] * r["train/decoder_tokens"]
        attention = k * shape["layers"] * shape["hidden"] * r["train/decoder_tokens_squared"]
        head = 8 * shape["vocab"] * shape["hidden"] * r["completions/total_tokens"]
        rates.append((dense + attention + head) / r["time/train"] / 1e12)
    return statistics.median(rates)


def read_rows(path: str) -> list[dict]:
    """The json lines of a metrics.jsonl file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="*", default=["runs/grpo"], help="run folders (output_dir) or metrics.jsonl files")
    p.add_argument("--model", help="the runs' model: print the train phase's TFLOP/s")
    p.add_argument("--gradient_checkpointing", action="store_true", help="the runs recomputed activations")
    p.add_argument("--peak_tflops", type=float, default=790.0, help="the card's measured bf16 peak")
    args = p.parse_args()
    shape = model_shape(args.model) if args.model else None
    for arg in args.runs:
        path = os.path.join(arg, "metrics.jsonl") if os.path.isdir(arg) else arg
        rows = read_rows(path)
        s = split(rows)
        if shape:
            s["train_tflops"] = train_tflops(rows, shape, args.gradient_checkpointing)
        print("SPLIT", json.dumps({"run": arg, **s}))
        mem = ""
        if s["vllm_awake_gib"]:
            mem = f", vLLM {s['vllm_awake_gib']:.2f} GiB awake / {s['vllm_asleep_gib']:.2f} asleep"
        if s["max_memory_reserved_gib"] is not None:
            mem += f", max_memory_reserved {s['max_memory_reserved_gib']:.2f} GiB"
        ev = ""
        if s["eval_accuracy"]:
            ev = ", eval accuracy {:.3f} -> {:.3f} (max {:.3f})".format(*s["eval_accuracy"])
        print(
            f"{arg}: {s['steps']} steps, {s['step_s']:.2f} s/step ({s['gen_s']:.2f} / {s['coloc_s']:.2f} / "
            f"{s['train_s']:.2f}), {s['samples_per_sec']:.1f} samples/s, {s['tokens_per_sec']:.0f} tok/s; co-location "
            f"{100 * s['coloc_share']:.1f}% (push with its wake-ups {s['push_s']:.3f}, sleep {s['sleep_s']:.3f} s); "
            f"generation {s['generate_tokens_per_sec']:.0f} tok/s; logp_diff {s['logp_diff_mean']:.4f} mean, "
            f"{s['logp_diff_max']:.4f} max{mem}{ev}"
        )
        if shape and s["train_tflops"] is not None:
            share = 100 * s["train_tflops"] / args.peak_tflops
            print(f"{arg}: train phase {s['train_tflops']:.0f} TFLOP/s, {share:.0f}% of {args.peak_tflops:.0f}")


if __name__ == "__main__":
    main()
