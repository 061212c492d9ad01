"""Planner memory arithmetic against hand-computed values and the Korthikanti et al. 2022 formula."""

import pytest

from megatron_dapo.plan import Assumptions, PlanInputs, gpu_for, make_plan
from megatron_dapo.plan.memory import (
    GIB,
    activation_bytes,
    activation_bytes_per_token_layer,
    engine_memory,
    in_flight_microbatches,
    kv_bytes_per_token,
    static_state_bytes,
)
from megatron_dapo.plan.models import QWEN2_5, ModelShape


def test_mixed_precision_bytes_per_param_follow_megatron():
    # Megatron's distributed-optimizer table: bf16 param + fp32 grad = 6 bytes, + 12/d optimizer.
    s = static_state_bytes(1_000_000, "bf16", dp_cp=8, distributed_optimizer=True)
    assert (s.weights, s.grads, s.optimizer) == (2e6, 4e6, 1.5e6)
    assert static_state_bytes(1_000_000, "bf16", 8, False).total == 18e6
    assert static_state_bytes(1_000_000, "fp32", 2, True).total == 4e6 + 4e6 + 4e6


def _gpt(h: int, a: int) -> ModelShape:
    """The Korthikanti GPT layer: MHA, plain (non-gated) MLP of 4h."""
    return ModelShape("gpt", h, 4 * h, 1, a, a, 1000, False, h // a, qkv_bias=True, gated_mlp=False)


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_activations_reduce_to_korthikanti_for_a_gpt_layer(tp):
    # Korthikanti et al. 2022 (Sec. 4): per token, sbh*(10 + 24/t + 5as/(ht)) without SP and
    # (34 + 5as/h)/t with SP, in bytes / (s*b). Here: no dropout (the 2 of the "10": the attention
    # and MLP output masks; the dropout mask after attention softmax is in the s^2 term) and flash
    # attention (no s^2 term; instead an fp32 log-sum-exp per head, 4a bytes split over TP).
    h, a = 1024, 16
    m = _gpt(h, a)
    assert activation_bytes_per_token_layer(m, tp, sequence_parallel=False) == pytest.approx(
        (10 - 2) * h + 24 * h / tp + 4 * a / tp
    )
    assert activation_bytes_per_token_layer(m, tp, sequence_parallel=True) == pytest.approx(
        ((34 - 2) * h + 4 * a) / tp
    )


def test_qwen2_5_32b_activation_bytes_by_hand():
    m = QWEN2_5["Qwen2.5-32B"]
    # norm+linear inputs 4*5120*2 + Q,K,V (5120+2*1024)*2 + attn out 5120*2 + LSE 40*4
    # + gate/up 2*27648*2 + SwiGLU out 27648*2
    by_hand = 40960 + 14336 + 10240 + 160 + 110592 + 55296
    assert by_hand == 231_584
    assert activation_bytes_per_token_layer(m, 1, False) == by_hand
    assert activation_bytes_per_token_layer(m, 8, True) == by_hand / 8
    # Full recompute: each layer keeps its bf16 input, plus one layer's full set while recomputing.
    got = activation_bytes(
        m, tokens=1000, layers=32, in_flight=2, tp=8, sequence_parallel=True, recompute=True
    )
    assert got == 1000 * (5120 * 2 / 8 * 32 * 2 + by_hand / 8)


def test_pipeline_in_flight_microbatches():
    assert in_flight_microbatches(0, pp=4, num_microbatches=16, vpp=None) == 4
    assert in_flight_microbatches(3, pp=4, num_microbatches=16, vpp=None) == 1
    assert in_flight_microbatches(0, pp=4, num_microbatches=2, vpp=None) == 2
    assert in_flight_microbatches(0, pp=4, num_microbatches=16, vpp=2) == 4 * (1 + 3 / 8)


def test_kv_cache_bytes_and_room():
    m = QWEN2_5["Qwen2.5-32B"]
    assert kv_bytes_per_token(m, 1) == 2 * 64 * 8 * 128 * 2 == 262_144
    assert kv_bytes_per_token(m, 4) == 65_536
    assert kv_bytes_per_token(m, 16) == kv_bytes_per_token(m, 8) == 32_768  # KV heads replicated past 8
    e = engine_memory(m, total_params=32_763_876_352, engine_tp=4, gpu_bytes=80 * GIB, mem_fraction=0.7)
    assert e.weights == 32_763_876_352 / 2
    assert e.kv_tokens == int((56 * GIB - 32_763_876_352 / 2) // 65_536)


TINY = ModelShape("tiny", 64, 128, 4, 4, 2, 250, False, 16)


def _small_case(**over) -> PlanInputs:
    return PlanInputs(
        model_path="tiny",
        tp=2,
        pp=2,
        sequence_parallel=True,
        actor_world_size=8,
        max_prompt_length=256,
        max_response_length=768,
        n=4,
        gen_batch_size=8,
        train_batch_size=8,
        ppo_mini_batch_size=4,
        micro_batch_max_tokens=2048,
        engine_tp=2,
        num_engines=4,
        mem_fraction_static=0.5,
        **over,
    )


SMALL_CASE = Assumptions(
    mean_prompt_len=100, mean_response_frac=0.5, overhead_gib=0, sglang_runtime_gib=0, paused_engine_gib=0
)


def test_whole_plan_memory_for_a_small_case_by_hand():
    plan = make_plan(_small_case(), TINY, gpu_for("h100", 1.0), SMALL_CASE)
    first, last = plan.stages
    # Params from test_plan_params: first 45440, last 45504. DP = 8 / 4 = 2.
    assert first.state.total == 45440 * (2 + 4 + 12 / 2)
    assert last.state.total == 45504 * (2 + 4 + 12 / 2)
    # Per token per layer with SP at TP=2: (8*64 + 4*64 + 4*32 + 4*4 + 6*128) / 2 = 840 bytes.
    # Mini-batch 4 prompts x 4 x 484 mean tokens / DP 2 = 3872 tokens -> ceil(3872 / (2048*0.9)) = 3
    # micro-batches, so the first stage holds min(pp=2, 3) = 2 of 2048 tokens over its 2 layers.
    assert plan.num_microbatches == 3
    assert first.activations == 2048 * 840 * 2 * 2
    assert last.activations == 2048 * 840 * 2 * 1
    # Logits: 2048 tokens x 256/2 vocab x 6 bytes, only where the head is.
    assert (first.logits, last.logits) == (0, 2048 * 128 * 6)
    assert plan.roles.total_gpus == plan.roles.actor_gpus == plan.roles.rollout_gpus == 8
    assert plan.fits


@pytest.mark.parametrize("knob", ["use_kl_loss", "use_kl_in_reward"])
def test_the_reference_model_is_counted_in_its_scoring_pass(knob):
    without = make_plan(_small_case(), TINY, gpu_for("h100", 1.0), SMALL_CASE)
    plan = make_plan(_small_case(**{knob: True}), TINY, gpu_for("h100", 1.0), SMALL_CASE)
    first, last = plan.stages
    # its bf16 weights, the stage's share (not sharded over DP: no optimizer), offloaded while
    # the actor trains: the train phase is unchanged, the scoring pass adds them
    assert (first.reference, last.reference) == (45440 * 2, 45504 * 2)
    assert without.stages[0].reference == 0
    assert first.train_total == without.stages[0].train_total
    assert last.scoring_total == last.state.total + 45504 * 2 + 2048 * 128 * 6
    assert last.total == max(last.train_total, last.scoring_total)
