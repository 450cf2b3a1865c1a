"""Ours vs TRL colocate on the same GPUs, in turn (ours, TRL, ours, TRL, ...): a row of the README's "Ours vs TRL"
table as one command. Each round runs grpo_colocate.py with the options given, then bench/trl_peer.py with the same
model, steps, batch, group size, completion length, learning rate and gradient checkpointing (the rest: the script's
defaults). Ours: the median over steps 1..N-1 (bench/step_split.py); TRL: over its 3rd to last step. Each side's
peak GPU memory twice: torch.cuda.max_memory_reserved() of its rank 0 over the run (max_memory_reserved: ours' from its
metrics, memory/max_reserved_gib, TRL's from its TRLPEER line), and the physical peak, the largest memory.used of any
GPU that nvidia-smi reports every 100 ms while the side runs (every process and allocator: vLLM's sleep-mode pool,
the CUDA context, NCCL).

    python bench/vs_trl.py --rounds 2 -- --model /tmp/random-1.5b --max_steps 8 --per_device_train_batch_size 32 \\
        --gradient_accumulation_steps 2 --max_completion_length 256 --eval_steps 0
    python bench/vs_trl.py --rounds 2 --trl_steps 15            # the defaults (SmolLM2; ours 200 steps, TRL 15)
    python bench/vs_trl.py --dry_run -- --max_steps 8           # print the two commands, run nothing
    python bench/vs_trl.py --rounds 1 --only ours -- ...        # one side (then --only trl): each under a time limit

An option of ours that the peer does not mirror is refused (status 2). Without --model both sides run the offline
default model. TRL needs `pip install trl==1.16.0 datasets`. Prints a line per run and `VSTRL {json}`. A run that
fails (CUDA out of memory) is shown with its error, its steps done and its peak where it logged one, the rounds go on,
the ratio is over the rounds where both sides finished, and the exit status is 1.
"""

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from step_split import read_rows, split  # noqa: E402 (this script's folder, put on sys.path just above)

import grpo_colocate as g  # noqa: E402 (from the folder above, put on sys.path just above)
import offline_model  # noqa: E402 (from the folder above, put on sys.path just above)


def fail(message: str, status: int = 2):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(status)


# grpo_colocate option -> the environment variable bench/trl_peer.py reads for it
MIRRORED = dict(model="MODEL", max_steps="STEPS", per_device_train_batch_size="BS", gradient_accumulation_steps="GAS")
MIRRORED.update(num_generations="G", max_completion_length="MAXTOK", learning_rate="LR", gradient_checkpointing="GC")
OURS_ONLY = {"eval_steps", "num_eval_prompts"}  # ours' eval: not in the median of its steps


def given_options(ours_args: list[str]) -> set[str]:
    return {a[2:].split("=")[0] for a in ours_args if a.startswith("--")}


def commands(
    ours_args: list[str], nproc: int, trl_steps: int | None, out: str, round_: int
) -> tuple[list[str], list[str], dict]:
    """Ours' command, TRL's command and the environment that makes the peer mirror ours' options."""
    given = given_options(ours_args)
    refused = sorted(given - set(MIRRORED) - OURS_ONLY)
    if refused:
        fail(
            f"bench/trl_peer.py does not mirror --{', --'.join(refused)}: only --{', --'.join(MIRRORED)} "
            "(and ours' --eval_steps, --num_eval_prompts)"
        )
    cfg = g.parse_config(ours_args)
    # without --model: ours gets the offline default model, the peer its own default (the same folder)
    model = [] if "model" in given else ["--model", offline_model.folder()]
    values = {opt: getattr(cfg, opt) for opt in MIRRORED if opt != "model" or "model" in given}
    env = {MIRRORED[opt]: str(int(v) if isinstance(v, bool) else v) for opt, v in values.items()}
    env.update(STEPS=str(trl_steps or cfg.max_steps), OUT_DIR=os.path.join(out, f"trl-{round_}"))
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    ours = run + [os.path.join(os.path.dirname(HERE), "grpo_colocate.py"), *model, *ours_args]
    ours += ["--output_dir", os.path.join(out, f"ours-{round_}")]
    return ours, run + [os.path.join(HERE, "trl_peer.py")], env


