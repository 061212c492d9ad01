"""Model shapes for the checks (real Qwen2.5 shapes on GPU, a tiny one in dry mode) and the FLOP
count behind the MFU figure."""

from __future__ import annotations

from pathlib import Path

# Published Qwen2.5 configs (hidden, intermediate, layers, heads, kv heads, vocab, tied).
QWEN25 = {
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False),
}  # fmt: skip


def write_random_qwen2(path: Path, size: str, seed: int = 0) -> Path:
    """A random-initialised Qwen2 HF checkpoint of the given shape (no tokenizer, no network)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    if (path / "config.json").is_file():
        return path
    cfg = Qwen2Config(
        architectures=["Qwen2ForCausalLM"],
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        **QWEN25[size],
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


def train_step_flops(n_params: int, layers: int, hidden: int, seq: int, tokens: int) -> float:
    """Matmul FLOPs of one forward+backward: 6 per parameter per token (forward 2, backward 4;
    the tied embedding counts once, as the LM head) plus attention scores and values,
    12 * layers * hidden * seq per token (QK^T and AV, forward and backward, no causal saving)."""
    return float((6 * n_params + 12 * layers * hidden * seq) * tokens)


MFU_FORMULA = "MFU = (6*N + 12*L*h*s) * tokens / step_time / peak_flops"

# Dense (no sparsity) peak TFLOP/s by device-name substring: bf16, fp8.
PEAKS = [("H200", 989.0, 1979.0), ("H100", 989.0, 1979.0), ("H800", 989.0, 1979.0),
         ("B200", 2250.0, 4500.0), ("A100", 312.0, None), ("L40S", 362.0, 733.0)]  # fmt: skip


def peak_tflops(device_name: str, fp8: bool = False) -> float | None:
    for key, bf16, f8 in PEAKS:
        if key in device_name:
            return f8 if fp8 else bf16
    return None
