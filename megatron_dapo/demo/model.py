"""The demo's tiny Qwen2-architecture causal LM, created from scratch as an HF checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the demo model. Heads and KV heads are even so TP=2 splits them evenly."""

    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0


def qwen2_config(spec: TinyModelSpec, tokenizer):
    """A transformers ``Qwen2Config`` for ``spec`` whose special-token ids match ``tokenizer``."""
    from transformers import Qwen2Config

    if len(tokenizer) != spec.vocab_size:
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens but the model spec has vocab_size={spec.vocab_size}; "
            "build the tokenizer with the same vocab_size"
        )
    return Qwen2Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_theta=spec.rope_theta,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        initializer_range=0.02,
        use_sliding_window=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def create_model(spec: TinyModelSpec, tokenizer, seed: int = 0):
    """A freshly initialised ``Qwen2ForCausalLM`` (float32), seeded for reproducibility."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(qwen2_config(spec, tokenizer))
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
    )
    return model


def save_checkpoint(model, tokenizer, out_dir: str | Path) -> Path:
    """Save model (safetensors + config.json + generation_config.json) and tokenizer files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out
