"""A character-level tokenizer for the demo, built offline with the ``tokenizers`` library.

One token per character (so every digit is its own token and decoding is exact concatenation),
plus special tokens, padded with reserved tokens to a vocabulary size that tensor parallelism can
split evenly. Wrapped as a transformers ``PreTrainedTokenizerFast`` with a chat template, so the
data layer treats it like any HF tokenizer.
"""

from __future__ import annotations

import string
from pathlib import Path

PAD, BOS, EOS, UNK = "<|pad|>", "<|bos|>", "<|end|>", "<|unk|>"
USER, ASSISTANT = "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, USER, ASSISTANT)
# Printable ASCII without the rarely useful whitespace variants; "\n" separates solution lines.
CHARACTERS = tuple(string.ascii_letters + string.digits + string.punctuation + " \n")
DEFAULT_VOCAB_SIZE = 128

# Prompt: "<|bos|><|user|>QUESTION<|assistant|>"; an assistant turn ends with "<|end|>" (EOS), which
# is the generation stop token.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}<|end|>"
    "{% else %}{{ raise_exception('demo chat template supports user and assistant roles only') }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Return the demo ``PreTrainedTokenizerFast`` with exactly ``vocab_size`` ids.

    Ids 0-5 are the special tokens (pad 0, bos 1, eos 2, unk 3, user 4, assistant 5), then one id
    per character, then ``<|reserved_k|>`` tokens up to ``vocab_size``; the reserved ones are
    never produced by encoding and decode to their own names.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = len(SPECIAL_TOKENS) + len(CHARACTERS)
    if vocab_size < base:
        raise ValueError(f"vocab_size must be >= {base} (specials + characters), got {vocab_size}")
    tokens = list(SPECIAL_TOKENS) + list(CHARACTERS)
    tokens += [f"<|reserved_{k}|>" for k in range(vocab_size - base)]
    vocab = {tok: i for i, tok in enumerate(tokens)}

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character (newline included) is its own pre-token; Fuse joins them back verbatim.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=256,
        padding_side="left",
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def save_tokenizer(out_dir: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Build the tokenizer and ``save_pretrained`` it into ``out_dir``; returns the tokenizer."""
    hf = build_tokenizer(vocab_size)
    hf.save_pretrained(str(out_dir))
    return hf
