"""The planner against figures worked out here by hand, from nothing of the planner's.

Parameter counts: the config.json values of the real Qwen2.5 checkpoints (copied below from the
hub), counted module by module, must give the published totals and equal what the planner reads
from the same config.json. Memory: the 32B recipe's per-GPU peak (weights, fp32 grads, Adam
state sharded by the distributed optimizer, activations of the in-flight micro-batches, logits)
derived step by step here must equal the planner's.
"""

import json
from pathlib import Path

import pytest

from megatron_dapo.config import load_config
from megatron_dapo.plan import count_params, gpu_for, inputs_from_config, make_plan, resolve_model_shape

GIB = 1024**3
RECIPE = str(Path(__file__).resolve().parents[1] / "configs" / "dapo_qwen2.5_32b.yaml")

# config.json of Qwen/Qwen2.5-{32B,7B,1.5B} on the Hugging Face hub (the fields that size the model).
HF_CONFIGS = {
    "Qwen2.5-32B": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 5120,
        "intermediate_size": 27648,
        "num_hidden_layers": 64,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-05,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "torch_dtype": "bfloat16",
    },
    "Qwen2.5-7B": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-06,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "torch_dtype": "bfloat16",
    },
    "Qwen2.5-1.5B": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-06,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "torch_dtype": "bfloat16",
    },
}

# Published sizes: the bf16 safetensors' total_size / 2 (model.safetensors.index.json of 32B and
# 7B; the single model.safetensors of 1.5B), i.e. 32.76B, 7.62B and 1.54B parameters.
PUBLISHED = {
    "Qwen2.5-32B": 32_763_876_352,
    "Qwen2.5-7B": 7_615_616_512,
    "Qwen2.5-1.5B": 1_543_714_304,
}


def hand_count(c: dict) -> dict[str, int]:
    """Parameters of a Qwen2 decoder from its config.json, one module at a time."""
    h, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    head_dim = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim  # GQA: K and V are this wide
    q_proj = h * h + h  # Qwen2 has a bias on q, k and v (not on o)
    k_proj = v_proj = h * kv + kv
    o_proj = h * h
    mlp = 3 * h * f  # gate, up, down; no biases
    norms = 2 * h  # input_layernorm, post_attention_layernorm (RMSNorm: weight only)
    layer = q_proj + k_proj + v_proj + o_proj + mlp + norms
    embedding = v * h
    head = 0 if c["tie_word_embeddings"] else v * h
    final_norm = h
    return {
        "layer": layer,
        "attention": q_proj + k_proj + v_proj + o_proj,
        "mlp": mlp,
        "embedding": embedding,
        "head": head,
        "total": c["num_hidden_layers"] * layer + embedding + head + final_norm,
    }


def test_the_hand_count_of_32b_written_out():
    c = hand_count(HF_CONFIGS["Qwen2.5-32B"])
    # q 5120*5120+5120, k and v 5120*1024+1024 each, o 5120*5120, MLP 3*5120*27648, norms 2*5120
    assert c["layer"] == 26_219_520 + 2 * 5_243_904 + 26_214_400 + 424_673_280 + 10_240 == 487_605_248
    assert c["embedding"] == c["head"] == 152064 * 5120 == 778_567_680
    assert c["total"] == 64 * 487_605_248 + 2 * 778_567_680 + 5120


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_hand_counts_from_real_configs_match_the_published_sizes(name):
    assert hand_count(HF_CONFIGS[name])["total"] == PUBLISHED[name]


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_planner_reads_the_same_count_from_the_config_json(tmp_path, name):
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIGS[name]))
    shape = resolve_model_shape(str(tmp_path))
    assert count_params(shape).total(shape.num_layers) == hand_count(HF_CONFIGS[name])["total"]


