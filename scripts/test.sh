#!/usr/bin/env bash
# Lint and type-check (scripts/lint.sh), then run the test suite against real redis-server
# processes started by the fixtures. A lint or type finding fails before any test runs.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/lint.sh
exec .venv/bin/python -m pytest -q "$@"
