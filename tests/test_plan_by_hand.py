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

from megatron_dapo.cli import main
from megatron_dapo.config import load_config
from megatron_dapo.plan import (
    Assumptions,
    count_params,
    gpu_for,
    inputs_from_config,
    make_plan,
    resolve_model_shape,
)

GIB = 1024**3
RECIPE = str(Path(__file__).resolve().parents[1] / "configs" / "dapo_qwen2.5_32b.yaml")
RETOOL = str(Path(__file__).resolve().parents[1] / "configs" / "retool_qwen2.5_32b.yaml")

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


def _retool_plan(*overrides, a=None):
    cfg = load_config(RETOOL, list(overrides))
    return make_plan(inputs_from_config(cfg), resolve_model_shape(cfg.model.path), gpu_for("h100", None), a)


def test_multi_turn_decodes_the_sampled_tokens_and_trains_on_all_by_hand():
    """configs/retool_qwen2.5_32b.yaml on 128 x H100, and the same config single-turn: the engines
    decode only the model's share (1 - f) of each response, the environment's share f is prefilled;
    the actor trains on every token either way. The tools' time overlaps the decoding."""
    f = 0.15  # the stated multi-turn default
    multi, single = _retool_plan(), _retool_plan("rollout.multi_turn.enable=false")
    # Dynamic sampling: 512 / (1536 prompts x keep rate 0.5) -> one round of 1536 prompts x 16;
    # mean response 0.25 x 16384 = 4096 tokens, mean prompt 200.
    responses = 1536 * 16
    response_tokens = responses * 4096
    # Decode rate: 40k tok/s per H100 / 32.76 B parameters, over the 128 GPUs the engines share.
    rate = 40_000 / (32_763_876_352 / 1e9) * 128
    assert single.times.decode_s == pytest.approx(response_tokens / rate, rel=1e-12)
    assert multi.times.decode_s == pytest.approx((1 - f) * response_tokens / rate, rel=1e-12)
    assert multi.times.decode_s == pytest.approx((1 - f) * single.times.decode_s, rel=1e-12)
    assert multi.tokens.env_tokens == pytest.approx(f * response_tokens) and not single.tokens.env_tokens
    # trained: 512 x 16 sequences of 200 + 4096 tokens, environment tokens included
    assert multi.tokens.train_tokens == single.tokens.train_tokens == 512 * 16 * (200 + 4096)
    assert multi.times.train_flops == single.times.train_flops
    assert multi.times.train_s == single.times.train_s
    # tools: 4 calls per episode x 0.5 s, over the recipe's 96 tool workers: 8.5 min, shorter
    # than the decoding (9.1 min), so the rollout takes the decoding's time
    tool_s = responses * 4 * 0.5 / 96
    assert multi.times.tool_s == pytest.approx(tool_s) and tool_s < multi.times.decode_s
    assert multi.times.rollout_s == multi.times.decode_s
    # a third of the workers: the tools take longer than the decoding and set the rollout's time
    few = _retool_plan("rollout.multi_turn.tool_workers=32")
    assert few.times.rollout_s == pytest.approx(responses * 4 * 0.5 / 32)
    assert few.times.rollout_s > few.times.decode_s
    # the stated assumptions move it: f = 0.3, 2 calls of 1 s each
    a = Assumptions(env_token_frac=0.3, tool_calls_per_episode=2, tool_s_per_call=1.0)
    other = _retool_plan(a=a)
    assert other.times.decode_s == pytest.approx(0.7 * response_tokens / rate, rel=1e-12)
    assert other.times.tool_s == pytest.approx(responses * 2 * 1.0 / 96)
    # single-turn configs have no environment: asking for one is an error naming the key to set
    with pytest.raises(ValueError, match="rollout.multi_turn.enable=true"):
        _retool_plan("rollout.multi_turn.enable=false", a=Assumptions(env_token_frac=0.2))


def test_the_multi_turn_assumptions_are_printed_and_have_flags(capsys):
    assert main(["plan", RETOOL]) == 0
    out = capsys.readouterr().out
    # 24,576 x 4096 x 0.85 = 85.6 M decoded, x 0.15 = 15.1 M prefilled
    assert "85.6 M decode tokens + 15.1 M environment tokens (prefilled)" in out
    assert "98,304 calls x 0.5 s / 96 tool workers = 8.5 min" in out
    for row in ("environment tokens", "0.15 of each response", "4 per episode", "0.5 s per call"):
        assert row in out, row
    args = ["--env-token-frac", "0.3", "--tool-calls-per-episode", "2", "--tool-s-per-call", "1"]
    assert main(["plan", RETOOL, *args]) == 0
    out = capsys.readouterr().out
    assert "70.5 M decode tokens + 30.2 M environment tokens" in out and "0.3 of each response" in out
    assert "49,152 calls x 1 s / 96 tool workers" in out
    assert main(["plan", RETOOL, "--env-token-frac", "1"]) == 2
    assert "--env-token-frac=1.0 must be in [0, 1)" in capsys.readouterr().err
    # the single-turn recipe prints none of it, and refuses the flags
    assert main(["plan", RECIPE]) == 0
    assert "environment" not in capsys.readouterr().out
    assert main(["plan", RECIPE, "--env-token-frac", "0.2"]) == 2
    assert "rollout.multi_turn.enable=true" in capsys.readouterr().err