def test_the_32b_recipes_memory_peak_by_hand():
    """configs/dapo_qwen2.5_32b.yaml on 128 x H100 80 GB: TP=8 with sequence parallelism, PP=2,
    DP=8, bf16 with the distributed optimizer, no recompute, a 24,576-token micro-batch budget."""
    cfg = load_config(RECIPE, [])
    par = cfg.parallel
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    dp = par.actor_world_size // (tp * pp * par.context_parallel_size)
    assert (tp, pp, dp, par.sequence_parallel, par.use_distributed_optimizer) == (8, 2, 8, True, True)
    assert cfg.model.dtype == "bf16" and not cfg.model.recompute
    c32 = HF_CONFIGS["Qwen2.5-32B"]
    h, f, heads = c32["hidden_size"], c32["intermediate_size"], c32["num_attention_heads"]
    kv = c32["num_key_value_heads"] * (h // heads)
    n = hand_count(c32)

    # Parameters on one GPU of each stage: 32 layers; linear weights split over TP, the two
    # RMSNorms replicated. Megatron pads the vocabulary to a multiple of 128 * TP = 1024:
    # 152064 -> 152576. Embedding on the first stage, final norm and LM head on the last.
    vocab = 152576
    assert vocab % (128 * tp) == 0 and vocab - 1024 < c32["vocab_size"] <= vocab
    per_layer = (n["attention"] + n["mlp"]) // tp + 2 * h
    first_params = 32 * per_layer + vocab * h // tp
    last_params = 32 * per_layer + h + vocab * h // tp
    assert first_params == 2_048_356_352

    # Bytes per parameter: bf16 weight 2 + fp32 main grad 4 + (fp32 master 4 + Adam m 4 + v 4) / DP.
    def state(params):
        return params * (2 + 4 + 12 / dp)

    # Activations kept for backward, per token and layer, bf16 (Korthikanti et al. 2022 for a
    # Qwen2 layer, flash attention, no dropout): the 2 norm inputs, QKV input and fc1 input
    # (4h, split by SP), Q/K/V (h + 2kv), attention output (h), fp32 LSE per head, gate+up (2f)
    # and SwiGLU output (f), the last four split by TP.
    per_token_layer = (4 * h * 2 + (h + 2 * kv) * 2 + h * 2 + heads * 4 + 2 * f * 2 + f * 2) / tp
    assert per_token_layer * tp == 231_584
    # A micro-batch is the 24,576-token budget (longer than one 2048 + 20480 sequence). 1F1B:
    # the first stage holds PP = 2 micro-batches in flight, the last one.
    tokens = cfg.actor.micro_batch_max_tokens
    assert tokens == 24576 >= cfg.data.max_prompt_length + cfg.data.max_response_length
    first_act = tokens * per_token_layer * 32 * 2
    last_act = tokens * per_token_layer * 32 * 1
    # Logits on the last stage: its vocab shard, bf16 plus an fp32 copy for the log-softmax.
    logits = tokens * vocab // tp * (2 + 4)
    overhead = 5 * GIB  # the planner's stated allowance for CUDA context, NCCL, fragmentation
    first = state(first_params) + first_act + overhead
    last = state(last_params) + last_act + logits + overhead
    assert round(first / GIB, 1) == 61.7  # 14.3 state + 42.4 activations + 5

    plan = make_plan(inputs_from_config(cfg), resolve_model_shape(cfg.model.path), gpu_for("h100", None))
    by_stage = {s.stage: s for s in plan.stages}
    assert by_stage["first"].params == first_params and by_stage["last"].params == last_params
    assert by_stage["first"].total == pytest.approx(first, rel=1e-12)
    assert by_stage["last"].total == pytest.approx(last, rel=1e-12)
    assert plan.actor_peak.total == pytest.approx(max(first, last), rel=1e-12)
    assert plan.fits

    # Colocated generation phase: the actor's state stays resident next to SGLang's static pool
    # (mem_fraction_static of the GPU) and its runtime allowance (4 GiB): 14.3 + 56 + 4 GiB.
    assert cfg.trainer.placement == "colocated"
    rollout = state(last_params) + 80 * GIB * cfg.rollout.sglang.mem_fraction_static + 4 * GIB
    assert round(rollout / GIB, 1) == 74.3
    check = next(c for c in plan.checks if c.role == "colocated")
    assert check.ok and f"= {rollout / GIB:.1f} GiB" in check.what, check.what
