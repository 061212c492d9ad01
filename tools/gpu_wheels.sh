#!/usr/bin/env bash
# Make the folder of wheels tools/gpu_check.sh installs on a bare, offline GPU machine.
#
#   tools/gpu_wheels.sh [WHEEL_DIR]     (default ./wheels; run on a machine with the registry)
#
# A bare CUDA machine with PyTorch has transformers, safetensors, tokenizers, numpy, psutil and
# rich already; it lacks megatron-core and omegaconf. Those are
# downloaded as wheels for the target interpreter, plus a wheel of this project: about 3 MB in all,
# far under what can travel to such a machine (64 MiB). Target another Python with
# PYTHON_VERSION=3.11 (default 3.12, the GPU machine's) and PLATFORM=manylinux_2_28_x86_64.
# Transformer Engine and SGLang are not included: they need the project's image.
set -euo pipefail

WHEELS="${1:-./wheels}"
PYTHON="${PYTHON:-python3}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYVER="${PYTHON_VERSION:-3.12}"
PLATFORM="${PLATFORM:-manylinux_2_28_x86_64}"
mkdir -p "$WHEELS"

# The versions this project is tested with (requirements/cpu.lock).
LOCK="$REPO/requirements/cpu.lock"
pins=()
for name in megatron-core omegaconf; do
    pin=$(grep -i "^${name}==" "$LOCK" || true)
    [ -n "$pin" ] || { echo "no pin for $name in $LOCK" >&2; exit 2; }
    pins+=("$pin")
done
echo "pins: ${pins[*]}"
for pin in "${pins[@]}"; do
    if ! "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
        --python-version "$PYVER" --platform "$PLATFORM" --platform manylinux2014_x86_64 \
        -d "$WHEELS" "$pin"; then
        "$PYTHON" -m pip wheel --quiet --no-deps -w "$WHEELS" "$pin"
    fi
done

"$PYTHON" -m pip wheel --quiet --no-deps -w "$WHEELS" "$REPO"
echo "wrote $(find "$WHEELS" -name '*.whl' | wc -l) wheels ($(du -sh "$WHEELS" | cut -f1)) to $WHEELS"
