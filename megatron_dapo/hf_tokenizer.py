"""Load a checkpoint's tokenizer the way it was saved.

transformers 5's AutoTokenizer picks the tokenizer class from config.json's model_type when
tokenizer_config.json declares a generic fast tokenizer, so a custom tokenizer.json saved next to
a Qwen2 config comes back as Qwen2Tokenizer, whose own pre-tokenizer changes the ids (the CPU
demo's character tokenizer loses its spaces). A checkpoint that declares the generic class gets
exactly its tokenizer.json; every other one goes through AutoTokenizer unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cfg_file = Path(path) / "tokenizer_config.json"
    declared = None
    if cfg_file.is_file():
        try:
            declared = json.loads(cfg_file.read_text()).get("tokenizer_class")
        except (OSError, json.JSONDecodeError):
            declared = None
    if declared in GENERIC_CLASSES and (Path(path) / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))
