"""Tiny random reward-model checkpoints for the served-reward tests.

``make_tiny_classifier(path, family="qwen2", ...)`` writes a ``*ForSequenceClassification``
checkpoint as transformers saves it (no ``score.bias``: its head has none), with the tests'
tiny word-level tokenizer and a chat template. ``add_chat_template(path)`` gives any tiny
checkpoint's tokenizer that template (a judge is a chat model).
"""

from __future__ import annotations

from pathlib import Path

import torch
from helpers import _write_tokenizer, tiny_hf_config

# Roles and contents between the tokenizer's own special tokens, the generation prompt last: the
# shape of real chat templates, in characters the tiny tokenizer has.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def add_chat_template(path) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(path))
    return Path(path)


def make_tiny_classifier(
    path,
    family: str = "qwen2",
    num_labels: int = 1,
    seed: int = 0,
    max_shard_size: str | None = None,
    dtype: torch.dtype = torch.float32,
    std: float = 0.2,
) -> Path:
    """A random ``<Family>ForSequenceClassification`` at ``path``: every weight drawn with ``std``
    (large enough that the score varies visibly between texts)."""
    from transformers import AutoModelForSequenceClassification

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_hf_config(family)
    config.architectures = [config.architectures[0].replace("ForCausalLM", "ForSequenceClassification")]
    config.num_labels = num_labels
    config.pad_token_id = 0  # the tiny tokenizer's <pad>, as a real reward model's config names one
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std)
    model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), safe_serialization=True, **kwargs)
    _write_tokenizer(path, config.vocab_size)
    return add_chat_template(path)


def served_settings(kind: str, combine: str | None = None, **knobs):
    """``ServedRewardSettings`` of a ``reward.model`` section with these knobs, the schema's
    defaults for the rest."""
    from megatron_dapo.config.schema import RewardModelConfig
    from megatron_dapo.rewards.served import ServedRewardSettings

    return ServedRewardSettings(RewardModelConfig(kind=kind, **knobs), combine)
