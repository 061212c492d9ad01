"""A saved generic fast tokenizer next to a Qwen2 config loads with its own ids (transformers 5's
AutoTokenizer would substitute Qwen2Tokenizer and drop the spaces of the demo's tokenizer)."""

from megatron_dapo.demo.model import TinyModelSpec, create_model, save_checkpoint
from megatron_dapo.demo.tokenizer import build_tokenizer
from megatron_dapo.hf_tokenizer import load_tokenizer


def test_generic_tokenizer_round_trips_next_to_a_qwen2_config(tmp_path):
    tok = build_tokenizer(128)
    save_checkpoint(create_model(TinyModelSpec(), tok, seed=0), tok, tmp_path)
    text = "23 - 5 = 18\nAnswer: 18"
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.decode(loaded.encode(text)) == text
