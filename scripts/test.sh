#!/usr/bin/env bash
# Lint and type-check (scripts/lint.sh) and run the test suite against real redis-server
# processes started by the fixtures. Lint runs beside the first pass (CI has 15 minutes on two
# cores); a lint or type finding fails the run, after that pass, with the findings printed.
#
# Two passes. The first runs every test not marked `serial` in REDBATCH_TEST_PROCS pytest
# processes (pytest-xdist; default 3 on two cores, as many tests wait on a timeout or a worker;
# whole files to each: --dist loadfile keeps a module's fixtures in one process, each with its
# own redis-server). The second runs the `serial` tests
# (those that compare timings, or wait on two workers at once) in one process, alone, so that a
# neighbour cannot fail them. REDBATCH_TEST_PROCS=0 runs everything in one process.
#
# Tiers: the default leaves out the tests marked `full` (soak-like loops, and costly variants
# of a behaviour another test covers); REDBATCH_TEST_TIER=full runs them too. Arguments go to
# both passes; pytest's exit code 5 (nothing selected, e.g. `-k` matched only one pass) counts
# as success.
set -euo pipefail
cd "$(dirname "$0")/.."
# Cache bytecode. This machine's environment sets PYTHONDONTWRITEBYTECODE=1 and setup.sh installs
# with --no-compile, so every process a test starts (each worker, pool process and command,
# hundreds a run) compiled every module it imports from source again: about 0.5 s of CPU each.
unset PYTHONDONTWRITEBYTECODE
# torch.compile (the compiled-path tests, calibration's compiled variants) compiles in the process
# that calls it: on two cores inductor's default pool of compile processes costs each its own
# torch import (40 s of CPU for one test against 30 s in-process, measured).
export TORCHINDUCTOR_COMPILE_THREADS="${TORCHINDUCTOR_COMPILE_THREADS:-1}"
scripts/setup.sh
procs="${REDBATCH_TEST_PROCS:-3}"
if [ "${REDBATCH_TEST_TIER:-default}" = full ]; then
  all="" parallel="not serial" alone="serial"
else
  all="not full" parallel="not full and not serial" alone="not full and serial"
fi
pytest=(.venv/bin/python -m pytest -q)
if [ "$procs" = 0 ]; then
  scripts/lint.sh
  exec "${pytest[@]}" -m "$all" "$@"
fi
lint_log=$(mktemp)
trap 'rm -f "$lint_log"' EXIT
scripts/lint.sh >"$lint_log" 2>&1 &
lint=$!
pass() { "${pytest[@]}" "$@" || { rc=$?; [ "$rc" = 5 ] || return "$rc"; }; }
first=0
pass -n "$procs" --dist loadfile -m "$parallel" "$@" || first=$?
if ! wait "$lint"; then
  cat "$lint_log" >&2
  echo "lint: failed (scripts/lint.sh)" >&2
  exit 1
fi
[ "$first" = 0 ] || exit "$first"
pass -p no:xdist -m "$alone" "$@"
