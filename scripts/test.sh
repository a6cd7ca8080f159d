#!/usr/bin/env bash
# Run the test suite against real redis-server processes started by the fixtures.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
