"""Shared test helpers: tiny random HF checkpoints (Qwen2 with GQA + qkv bias, Qwen3 with q/k norms
and head_dim != hidden/heads, Llama).

``make_tiny_hf_checkpoint(path, ...)`` writes an HF model directory (config.json, safetensors,
optionally sharded with model.safetensors.index.json, and a tiny word-level tokenizer) that
``transformers.AutoModelForCausalLM.from_pretrained(path)`` loads. Every weight, including norms
and biases, is random (seeded), so a swapped or mis-sliced tensor changes the logits visibly.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FAMILIES = ("qwen2", "qwen3", "qwen3_moe", "llama")
# Qwen3 decouples head_dim from hidden/heads (128 everywhere); the tiny one does too (64/4 = 16).
QWEN3_HEAD_DIM = 24


def tiny_hf_config(
    family: str = "qwen2",
    tie_word_embeddings: bool = False,
    num_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 256,
    intermediate: int | None = None,
    head_dim: int | None = None,
):
    """The HF config object of a tiny model of ``family`` (one of ``FAMILIES``); ``head_dim`` is
    Qwen3's (default ``QWEN3_HEAD_DIM``), the other families derive it from hidden/heads."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        torch_dtype="float32",
    )
    if family == "qwen2":
        return Qwen2Config(rope_theta=10000.0, architectures=["Qwen2ForCausalLM"], **common)
    if family == "qwen3":
        return Qwen3Config(
            rope_theta=1000000.0,
            head_dim=head_dim or QWEN3_HEAD_DIM,
            architectures=["Qwen3ForCausalLM"],
            **common,
        )
    if family == "qwen3_moe":
        # 8 experts, top-2, every layer MoE (as the released Qwen3-MoE models), renormalised top-k.
        return Qwen3MoeConfig(
            rope_theta=1000000.0,
            head_dim=head_dim or QWEN3_HEAD_DIM,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            architectures=["Qwen3MoeForCausalLM"],
            **common,
        )
    if family == "llama":
        return LlamaConfig(rope_theta=500000.0, architectures=["LlamaForCausalLM"], **common)
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def _write_tokenizer(path: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    words = [chr(c) for c in range(33, 127)] + [f"w{i}" for i in range(vocab)]
    table = {tok: i for i, tok in enumerate((specials + words)[:vocab])}
    tok = Tokenizer(models.WordLevel(vocab=table, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(str(path))


def make_tiny_hf_checkpoint(
    path,
    family: str = "qwen2",
    tie_word_embeddings: bool = False,
    num_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 256,
    seed: int = 0,
    max_shard_size: str | None = None,
    with_tokenizer: bool = True,
    head_dim: int | None = None,
) -> Path:
    """Write a random tiny HF checkpoint to ``path`` (created) and return it.

    ``max_shard_size`` (e.g. "20KB") splits the weights into several safetensors files with an
    index json, as large HF checkpoints are. Deterministic for a given ``seed``.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_hf_config(
        family, tie_word_embeddings, num_layers, hidden, heads, kv_heads, vocab, head_dim=head_dim
    )
    model = random_hf_model(config, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), safe_serialization=True, **kwargs)
    if with_tokenizer:
        _write_tokenizer(path, vocab)
    return path


def hf_state_dict(path) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors checkpoint directory (single file or sharded)."""
    from safetensors.torch import load_file

    path = Path(path)
    index = path / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(path / f)))
    return out


def find_tool(name: str) -> str | None:
    """A command on PATH or installed next to this interpreter (the venv's bin/, where the dev
    extras put hadolint and shellcheck even when the venv is not activated)."""
    import os
    import shutil
    import sys

    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    return shutil.which(name, path=path)


def hf_state(actor) -> dict:
    """The actor's weights under HF names, gathered over TP/PP/EP as the weight sync sends them."""
    from megatron_dapo.weights.gather import iter_hf_buckets

    state = {}
    for bucket in iter_hf_buckets(actor.model):
        if bucket:
            state.update({k: v.clone() for k, v in bucket.items()})
    return state


def as_bytes(obj) -> bytes:
    """Results leave a spawned rank as plain bytes: tensors sent through a torch multiprocessing
    queue travel as shared-memory file descriptors, which vanish when the rank exits first."""
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(data: bytes):
    import io

    return torch.load(io.BytesIO(data), weights_only=False)


def hf_forward_reference(checkpoints: dict, ids_for_vocab) -> dict:
    """Per named HF checkpoint: HF transformers' fp32 logits on ``ids_for_vocab(vocab_size)`` and
    the checkpoint's state dict, the independent reference the conversion tests compare against."""
    from transformers import AutoModelForCausalLM

    ref = {}
    for name, path in checkpoints.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(ids_for_vocab(model.config.vocab_size)).logits
        ref[name] = dict(logits=logits, state=hf_state_dict(path))
    return ref


def random_hf_model(config, seed: int):
    """An fp32 HF causal LM of ``config`` with every weight random and seeded: norms around 1, the
    rest (biases, routers, gates included) around 0, so a swapped or mis-sliced tensor shows."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale, base = (0.2, 1.0) if name.endswith("norm.weight") else (0.15, 0.0)
            p.copy_(base + scale * torch.randn(p.shape, generator=gen))
    return model


def loss_settings(**over):
    """The actor's ``LossSettings`` of the hand-computed micro-batch loss tests: DAPO's clip,
    token-mean over 10 global tokens and 3 sequences, no regulariser; ``over`` replaces fields."""
    from megatron_dapo.actor.train_step import LossSettings

    base = dict(
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=None,
        loss_agg_mode="token-mean",
        policy_loss="vanilla",
        tau_pos=1.0,
        tau_neg=1.05,
        entropy_coeff=0.0,
        tis_cap=None,
        temperature=1.0,
        vocab_size=8,
        num_tokens=10.0,
        num_seqs=3.0,
        norm_len=5.0,
    )
    return LossSettings(**{**base, **over})


# The hand-computed micro-batch of the loss tests: 2 rows x 5 positions, 3 loss tokens each.
HAND_MASK = ((0, 1, 1, 1, 0), (0, 0, 1, 1, 1))


def hand_micro(old_logprobs, ref_logprobs=None):
    """A padded ``MicroBatch`` of the two hand rows (advantages 1.5 and -0.5) carrying the given
    [2, 5] pi_old (and reference) log-probs."""
    from megatron_dapo.actor.micro_batches import MicroBatch

    b, t = len(HAND_MASK), len(HAND_MASK[0])
    mask = torch.tensor(HAND_MASK, dtype=torch.bool)
    return MicroBatch(
        sample_index=torch.arange(b),
        tokens=torch.zeros(b, t, dtype=torch.long),
        position_ids=torch.arange(t).repeat(b, 1),
        labels=torch.zeros(b, t, dtype=torch.long),
        loss_mask=mask,
        score_mask=mask,
        advantages=torch.tensor([1.5, -0.5], dtype=torch.float64),
        old_logprobs=old_logprobs,
        rollout_logprobs=None,
        ref_logprobs=ref_logprobs,
    )


def function_tool_spec(fn: str, path: Path, **params: str):
    """A ``function`` tool (``path.py:fn``) with an OpenAI schema of string/number/... ``params``,
    all required, as a tool YAML would declare it."""
    from megatron_dapo.agent.tools.spec import ToolSpec, check_schema

    schema = {
        "type": "function",
        "function": {
            "name": fn,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": t} for k, t in params.items()},
                "required": list(params),
            },
        },
    }
    return ToolSpec(fn, check_schema(schema, "test"), "function", f"{path}:{fn}")