def summary(ours: list[dict], trl: list[dict]) -> dict:
    """Per round and over rounds: ours' split (step_split.split) against TRL's TRLPEER figures, each side's peak
    memory; a failed run (`error`) gives its error instead of its figures, and the medians and ratio are over the
    rounds where both sides finished (none such: no ratio)."""
    rounds = []
    for o, t in zip(ours, trl, strict=True):
        r = {}
        if "error" in o:
            r.update(ours_error=o["error"], ours_steps_done=o.get("steps"))
        else:
            r.update(ours_step_s=o["step_s"], ours_gen_coloc_train_s=[o["gen_s"], o["coloc_s"], o["train_s"]])
            r.update(ours_samples_per_s=o["samples_per_sec"], ours_coloc_share=o["coloc_share"])
        if "error" in t:
            r.update(trl_error=t["error"], trl_steps_done=t.get("steps_done"))
        else:
            r.update(trl_step_s=t["median_step_s"], trl_samples_per_s=t["samples_per_s"])
        if "error" not in o and "error" not in t:
            r["ours_over_trl"] = o["samples_per_sec"] / t["samples_per_s"]
        r.update(
            ours_max_memory_reserved_gib=o.get("max_memory_reserved_gib"),
            trl_max_memory_reserved_gib=t.get("max_memory_reserved_gib"),
            ours_physical_peak_gib=o.get("physical_peak_gib"),
            trl_physical_peak_gib=t.get("physical_peak_gib"),
        )
        rounds.append(r)
    done = [r for r in rounds if "ours_over_trl" in r]
    if not done:
        return {"rounds": rounds}
    ours_median = statistics.median(r["ours_samples_per_s"] for r in done)
    trl_median = statistics.median(r["trl_samples_per_s"] for r in done)
    ratios = [r["ours_over_trl"] for r in done]
    return {
        "rounds": rounds,
        "ours_samples_per_s": ours_median,
        "trl_samples_per_s": trl_median,
        "ours_over_trl": ours_median / trl_median,
        "ours_over_trl_range": [min(ratios), max(ratios)],
    }


def error_line(text: str) -> str:
    """The line of a failed run's log that says why: CUDA's out-of-memory message (with the sizes) where there is one,
    else the first line naming an error."""
    lines = [ln.strip() for ln in text.splitlines() if "Error" in ln or "out of memory" in ln.lower()]
    oom = [ln for ln in lines if "out of memory" in ln.lower()]
    return (oom or lines or ["(no error line in the log)"])[0][:500]


def ours_result(rc: int, text: str, metrics: str) -> dict:
    """Ours' figures (step_split.split with its peak memory), or, for a failed run, its error, steps done and the
    peak of the steps it logged."""
    rows = read_rows(metrics) if os.path.isfile(metrics) else []
    if rc == 0:
        return split(rows)
    steps = [r for r in rows if "time/step" in r]
    peaks = [r["memory/max_reserved_gib"] for r in steps if "memory/max_reserved_gib" in r]
    return dict(
        error=f"status {rc}: {error_line(text)}", steps=len(steps), max_memory_reserved_gib=max(peaks, default=None)
    )


def trl_result(rc: int, text: str, log: str) -> dict:
    """TRL's TRLPEER figures; for a failed run its own TRLPEER line (error, steps done, peak) where it printed one."""
    line = next((ln for ln in text.splitlines() if ln.startswith("TRLPEER ")), None)
    t = json.loads(line[len("TRLPEER ") :]) if line else {}
    if rc != 0 or line is None:
        why = t.get("error") or (error_line(text) if rc != 0 else f"no TRLPEER line in {log}")
        t = {**t, "error": f"status {rc}: {why}"}
    return t


def gib(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} GiB"


class PhysicalPeak:
    """While in use: the largest memory.used of any GPU, polled by nvidia-smi every 100 ms (without it: None)."""

    def __enter__(self):
        self.peak_mib = None
        self.poller = None
        if shutil.which("nvidia-smi"):
            query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-lms", "100"]
            self.poller = subprocess.Popen(query, stdout=subprocess.PIPE, text=True)
            self.reader = threading.Thread(target=self.read, daemon=True)
            self.reader.start()
        return self

    def read(self):
        for line in self.poller.stdout:  # one line per GPU per poll, in MiB
            if line.strip().isdigit():
                self.peak_mib = max(self.peak_mib or 0, int(line))

    def __exit__(self, *exc):
        if self.poller:
            self.poller.terminate()
            self.reader.join(5)

    def gib(self) -> float | None:
        return None if self.peak_mib is None else round(self.peak_mib / 1024, 2)


