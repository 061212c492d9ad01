#!/usr/bin/env bash
# Download the wheels tools/gpu_check.sh installs on an offline GPU machine.
#
#   tools/gpu_wheels.sh [WHEEL_DIR]     (default ./wheels; run on a machine with network)
#
# Resolves megatron-core, transformers and friends with pip (a dry-run install report), drops
# torch and the CUDA/NVIDIA runtime packages (the GPU machine has its own torch; gpu_check.sh
# keeps installed packages that already satisfy a requirement), downloads the rest as binary wheels for the target interpreter, and adds a wheel of this project. Target
# another Python with PYTHON_VERSION=3.10 (etc.) and PLATFORM=manylinux_2_28_x86_64 (etc.).
# Transformer Engine is not included: it must match the GPU machine's torch/CUDA build.
set -euo pipefail

WHEELS="${1:-./wheels}"
PYTHON="${PYTHON:-python3}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYVER="${PYTHON_VERSION:-$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}"
PLATFORM="${PLATFORM:-manylinux_2_28_x86_64}"
mkdir -p "$WHEELS"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# The packages gpu_check.sh imports (megatron_dapo itself is installed with --no-deps).
REQS=(megatron-core transformers safetensors tokenizers rich psutil numpy pytest)
"$PYTHON" -m pip install --dry-run --ignore-installed --quiet --report "$WORK/report.json" "${REQS[@]}"
"$PYTHON" - "$WORK/report.json" >"$WORK/pins.txt" <<'EOF'
import json
import re
import sys

skip = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*|pytorch-triton.*)$")
for item in json.load(open(sys.argv[1]))["install"]:
    meta = item["metadata"]
    name = meta["name"].lower().replace("_", "-")
    if not skip.match(name):
        print(f"{name}=={meta['version']}")
EOF
echo "pins: $(tr '\n' ' ' <"$WORK/pins.txt")"

# Prefer binary wheels for the target; fall back to building a wheel from an sdist (pure-Python
# packages only) when a project publishes no wheel.
while read -r pin; do
    if ! "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
        --python-version "$PYVER" --platform "$PLATFORM" --platform manylinux2014_x86_64 \
        -d "$WHEELS" "$pin"; then
        "$PYTHON" -m pip wheel --quiet --no-deps -w "$WHEELS" "$pin"
    fi
done <"$WORK/pins.txt"

"$PYTHON" -m pip wheel --quiet --no-deps -w "$WHEELS" "$REPO"
echo "wrote $(find "$WHEELS" -name '*.whl' | wc -l) wheels to $WHEELS"
