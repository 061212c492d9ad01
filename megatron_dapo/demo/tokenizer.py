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

# The calculator demo's tool role (megatron_dapo/demo/calculator/): it lists the tools after
# <|bos|> and opens each tool answer, "<|tool|>16656", after which the generation prompt follows.
TOOL = "<|tool|>"
# A tool call is written in the compact format of demo/calculator/calls.py: "[347 * 48]" calls the
# calculator, "[name:{json arguments}]" any other tool. The prompt lists the tools by name only:
# a JSON schema is hundreds of characters, a tenth of a second of attention per token on 2 cores.
CALCULATOR_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|tool|>"
    "{% for t in tools %}{% if not loop.first %},{% endif %}{{ (t['function'] if 'function' in t else t)['name'] }}"
    "{% endfor %}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] or '' }}"
    "{% for c in message.get('tool_calls') or [] %}"
    "{% set f = c['function'] if 'function' in c else c %}{% set args = f['arguments'] %}"
    "{% if f['name'] == 'calculator' and args is mapping and args.keys()|list == ['expression'] %}"
    "[{{ args['expression'] }}]"
    "{% else %}[{{ f['name'] }}:{{ args if args is string else args|tojson }}]{% endif %}"
    "{% endfor %}<|end|>"
    "{% elif message['role'] == 'tool' %}<|tool|>{{ message['content'] }}"
    "{% else %}{{ raise_exception('the calculator demo template supports user, assistant and tool roles only') }}"
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
    return _build(vocab_size, (), CHAT_TEMPLATE)


def build_calculator_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE):
    """The calculator demo's tokenizer: ``build_tokenizer``'s, with ``<|tool|>`` (a special token)
    at the id of ``<|reserved_0|>`` and ``CALCULATOR_CHAT_TEMPLATE``. Every other id is the
    arithmetic demo's, so one checkpoint shape serves both demos."""
    return _build(vocab_size, (TOOL,), CALCULATOR_CHAT_TEMPLATE)


def _build(vocab_size: int, extra_specials: tuple[str, ...], chat_template: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = len(SPECIAL_TOKENS) + len(CHARACTERS) + len(extra_specials)
    if vocab_size < base:
        raise ValueError(f"vocab_size must be >= {base} (specials + characters), got {vocab_size}")
    tokens = list(SPECIAL_TOKENS) + list(CHARACTERS) + list(extra_specials)
    # Extra specials take the first reserved ids; the reserved names after them keep their numbers.
    tokens += [
        f"<|reserved_{k}|>" for k in range(len(extra_specials), vocab_size - base + len(extra_specials))
    ]
    vocab = {tok: i for i, tok in enumerate(tokens)}

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character (newline included) is its own pre-token; Fuse joins them back verbatim.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS) + list(extra_specials))

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=256,
        padding_side="left",
        **({"additional_special_tokens": list(extra_specials)} if extra_specials else {}),
    )
    hf.chat_template = chat_template
    return hf


def save_tokenizer(out_dir: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Build the tokenizer and ``save_pretrained`` it into ``out_dir``; returns the tokenizer."""
    hf = build_tokenizer(vocab_size)
    hf.save_pretrained(str(out_dir))
    return hf
