#!/usr/bin/env bash
# GPU acceptance check for megatron-dapo: the one command to run on a fresh 1-GPU machine built from
# the project's image (no network needed; models are random-initialised at Qwen2.5 shapes).
#
#   bash tools/gpu_check.sh [--dry] [--json PATH]      (default PATH: ./gpu_check.json)
#
# Checks, in order (each prints PASS/FAIL and a figure; the first FAIL stops the run, naming it):
#   environment                  CUDA, Transformer Engine and SGLang import (names what is missing)
#   te_vs_local_logits           TE layer spec vs the local spec, fp32 logits, Qwen2.5-0.5B shape
#   bf16_step_vs_fp32            one bf16 update (fp32 masters, distributed optimizer) vs fp32
#   load_then_step_keeps_weights a model-only load then a step keeps the loaded weights (defect 1)
#   fp8_step_odd_lengths         an FP8 update with odd sequence lengths (delayed; MXFP8 on Blackwell)
#   offload_roundtrip            offload/onload of params + optimizer: bytes freed, weights restored
#   mfu_bf16_1.5B                MFU of a Qwen2.5-1.5B-shaped bf16 forward+backward, formula printed
#   sglang_routed_experts        the real SGLang server's routed experts of a tiny Qwen3-MoE equal
#                                transformers' router top-k (routing replay; CPU SGLang cannot)
#   stack_plumbing               (CPU too) the run's overrides pass the config loader, colocation on
#                                GPUs resolves to CUDA IPC, the SGLang server command
#   sglang_colocated_ipc_sync    the real SGLang server on the same GPU, the actor's weights after one
#                                step pushed over CUDA IPC: log-prob mismatch before -> after the sync
#   dapo_2_steps_colocated       2 DAPO steps through the whole stack (demo command, --engine sglang,
#                                colocated, cuda_ipc): exit 0, per-step rollout/actor mismatch
# Context parallelism is not checked here (ring attention needs >= 2 GPUs); the actor's CP path is
# tested on CPU (tests/test_context_parallel_*.py: CP=2 alone, with TP=2, with PP=2, through a
# checkpoint resume, every loss mode; an exact stand-in for TE's CP attention).
# --dry runs on CPU: tiny shapes, the CUDA-only checks reported NOT RUN (the test suite does this).
# Each check has a time budget (tools/gpu_checks: @check(budget_s=...), 540 s in all): past it the
# check FAILs naming its budget and the run stops, so one hang cannot eat the others' time; the
# whole run is limited to 10 minutes (then killed 10 s after a TERM).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
cd "$REPO"

# Off the image: WHEELS=DIR installs the project and its Python dependencies from a folder made by
# tools/gpu_wheels.sh (pip --no-index; the machine's torch is kept).
if [ -n "${WHEELS:-}" ]; then
    shopt -s nullglob
    project=("$WHEELS"/megatron_dapo-*.whl)
    shopt -u nullglob
    if [ "${#project[@]}" -eq 0 ]; then
        echo "FAIL     install: no megatron_dapo wheel in WHEELS=$WHEELS; make the folder with tools/gpu_wheels.sh" >&2
        exit 2
    fi
    timeout 300 "$PYTHON" -m pip install --quiet --no-index --find-links "$WHEELS" \
        megatron-core transformers safetensors tokenizers rich psutil numpy pytest
    timeout 60 "$PYTHON" -m pip install --quiet --no-index --no-deps "${project[0]}"
fi
if ! "$PYTHON" -c "import megatron.core, megatron_dapo, transformers" 2>/dev/null; then
    echo "FAIL     imports: megatron-core, megatron_dapo or transformers missing for $PYTHON; run inside the project's image (or set PYTHON)" >&2
    exit 2
fi
exec timeout --kill-after=10 600 "$PYTHON" -m tools.gpu_checks "$@"
