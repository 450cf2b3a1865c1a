"""Training curves of one or more grpo_colocate runs, one line per run (labelled by its folder), four panels:
greedy eval accuracy (with the sampled accuracy dashed), format reward, the weight-sync check
(sampling/logp_diff_mean, log scale) and completion length; the training metrics as 10-step trailing means. With
--memory: the GPU memory of bench/memory_timeline.py recordings over a few steps, a panel each, phases marked.

    python bench/plot.py runs/grpo                                   # -> runs/grpo/curves.png
    python bench/plot.py "runs/1 H200" "runs/2 H200" --out curves.png   # a run folder or its metrics.jsonl
    python bench/plot.py --memory /tmp/t135m.json /tmp/t1p5b.json --labels "SmolLM2-135M" "random 1.5B"

matplotlib is an optional dependency: only this script needs it (`pip install matplotlib`).
"""

import argparse
import json
import os

import memory_timeline  # (this script's folder)

GiB = memory_timeline.GiB
PHASES = {  # the loop's timer phases, drawn as four bands
    "push": ("wake + push", "tab:orange"),  # (push: vLLM's wake-ups included)
    "generate": ("generate", "tab:green"),  # (the TP prompt exchange included)
    "sleep": ("sleep", "tab:red"),
    "reward": ("train", "tab:blue"),
    "train": ("train", "tab:blue"),
}


def smooth(values: list, k: int = 10) -> list:
    """Trailing mean over the last k values."""
    return [
        sum(values[max(0, i - k + 1) : i + 1]) / len(values[max(0, i - k + 1) : i + 1]) for i in range(len(values))
    ]


def column(rows: list[dict], key: str) -> list:
    """One metric of every row, NaN where a row lacks it."""
    return [r.get(key, float("nan")) for r in rows]


def memory_picture(paths: list[str], labels: list[str], out: str, first_step: int, num_steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(paths), 1, figsize=(12, 3.2 * len(paths)), squeeze=False)
    for ax, path, label in zip(axes[:, 0], paths, labels, strict=True):
        with open(path) as f:
            run = json.load(f)
        numbers = memory_timeline.summary(run)
        print(f"{label}: " + ", ".join(f"{name} {value:.2f}" for name, value in numbers.items()))
        start = run["steps"][first_step]
        end = run["steps"][first_step + num_steps]
        window = [s for s in run["samples"] if start <= s[0] <= end]
        t = [s[0] - start for s in window]
        trainer = [max(s[3], 0) / GiB for s in window]
        engine = [s[2] / GiB for s in window]
        rest = [max(s[1] / GiB - a - b, 0) for s, a, b in zip(window, trainer, engine, strict=True)]
        names = ["torch allocator: the trainer (and vLLM's CUDA graphs)", "vLLM: weights + KV cache", "other"]
        ax.stackplot(t, trainer, engine, rest, labels=names, colors=["tab:blue", "tab:orange", "lightgray"])
        # the axis starts below the trainer's least: what comes and goes is the engine's, a few GiB of many
        bottom = max(0.0, min(trainer) - 2)
        top = max(s[1] for s in window) / GiB + 1.5
        for name, span_start, span_end in run["spans"]:
            if name in PHASES and start <= span_start <= end:
                ax.axvspan(span_start - start, span_end - start, ymin=0.9, ymax=1.0, color=PHASES[name][1], lw=0)
        for phase, color in dict(PHASES.values()).items():
            ax.bar(0, 0, color=color, label=f"phase: {phase}")
        ax.set_ylim(bottom, top)
        ax.set_xlim(0, end - start)
        ax.set_ylabel(f"GiB (axis from {bottom:.0f})")
        title = f"{label}: steps {first_step}-{first_step + num_steps - 1}, peak {numbers['peak_gib']:.1f} GiB"
        ax.set_title(title, fontsize=9)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="*", help="run folders (output_dir) or metrics.jsonl files")
    ap.add_argument("--out", help="PNG to write (default: curves.png beside the first run's metrics)")
    ap.add_argument("--memory", nargs="+", help="instead: draw bench/memory_timeline.py recordings, a panel each")
    ap.add_argument("--labels", nargs="+", help="--memory: a title for each panel (default: the file names)")
    ap.add_argument("--first_step", type=int, default=2, help="--memory: the first step drawn")
    ap.add_argument("--num_steps", type=int, default=3, help="--memory: how many steps")
    args = ap.parse_args()
    if args.memory:
        return memory_picture(
            args.memory, args.labels or args.memory, args.out or "memory.png", args.first_step, args.num_steps
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [os.path.join(p, "metrics.jsonl") if os.path.isdir(p) else p for p in args.runs]
    out = args.out or os.path.join(os.path.dirname(paths[0]) or ".", "curves.png")
    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    for i, path in enumerate(paths):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        label = os.path.basename(os.path.dirname(os.path.abspath(path)))
        eval_key = (
            "eval/rewards/correctness" if any("eval/rewards/correctness" in r for r in rows) else "eval/accuracy"
        )
        train, ev = [r for r in rows if "reward" in r], [r for r in rows if eval_key in r]
        steps = [r["step"] for r in train]
        color = f"C{i}"
        if ev:
            ev_steps, ev_accuracy = [r["step"] for r in ev], [r[eval_key] for r in ev]
            ax[0, 0].plot(ev_steps, ev_accuracy, "o-", color=color, label=f"{label}: eval (greedy)")
        accuracy = "rewards/correctness" if train and "rewards/correctness" in train[0] else "accuracy"
        if train and accuracy in train[0]:
            ax[0, 0].plot(steps, smooth(column(train, accuracy)), "--", color=color, label=f"{label}: sampled")
        fmt = "rewards/format" if train and "rewards/format" in train[0] else "reward"
        fmt_label = label if fmt != "reward" else f"{label} (total reward)"
        ax[0, 1].plot(steps, smooth(column(train, fmt)), color=color, label=fmt_label)
        ax[1, 0].semilogy(steps, column(train, "sampling/logp_diff_mean"), color=color, label=label)
        ax[1, 1].plot(steps, smooth(column(train, "completions/mean_length")), color=color, label=label)
    titles = [
        "exact-answer accuracy",
        "format reward (10-step mean)",
        "mean |logp_vLLM - logp_trainer| per token (weight-sync check)",
        "completion length, tokens (10-step mean)",
    ]
    for a, title in zip(ax.flat, titles, strict=True):
        a.set_title(title, fontsize=10)
        a.set_xlabel("step")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
