#!/usr/bin/env bash
# ruff and mypy --strict. mypy cannot follow the editable install's folder mapping, so it
# checks the package through a temporary link named like the import namespace.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pip install -q ruff mypy types-PyYAML >/dev/null 2>&1 || true
.venv/bin/ruff check . --exclude .venv
link_root=$(mktemp -d)
trap 'rm -rf "$link_root"' EXIT
ln -s "$PWD" "$link_root/redbatch"
(cd "$link_root" && MYPYPATH="$link_root" "$OLDPWD/.venv/bin/mypy" --config-file "$OLDPWD/pyproject.toml" \
  --exclude 'redbatch/(tests|bench|\.venv|build)/' -p redbatch)
