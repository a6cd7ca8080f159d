#!/usr/bin/env bash
# The main job: classify a folder of photos (default: samples/) with the default model.
# With no REDBATCH_REDIS_URL set, redbatch starts a private redis-server and a local worker
# and stops both when done. Prints one JSON line per photo.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
"$here/scripts/setup.sh"
exec "$here/.venv/bin/redbatch" submit --wait "${@:-$here/samples}"
