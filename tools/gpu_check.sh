#!/usr/bin/env bash
# GPU check for megatron-dapo on a one-GPU machine that has torch (with CUDA) but no network.
#
#   tools/gpu_check.sh [WHEEL_DIR]      (default ./wheels, made by tools/gpu_wheels.sh)
#
# 1. installs this project's dependencies from WHEEL_DIR with pip --no-index (torch untouched);
# 2. Megatron vs HF transformers logits on CUDA with the NCCL backend (local layer spec, and the
#    Transformer Engine spec when transformer_engine imports);
# 3. MFU of forward+backward of a ~1B-parameter Qwen2-shaped model in bf16: TFLOP/s and the
#    fraction of the GPU's dense bf16 peak.
# Each step has its own time limit; the whole check finishes within 8 minutes.
set -euo pipefail

WHEELS="${1:-./wheels}"
PYTHON="${PYTHON:-python3}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="$(mktemp -d -t megatron_dapo_gpu_check.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
cd "$REPO"

step() { printf '\n=== %s ===\n' "$*"; }

step "environment"
"$PYTHON" - <<'EOF'
import torch
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}, "
      f"capability {torch.cuda.get_device_capability(0)}")
EOF

step "install from $WHEELS (no network)"
if [ ! -d "$WHEELS" ]; then
    echo "wheel folder $WHEELS not found; create it with tools/gpu_wheels.sh on a machine with network" >&2
    exit 2
fi
shopt -s nullglob
project=("$WHEELS"/megatron_dapo-*.whl)
shopt -u nullglob
if [ "${#project[@]}" -eq 0 ]; then
    echo "no megatron_dapo wheel in $WHEELS; run tools/gpu_wheels.sh" >&2
    exit 2
fi
# pip resolves from the folder only and keeps what is installed and compatible (torch and its
# own dependencies stay as they are). The project wheel goes in without its dependencies: the
# trainer-only ones (ray, wandb, ...) are not needed here.
timeout 300 "$PYTHON" -m pip install --quiet --no-index --find-links "$WHEELS" \
    megatron-core transformers safetensors tokenizers rich psutil numpy pytest
timeout 60 "$PYTHON" -m pip install --quiet --no-index --no-deps "${project[0]}"
"$PYTHON" -c "import megatron.core, transformers, megatron_dapo; print('megatron-core', megatron.core.__version__, '| transformers', transformers.__version__)"
HAVE_TE=0
if "$PYTHON" -c "import transformer_engine.pytorch" 2>/dev/null; then
    HAVE_TE=1
    echo "Transformer Engine: importable"
else
    echo "Transformer Engine: not importable (TE checks skipped)"
fi

step "logits: Megatron (CUDA, NCCL) vs HF transformers, fp32"
export PYTHONPATH="$REPO/tests${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -c "
from helpers import make_tiny_hf_checkpoint
for fam, tied in (('qwen2', False), ('qwen2', True), ('llama', False)):
    make_tiny_hf_checkpoint('$WORK/' + fam + str(int(tied)), family=fam, tie_word_embeddings=tied, num_layers=4)
"
specs=(local)
if [ "$HAVE_TE" -eq 1 ]; then specs+=(te); fi
for spec in "${specs[@]}"; do
    for model in qwen20 qwen21 llama0; do
        # TF32 is off for fp32 matmuls by default in torch, so fp32 logits agree to ~1e-5.
        timeout 120 "$PYTHON" -m megatron_dapo.cli verify-model --hf-dir "$WORK/$model" \
            --tp 1 --pp 1 --spec "$spec" --atol 1e-4
    done
done

step "MFU: forward+backward, ~1B Qwen2-shaped model, bf16"
timeout 240 "$PYTHON" - <<'EOF'
import time

import torch
from transformers import Qwen2Config

from megatron_dapo.actor.model import build_gpt_model
from megatron_dapo.actor.parallel import destroy_parallel, init_parallel

# Dense bf16 peak TFLOP/s (no sparsity), by device-name substring.
PEAKS = [("H200", 989.0), ("H100", 989.0), ("H800", 989.0), ("A100", 312.0), ("A800", 312.0),
         ("L40S", 362.0), ("L40", 181.0), ("A10G", 70.0), ("A10", 125.0), ("4090", 165.0)]
name = torch.cuda.get_device_name(0)
peak = next((p for key, p in PEAKS if key in name), None)

cfg = Qwen2Config(architectures=["Qwen2ForCausalLM"], hidden_size=2048, intermediate_size=5632,
                  num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                  vocab_size=151936, max_position_embeddings=4096, rms_norm_eps=1e-6,
                  rope_theta=1e6, tie_word_embeddings=True)
init_parallel()
(model,) = build_gpt_model(cfg, params_dtype=torch.bfloat16)
n_params = sum(p.numel() for p in model.parameters())
mbs, seq = 4, 2048
tokens = mbs * seq
ids = torch.randint(0, cfg.vocab_size, (mbs, seq), device="cuda")
pos = torch.arange(seq, device="cuda").unsqueeze(0).expand(mbs, seq)
labels = torch.roll(ids, -1, dims=1)

def step():
    loss = model(ids, pos, None, labels=labels).float().mean()
    loss.backward()

for _ in range(3):
    step()
torch.cuda.synchronize()
iters = 10
t0 = time.perf_counter()
for _ in range(iters):
    step()
torch.cuda.synchronize()
dt = (time.perf_counter() - t0) / iters

# Matmul FLOPs of fwd+bwd: 6 per parameter per token (the tied embedding counts once, as the
# LM head matmul; its lookup is free) plus causal-agnostic attention scores/values 12*L*h*s.
attn = 12 * cfg.num_hidden_layers * cfg.hidden_size * seq
flops = (6 * n_params + attn) * tokens
tflops = flops / dt / 1e12
print(f"model: {n_params / 1e9:.3f} B params, mbs={mbs}, seq={seq}, {dt * 1e3:.1f} ms / fwd+bwd, "
      f"{tokens / dt:,.0f} tokens/s")
print(f"achieved: {tflops:.1f} TFLOP/s (bf16)")
if peak:
    print(f"MFU: {100 * tflops / peak:.1f}% of {peak:.0f} TFLOP/s ({name} dense bf16 peak)")
else:
    print(f"MFU: unknown peak for {name!r}; add it to PEAKS")
print(f"peak memory: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
destroy_parallel()
EOF

step "done"
