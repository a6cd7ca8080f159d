#!/usr/bin/env bash
# Lint and type-check (scripts/lint.sh), then run the test suite against real redis-server
# processes started by the fixtures. A lint or type finding fails before any test runs.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/lint.sh
# REDBATCH_TEST_PROCS=N runs the tests in N pytest processes (pytest-xdist), each with its own
# redis-server, whole files to each (--dist loadfile keeps a module's fixtures in one). Not
# the default: on two shared cores, tests that compare throughputs or wait for both of two
# workers to have read a stream failed now and then beside a second process (see git log).
procs="${REDBATCH_TEST_PROCS:-0}"
if [ "$procs" != 0 ]; then
  set -- -n "$procs" --dist loadfile "$@"
fi
exec .venv/bin/python -m pytest -q "$@"
