"""The planner knows Qwen3-MoE: Qwen3-30B-A3B's parameters counted here by hand from its
config.json values equal the planner's (30.5 B total and 3.3 B active, as published), experts are
split over EP in the per-GPU figures, and configs/dapo_qwen3_30b_a3b.yaml loads, validates and fits
as its comments say."""

import json
from pathlib import Path

import pytest

from megatron_dapo.config import load_config
from megatron_dapo.plan import count_params, gpu_for, inputs_from_config, make_plan, resolve_model_shape
from megatron_dapo.plan.params import params_per_gpu

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "dapo_qwen3_30b_a3b.yaml"

# config.json of Qwen/Qwen3-30B-A3B on the Hugging Face hub (the fields that size the model).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "torch_dtype": "bfloat16",
}


def hand_count(c: dict, experts_used: int) -> int:
    """Parameters of a Qwen3-MoE decoder with ``experts_used`` experts per layer counted."""
    h, v, hd, f = c["hidden_size"], c["vocab_size"], c["head_dim"], c["moe_intermediate_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    attention = h * q + 2 * h * kv + q * h + 2 * hd  # q, k, v, o; q and k norms; no biases
    router = c["num_experts"] * h  # mlp.gate, no bias
    expert = 3 * h * f  # gate, up, down
    layer = attention + router + experts_used * expert + 2 * h  # two RMSNorms
    return 2 * v * h + c["num_hidden_layers"] * layer + h  # untied embedding and head, final norm


def test_qwen3_30b_a3b_total_and_active_parameters_by_hand_equal_the_planners(tmp_path):
    total = hand_count(QWEN3_30B_A3B, QWEN3_30B_A3B["num_experts"])
    active = hand_count(QWEN3_30B_A3B, QWEN3_30B_A3B["num_experts_per_tok"])
    assert (round(total / 1e9, 1), round(active / 1e9, 1)) == (30.5, 3.4)  # published: 30.5 B, 3.3 B
    assert (total, active) == (30_532_122_624, 3_353_032_704)
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    for shape in (resolve_model_shape(str(tmp_path)), resolve_model_shape("Qwen/Qwen3-30B-A3B")):
        counts = count_params(shape)
        assert (counts.total(shape.num_layers), counts.active(shape.num_layers)) == (total, active)
        # activations are sized by the FFN width one token passes through
        assert shape.intermediate_size == 8 * 768


def test_experts_split_over_expert_parallel_ranks(tmp_path):
    shape = resolve_model_shape("Qwen/Qwen3-30B-A3B")
    experts = 48 * 128 * 3 * 2048 * 768
    (one,) = params_per_gpu(shape, tp=1, pp=1, ep=1)
    (sixteen,) = params_per_gpu(shape, tp=1, pp=1, ep=16)
    assert one.params == count_params(shape).total(48)  # 151936 is a multiple of 128: no padding
    assert (one.expert_params, sixteen.expert_params) == (experts, experts // 16)
    assert one.params - sixteen.params == experts - experts // 16
    with pytest.raises(ValueError, match="128 experts do not split over expert parallel size 3"):
        params_per_gpu(shape, tp=1, pp=1, ep=3)


def test_other_moe_layouts_are_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, "mlp_only_layers": [0]}))
    with pytest.raises(ValueError, match="mlp_only_layers"):
        resolve_model_shape(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, "num_local_experts": 8}))
    with pytest.raises(ValueError, match="num_local_experts"):
        resolve_model_shape(str(tmp_path))


