"""Demo tokenizer round trip and the tiny Qwen2 checkpoint through transformers."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_dapo.demo.model import TinyModelSpec, create_model, save_checkpoint
from megatron_dapo.demo.tokenizer import build_tokenizer


def test_tokenizer_round_trip_one_token_per_character(tmp_path):
    tok = build_tokenizer(128)
    tok.save_pretrained(str(tmp_path))
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "What is 47 + 8?\n47 + 8 = 55\nAnswer: 55"
    ids = loaded(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert loaded.decode(ids) == text
    digit_ids = [loaded.convert_tokens_to_ids(d) for d in "0123456789"]
    assert len(set(digit_ids)) == 10
    assert len(loaded) == 128
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)


def test_chat_template_builds_the_generation_prompt():
    tok = build_tokenizer(128)
    messages = [{"role": "user", "content": "Find 12 - 3."}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|bos|><|user|>Find 12 - 3.<|assistant|>"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    assert ids[:2] == [1, 4] and ids[-1] == 5 and len(ids) == 2 + len("Find 12 - 3.") + 1


def test_tiny_model_loads_with_transformers_and_generates(tmp_path):
    tok = build_tokenizer(128)
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64)
    model = create_model(spec, tok, seed=0)
    save_checkpoint(model, tok, tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "config.json").is_file()

    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert type(loaded).__name__ == "Qwen2ForCausalLM"
    assert loaded.config.num_key_value_heads == 2 and loaded.config.vocab_size == 128
    ids = torch.tensor([[1, 4, 20, 21, 5]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
        out = loaded.generate(
            input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=2
        )
    assert out.shape[0] == 1 and 5 < out.shape[1] <= 11
    assert out[0, :5].tolist() == ids[0].tolist()
