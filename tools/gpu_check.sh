#!/usr/bin/env bash
# GPU acceptance check for megatron-dapo: one command for a one-GPU machine, bare (PyTorch and
# transformers only, as the GPU machine lent to this project is) or the project's image (with
# Transformer Engine and SGLang). No network needed; models are random-initialised at Qwen2.5 shapes.
#
#   WHEELS=DIR bash tools/gpu_check.sh [--dry] [--json PATH]      (default PATH: ./gpu_check.json)
#
# WHEELS=DIR (made here by tools/gpu_wheels.sh, a few MB) installs megatron-core, omegaconf and the
# project, keeping the machine's torch and transformers. Every check runs in its own process, so
# an OOM, a port in use or a hung collective in one cannot poison the next, and a failing check
# does not stop the others. Each ends PASS, FAIL, NOT RUN (--dry: needs CUDA) or UNAVAILABLE
# (needs Transformer Engine / SGLang: the project's image), in order:
#   environment                      CUDA, torch, megatron-core; whether TE and SGLang are here
#   te_vs_local_logits    (TE)       TE layer spec vs the local spec, fp32 logits, Qwen2.5-0.5B shape
#   bf16_step_vs_fp32                one bf16 update (fp32 masters, distributed optimizer) vs fp32
#   load_then_step_keeps_weights     a model-only load then a step keeps the loaded weights (defect 1)
#   fp8_step_odd_lengths  (TE)       an FP8 update with odd sequence lengths (delayed; MXFP8 on Blackwell)
#   offload_roundtrip                offload/onload of params + optimizer: bytes freed, weights restored
#   mfu_bf16_1.5B                    MFU of a Qwen2.5-1.5B-shaped bf16 forward+backward, formula printed
#   sglang_routed_experts (SGLang)   the real server's routed experts equal transformers' router top-k
#   dapo_torchrun_checkpoint_resume  a 1-GPU torchrun DAPO run: periodic checkpoint under the
#                                    distributed optimizer, HF export, exit 0; resume=auto from the
#                                    checkpoint equals the uninterrupted run's next step
#   bench_actor                      tools/bench_actor.py at the 1.5B shape (tokens/s, MFU, memory)
#   stack_plumbing                   (CPU too) the run's overrides pass the config loader, colocation
#                                    on GPUs resolves to CUDA IPC, the SGLang server command
#   sglang_colocated_ipc_sync (SGLang) the real server on the same GPU, weights pushed over CUDA IPC
#   dapo_2_steps_colocated    (SGLang) 2 DAPO steps through the whole stack (Ray, SGLang, cuda_ipc)
# Context parallelism is not checked here (ring attention needs >= 2 GPUs); the actor's CP path is
# tested on CPU (tests/test_context_parallel_*.py).
# --dry runs on CPU: tiny shapes, the CUDA-only checks reported NOT RUN (the test suite does this).
# Budgets per check (tools/gpu_checks, where each figure's source is written) sum to 8 minutes
# for what a bare machine runs; the whole script is limited to 10 minutes.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
cd "$REPO"

# Off the image: WHEELS=DIR installs megatron-core, omegaconf and the
# project from a folder made by tools/gpu_wheels.sh (pip --no-index --no-deps: the machine's torch,
# transformers and the rest of what it has are kept).
if [ -n "${WHEELS:-}" ]; then
    shopt -s nullglob
    project=("$WHEELS"/megatron_dapo-*.whl)
    shopt -u nullglob
    if [ "${#project[@]}" -eq 0 ]; then
        echo "FAIL     install: no megatron_dapo wheel in WHEELS=$WHEELS; make the folder with tools/gpu_wheels.sh" >&2
        exit 2
    fi
    timeout 300 "$PYTHON" -m pip install --quiet --no-index --no-deps --find-links "$WHEELS" \
        megatron-core omegaconf
    timeout 60 "$PYTHON" -m pip install --quiet --no-index --no-deps "${project[0]}"
fi
if ! "$PYTHON" -c "import megatron.core, megatron_dapo, omegaconf, transformers" 2>/dev/null; then
    echo "FAIL     imports: megatron-core, omegaconf, megatron_dapo or transformers missing for $PYTHON; set WHEELS=DIR (tools/gpu_wheels.sh) or run inside the project's image" >&2
    exit 2
fi
exec timeout --kill-after=10 600 "$PYTHON" -m tools.gpu_checks "$@"