def run_logged(cmd: list[str], env: dict, log: str) -> tuple[int, str, float | None]:
    """Run to the end with its output in `log`: its status, the log and the physical peak (GiB); on failure the end
    of the log goes to stderr (the caller goes on: the other side's figures are still wanted)."""
    with open(log, "w") as f, PhysicalPeak() as peak:
        rc = subprocess.run(cmd, env={**os.environ, **env}, stdout=f, stderr=subprocess.STDOUT).returncode
    text = Path(log).read_text()
    if rc != 0:
        print(text[-3000:], file=sys.stderr)
        print(f"error: {shlex.join(cmd)} exited with status {rc} (log: {log})", file=sys.stderr, flush=True)
    return rc, text, peak.gib()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], usage="python bench/vs_trl.py [options] -- [grpo_colocate options]"
    )
    p.add_argument("--rounds", type=int, default=2, help="ours then TRL, this many times")
    p.add_argument("--nproc", type=int, default=0, help="ranks per side (0: every visible GPU)")
    p.add_argument("--trl_steps", type=int, default=0, help="TRL's steps (0: ours' --max_steps)")
    p.add_argument("--out", default="/tmp/vs_trl", help="logs and ours' output_dir per round (replaced)")
    p.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--only", choices=["ours", "trl"], help="run this side alone (no ratio)")
    argv = sys.argv[1:]
    own, ours_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = p.parse_args(own)
    if not args.nproc:
        import torch

        args.nproc = torch.cuda.device_count() or 1
    os.makedirs(args.out, exist_ok=True)
    ours_runs, trl_runs = [], []
    for r in range(args.rounds):
        ours, trl, env = commands(ours_args, args.nproc, args.trl_steps or None, args.out, r)
        if args.dry_run:
            print("ours:", shlex.join(ours))
            print("TRL: ", " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(trl))
            return
        if "model" not in given_options(ours_args):
            offline_model.build()  # once, before either side's ranks look for it
        if args.only != "trl":
            ours_runs.append(run_ours(ours, args.out, r))
        if args.only != "ours":
            trl_runs.append(run_trl(trl, env, args.out, r))
    if args.only:
        runs = ours_runs or trl_runs
        print("VSTRL", json.dumps({args.only: runs}), flush=True)
        sys.exit(1 if any("error" in run for run in runs) else 0)
    s = summary(ours_runs, trl_runs)
    print("VSTRL", json.dumps(s), flush=True)
    done = sum("ours_over_trl" in r for r in s["rounds"])
    if done:
        low, high = s["ours_over_trl_range"]
        print(f"ours / TRL {s['ours_over_trl']:.2f}x in samples/s (medians over {done} rounds; {low:.2f}-{high:.2f}x)")
    else:
        print("ours / TRL: no round where both sides finished")
    if done < args.rounds:
        sys.exit(1)


def peaks(run: dict) -> str:
    return f"max_memory_reserved {gib(run.get('max_memory_reserved_gib'))}, physical {gib(run['physical_peak_gib'])}"


def run_ours(cmd: list[str], out: str, r: int) -> dict:
    """Round r of ours: its figures (ours_result) and physical peak, and a line."""
    shutil.rmtree(os.path.join(out, f"ours-{r}"), ignore_errors=True)  # (an earlier call's, of any config)
    rc, text, physical = run_logged(cmd, {}, os.path.join(out, f"ours-{r}.log"))
    s = ours_result(rc, text, os.path.join(out, f"ours-{r}", "metrics.jsonl"))
    s["physical_peak_gib"] = physical
    if "error" in s:
        print(f"round {r + 1} ours: failed after {s['steps']} steps, {peaks(s)}: {s['error']}", flush=True)
    else:
        split_s = f"{s['gen_s']:.3f} / {s['coloc_s']:.3f} / {s['train_s']:.3f}"
        rate = f"{s['samples_per_sec']:.1f} samples/s"
        print(f"round {r + 1} ours: {s['step_s']:.3f} s/step ({split_s}), {rate}, {peaks(s)}", flush=True)
    return s


def run_trl(cmd: list[str], env: dict, out: str, r: int) -> dict:
    """Round r of TRL: its TRLPEER figures (trl_result) and physical peak, and a line."""
    log = os.path.join(out, f"trl-{r}.log")
    rc, text, physical = run_logged(cmd, env, log)
    t = trl_result(rc, text, log)
    t["physical_peak_gib"] = physical
    if "error" in t:
        print(
            f"round {r + 1} TRL:  failed after {t.get('steps_done', '?')} steps, {peaks(t)}: {t['error']}", flush=True
        )
    else:
        rate = f"{t['samples_per_s']:.1f} samples/s"
        print(f"round {r + 1} TRL:  {t['median_step_s']:.3f} s/step, {rate}, {peaks(t)}", flush=True)
    return t


if __name__ == "__main__":
    main()
