"""Training curves of one or more grpo_colocate runs, one line per run (labelled by its folder), four panels:
greedy eval accuracy (with the sampled accuracy dashed), format reward, the weight-sync check
(sampling/logp_diff_mean, log scale) and completion length; the training metrics as 10-step trailing means.

    python bench/plot.py runs/grpo                                   # -> runs/grpo/curves.png
    python bench/plot.py "runs/1 H200" "runs/2 H200" --out curves.png   # a run folder or its metrics.jsonl

matplotlib is an optional dependency: only this script needs it (`pip install matplotlib`).
"""

import argparse
import json
import os


def smooth(values: list, k: int = 10) -> list:
    """Trailing mean over the last k values."""
    return [
        sum(values[max(0, i - k + 1) : i + 1]) / len(values[max(0, i - k + 1) : i + 1]) for i in range(len(values))
    ]


def column(rows: list[dict], key: str) -> list:
    """One metric of every row, NaN where a row lacks it."""
    return [r.get(key, float("nan")) for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="run folders (output_dir) or metrics.jsonl files")
    ap.add_argument("--out", help="PNG to write (default: curves.png beside the first run's metrics)")
    args = ap.parse_args()
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
