#!/usr/bin/env bash
# Lint and type-check (scripts/lint.sh), then run the test suite against real redis-server
# processes started by the fixtures. A lint or type finding fails before any test runs.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/lint.sh
# Two pytest processes (pytest-xdist), each with its own redis-server, whole files to each
# (--dist loadfile keeps a module's fixtures, e.g. test_compose's live services, in one):
# most tests wait on processes and Redis, so two cores run two at once. REDBATCH_TEST_PROCS
# sets another count; 0 runs them in this process (as --redis-url needs).
exec .venv/bin/python -m pytest -q -n "${REDBATCH_TEST_PROCS:-2}" --dist loadfile "$@"
