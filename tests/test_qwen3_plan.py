"""The planner knows Qwen3 dense: Qwen3-8B's parameters counted here by hand from its config.json
values equal the planner's (read from the same config.json and from its built-in table), and the
one-node recipe configs/dapo_qwen3_8b.yaml loads, validates and fits as its comments say."""

import json
from pathlib import Path

from megatron_dapo.config import load_config
from megatron_dapo.plan import count_params, gpu_for, inputs_from_config, make_plan, resolve_model_shape

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "dapo_qwen3_8b.yaml"

# config.json of Qwen/Qwen3-8B on the Hugging Face hub (the fields that size the model).
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "max_position_embeddings": 40960,
    "torch_dtype": "bfloat16",
}


def hand_count(c: dict) -> int:
    """Parameters of a Qwen3 dense decoder, one module at a time."""
    h, f, v, hd = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q = c["num_attention_heads"] * hd  # 4096: equals h for 8B only by coincidence of 32 x 128
    kv = c["num_key_value_heads"] * hd
    q_proj, k_proj, v_proj, o_proj = h * q, h * kv, h * kv, q * h  # no biases
    q_norm = k_norm = hd  # one RMSNorm weight over head_dim, shared by all heads
    mlp = 3 * h * f
    norms = 2 * h
    layer = q_proj + k_proj + v_proj + o_proj + q_norm + k_norm + mlp + norms
    embedding = lm_head = v * h  # untied
    return embedding + c["num_hidden_layers"] * layer + h + lm_head


def test_qwen3_8b_parameter_count_by_hand_equals_the_planners(tmp_path):
    by_hand = hand_count(QWEN3_8B)
    assert by_hand == 8_190_735_360
    assert round(by_hand / 1e9, 2) == 8.19  # the published size
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    from_file = resolve_model_shape(str(tmp_path))
    assert (from_file.head_dim, from_file.qkv_bias, from_file.qk_norm) == (128, False, True)
    assert count_params(from_file).total(from_file.num_layers) == by_hand
    table = resolve_model_shape("Qwen/Qwen3-8B")
    assert table == from_file.__class__(**{**from_file.__dict__, "name": table.name})
    assert count_params(table).total(table.num_layers) == by_hand


def test_qwen3_head_dim_is_read_not_derived(tmp_path):
    # A config whose head_dim differs from hidden/heads (Qwen3-0.6B style: 1024 / 16 = 64, head_dim 128).
    cfg = {**QWEN3_8B, "hidden_size": 1024, "num_attention_heads": 16, "intermediate_size": 3072}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = resolve_model_shape(str(tmp_path))
    assert shape.head_dim == 128 and shape.q_dim == 2048
    assert count_params(shape).total(shape.num_layers) == hand_count(cfg)


def test_qwen3_8b_recipe_loads_validates_and_fits_one_node():
    c = load_config(RECIPE)
    base = load_config(RECIPE.parent / "dapo_qwen2.5_32b.yaml")
    assert c.model.path == "Qwen/Qwen3-8B"
    p = c.parallel
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.actor_world_size) == (4, 1, 8)
    assert c.rollout.num_engines * c.rollout.tensor_parallel_size == 8
    # The DAPO recipe's algorithm and optimiser, unchanged from the paper's 32B run.
    a, b = c.algorithm, base.algorithm
    for key in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode", "entropy_coeff"):
        assert getattr(a, key) == getattr(b, key), key
    assert (a.filter_groups.enable, a.filter_groups.metric) == (True, "acc")
    assert (a.overlong_buffer.enable, a.overlong_buffer.penalty_factor) == (True, 1.0)
    for key in ("lr", "lr_scheduler", "lr_warmup_steps", "weight_decay", "clip_grad"):
        assert getattr(c.optim, key) == getattr(base.optim, key), key
    assert (c.rollout.n, c.rollout.temperature, c.rollout.top_p) == (16, 1.0, 1.0)
    assert c.algorithm.overlong_buffer.len < c.data.max_response_length
    plan = make_plan(inputs_from_config(c), resolve_model_shape(c.model.path), gpu_for("h100"))
    assert plan.fits, [x for x in plan.checks if not x.ok]
