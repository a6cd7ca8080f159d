#!/usr/bin/env bash
# The main job: score a folder of photos (default: samples/) with the default model into
# results.jsonl (or $OUTPUT), then print it. With no REDBATCH_REDIS_URL set, redbatch starts a
# private redis-server and a local worker and stops both when done.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
"$here/scripts/setup.sh"
out="${OUTPUT:-results.jsonl}"
"$here/.venv/bin/redbatch" score "${@:-$here/samples}" -o "$out" --overwrite
cat "$out"