def test_qwen3_30b_a3b_recipe_loads_validates_and_fits_as_its_comments_say():
    from megatron_dapo.config.loader import ConfigError

    c = load_config(RECIPE)
    base = load_config(RECIPE.parent / "dapo_qwen2.5_32b.yaml")
    assert c.model.path == "Qwen/Qwen3-30B-A3B"
    p = c.parallel
    assert (p.tensor_model_parallel_size, p.expert_model_parallel_size, p.actor_world_size) == (1, 16, 16)
    for key in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode"):
        assert getattr(c.algorithm, key) == getattr(base.algorithm, key), key
    plan = make_plan(inputs_from_config(c), resolve_model_shape(c.model.path), gpu_for("h100"))
    assert plan.fits, [x for x in plan.checks if not x.ok]
    gib = 1024**3
    (stage,) = plan.stages
    assert round(stage.params / 1e9, 2) == 3.35 and round(stage.total / gib, 1) == 58.6
    assert round(plan.rollout_phase_bytes / gib, 1) == 72.1
    assert plan.active_params == 3_353_032_704
    # the H200 variant of the comments
    h200 = load_config(
        RECIPE,
        [
            "parallel.actor_world_size=8",
            "parallel.expert_model_parallel_size=8",
            "rollout.tensor_parallel_size=2",
            "rollout.sglang.mem_fraction_static=0.45",
        ],
    )
    plan = make_plan(inputs_from_config(h200), resolve_model_shape(c.model.path), gpu_for("h200"))
    assert plan.fits and round(plan.stages[0].total / gib, 1) == 90.0
    # an expert parallel size that does not divide the data-parallel ranks is refused by name
    with pytest.raises(ConfigError, match="parallel.expert_model_parallel_size=32"):
        load_config(RECIPE, ["parallel.expert_model_parallel_size=32"])


def test_moe_all_to_all_bytes_and_time_by_hand():
    c = load_config(RECIPE)
    plan = make_plan(inputs_from_config(c), resolve_model_shape(c.model.path), gpu_for("h100"))
    # 64 prompts x n=16 of 200 + 0.25 x 8192 tokens; 48 layers over 16 GPUs; forwards: old
    # log-probs, the update, its recompute, plus the backward = 4 exchanges of dispatch + combine,
    # top-8 copies of 2048 bf16 values, 15/16 of them to other EP ranks.
    tokens = 64 * 16 * (200 + 0.25 * c.data.max_response_length)
    per_gpu = tokens * 48 / 16 * 4 * 2 * 8 * 2048 * 2 * 15 / 16
    assert plan.a2a_bytes_per_gpu == pytest.approx(per_gpu, rel=1e-12)
    assert plan.times.a2a_s == pytest.approx(per_gpu / 40e9)  # EP=16 spans two nodes of 8
    one_node = make_plan(
        inputs_from_config(
            load_config(RECIPE, ["parallel.actor_world_size=8", "parallel.expert_model_parallel_size=8"])
        ),
        resolve_model_shape(c.model.path),
        gpu_for("h200"),
    )
    assert one_node.a2a_bytes_per_gpu == pytest.approx(tokens * 48 / 8 * 4 * 65536 * 7 / 8, rel=1e-12)
    assert one_node.times.a2a_s == pytest.approx(one_node.a2a_bytes_per_gpu / 200e9)  # NVLink
    # the exchange is part of the train time; none without expert parallelism
    no_ep = make_plan(
        inputs_from_config(load_config(RECIPE, ["parallel.expert_model_parallel_size=1"])),
        resolve_model_shape(c.model.path),
        gpu_for("h100"),
    )
    assert no_ep.a2a_bytes_per_gpu == 0 and no_ep.times.a2a_s == 0
    assert plan.times.train_s == pytest.approx(no_ep.times.train_s + plan.times.a2a_s)


def test_qwen2_moe_shared_expert_counted_as_transformers_counts_it(tmp_path):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=80,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    hf_total = sum(p.numel() for p in Qwen2MoeForCausalLM(cfg).parameters())
    (tmp_path / "config.json").write_text(cfg.to_json_string())
    shape = resolve_model_shape(str(tmp_path))
    counts = count_params(shape)
    assert counts.total(2) == hf_total
    # a token passes the shared expert and its top-2 of 8 routed experts
    assert counts.active(2) == hf_total - 2 * (8 - 2) * 3 * 64 * 32
    assert shape.intermediate_size == 2 * 32 + 80
