"""Planner parameter counts against the published Qwen2.5 sizes and HF transformers' own modules."""

import json

import pytest

from megatron_dapo.plan import QWEN2_5, count_params, padded_vocab, params_per_gpu, resolve_model_shape
from megatron_dapo.plan.models import ModelShape, shape_from_hf_config

# Total parameters from the Qwen2.5 model cards / safetensors index (tied embeddings counted once).
PUBLISHED_EXACT = {
    "Qwen2.5-0.5B": 494_032_768,
    "Qwen2.5-1.5B": 1_543_714_304,
    "Qwen2.5-7B": 7_615_616_512,
    "Qwen2.5-32B": 32_763_876_352,
}
# Model cards give these two rounded.
PUBLISHED_ROUNDED = {"Qwen2.5-3B": 3.09e9, "Qwen2.5-14B": 14.7e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED_EXACT))
def test_qwen2_5_counts_match_published_sizes(name):
    m = QWEN2_5[name]
    assert count_params(m).total(m.num_layers) == PUBLISHED_EXACT[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED_ROUNDED))
def test_qwen2_5_counts_match_rounded_sizes(name):
    m = QWEN2_5[name]
    assert count_params(m).total(m.num_layers) == pytest.approx(PUBLISHED_ROUNDED[name], rel=0.005)


def _hf_numel(config) -> int:
    """Parameters of the HF module built on the meta device (no memory), tied weights once."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(QWEN2_5))
def test_table_shapes_build_the_same_size_in_transformers(name):
    from transformers import Qwen2Config

    m = QWEN2_5[name]
    config = Qwen2Config(
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        vocab_size=m.vocab_size,
        tie_word_embeddings=m.tie_word_embeddings,
    )
    assert count_params(m).total(m.num_layers) == _hf_numel(config)


@pytest.mark.parametrize(("family", "tied"), [("qwen2", False), ("qwen2", True), ("llama", False)])
def test_config_json_counts_match_the_checkpoint(tiny_hf_checkpoint, family, tied):
    from safetensors import safe_open

    path = tiny_hf_checkpoint(family=family, tie_word_embeddings=tied, num_layers=3, kv_heads=2)
    shape = resolve_model_shape(str(path))
    assert shape.qkv_bias == (family == "qwen2") and shape.tie_word_embeddings == tied
    stored = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open is not iterable)
                if not (tied and k == "lm_head.weight"):  # a tied head, if saved, is the embedding
                    stored += _prod(st.get_slice(k).get_shape())
    assert count_params(shape).total(shape.num_layers) == stored


def _prod(dims) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


def test_hub_names_resolve_offline_and_unknown_names_say_what_to_do(tmp_path):
    assert resolve_model_shape("Qwen/Qwen2.5-32B-Instruct") is QWEN2_5["Qwen2.5-32B"]
    assert resolve_model_shape("/ckpt/qwen2.5-1.5b") is QWEN2_5["Qwen2.5-1.5B"]
    with pytest.raises(ValueError, match="Qwen/Qwen2.5-0.5B"):
        resolve_model_shape(str(tmp_path / "nothing-here"))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="intermediate_size"):
        resolve_model_shape(str(tmp_path))


def test_shape_from_llama_config_has_no_qkv_bias_unless_it_says_so():
    base = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 256,
        "model_type": "llama",
    }
    assert not shape_from_hf_config(base).qkv_bias
    assert shape_from_hf_config({**base, "attention_bias": True}).qkv_bias
    assert shape_from_hf_config(base).num_kv_heads == 4


def test_megatron_vocab_padding():
    assert padded_vocab(152064, 128, 1) == 152064
    assert padded_vocab(152064, 128, 8) == 152576  # 149 x 1024
    assert padded_vocab(151936, 128, 4) == 152064  # 297 x 512


TINY = ModelShape(
    "tiny",
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    vocab_size=250,
    tie_word_embeddings=False,
    head_dim=16,
)


def test_params_per_gpu_by_hand():
    # Per layer: q 64*64 + k,v 2*64*32 + o 64*64 + biases 64+32+32 = 12416; MLP 3*64*128 = 24576;
    # TP=2 halves both: 18496, plus two replicated norms of 64 -> 18624 per layer, 2 layers a stage.
    # Vocab 250 pads to 256 (128 x TP=2); embedding and head 256*64/2 = 8192 each.
    first, last = params_per_gpu(TINY, tp=2, pp=2)
    assert (first.stage, first.params, first.has_head) == ("first", 2 * 18624 + 8192, False)
    assert (last.stage, last.params, last.has_head) == ("last", 2 * 18624 + 64 + 8192, True)
    (only,) = params_per_gpu(TINY, tp=1, pp=1)
    # At TP=1 250 still pads to 256 (a multiple of 128): 4 full layers + embedding + head + final norm.
    assert only.params == 4 * (12416 + 24576 + 128) + 2 * 256 * 64 + 64


def test_tied_embedding_lives_on_both_end_stages():
    tied = ModelShape("t", 64, 128, 4, 4, 2, 256, True, 16)
    first, last = params_per_gpu(tied, tp=1, pp=2)
    assert first.params - 2 * 37120 == 256 * 64
    assert last.params - 2 * 37120 == 256 * 64 + 64
    (only,) = params_per_gpu(tied, tp=1, pp=1)
    assert only.params == 4 * 37120 + 256 * 64 + 64
