#!/usr/bin/env bash
# ruff over the whole tree; mypy --strict over the product; mypy over tests/ and over bench/ at
# the level set below. Any finding fails the script. The tools come pinned from setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
root=$PWD

.venv/bin/ruff check . --exclude .venv

# mypy cannot follow the editable install's folder mapping, so it reaches the package through a
# temporary link named like the import namespace.
link_root=$(mktemp -d)
trap 'rm -rf "$link_root"' EXIT
ln -s "$root" "$link_root/redbatch"
# One cache per run (they differ in options), all under the ignored .mypy_cache/.
mypy=("$root/.venv/bin/mypy" --config-file "$root/pyproject.toml")
cache="$root/.mypy_cache/lint"

(cd "$link_root" && MYPYPATH="$link_root" "${mypy[@]}" --cache-dir "$cache-product" \
  --exclude 'redbatch/(tests|bench|\.venv|build)/' -p redbatch)

# tests/ and bench/: strict's flags (every function annotated, every body checked), with only
# these allowances. They are set here rather than in pyproject.toml because these modules import
# each other by bare name (conftest, harness, ...), and mypy's per-module sections match dotted
# names, not folders: there is no pattern for "every module under tests/".
#   index, union-attr, arg-type, no-any-return, no-untyped-call: redis-py's stubs type replies
#     as wide unions (RESP2 | RESP3 shapes) and leave some calls untyped (execute_command,
#     parse_url); tests read replies they know the shape of.
#   --allow-untyped-decorators: the bench peers' decorators (Celery, Ray Serve, PyTriton) are
#     untyped here, where set-up does not install those packages.
#   --no-warn-unused-ignores: a `type: ignore` written for strict may cover a disabled code.
#   --follow-imports=silent: the product is followed for its types but checked strictly above.
loose=(--strict --explicit-package-bases --follow-imports=silent --allow-untyped-decorators
  --no-warn-unused-ignores --disable-error-code=index --disable-error-code=union-attr
  --disable-error-code=arg-type --disable-error-code=no-any-return
  --disable-error-code=no-untyped-call)

# Each from inside its folder, whose modules import each other by bare name. bench/soak.py
# imports tests/audit.py, so bench also sees tests/.
(cd tests && MYPYPATH="$link_root" "${mypy[@]}" --cache-dir "$cache-tests" "${loose[@]}" .)
(cd bench && MYPYPATH="$link_root:$root/tests" "${mypy[@]}" --cache-dir "$cache-bench" \
  "${loose[@]}" .)
