"""The planner with a served reward model (reward.model), against figures worked out here by hand
for configs/dapo_judge_qwen2.5_7b.yaml: the reward servers' GPUs are the job's on top of the
actor's and engines', each server's memory is an engine's for the reward model, and scoring every
generated response takes prefill (and a judge's verdict) time that overlaps decoding."""

import math
from pathlib import Path

import pytest

from megatron_dapo.cli import main
from megatron_dapo.config import load_config
from megatron_dapo.plan import Assumptions, gpu_for, plan_from_config
from megatron_dapo.plan.inputs import BUILTIN_JUDGE_TEMPLATE_CHARS
from megatron_dapo.rewards.served.judge import DEFAULT_PROMPT_TEMPLATE

GIB = 1024**3
RECIPE = str(Path(__file__).resolve().parents[1] / "configs" / "dapo_judge_qwen2.5_7b.yaml")
QWEN25_7B = 7_615_616_512  # Qwen/Qwen2.5-7B's published size (test_plan_by_hand counts it)
H100 = gpu_for("h100")


def plan(*overrides, a=None, num_gpus=None, gpu=H100):
    return plan_from_config(load_config(RECIPE, list(overrides)), gpu, a, num_gpus)


def test_the_judge_servers_gpus_come_on_top_of_the_actors_and_engines():
    pl = plan()
    r = pl.roles
    # 4 servers x 1 GPU, beside the 7B recipe's 8 colocated GPUs
    assert (r.total_gpus, r.actor_gpus, r.rollout_gpus, r.reward_gpus, r.colocated) == (12, 8, 8, 4, True)
    assert pl.fits, [c for c in pl.checks if not c.ok]
    two = plan("reward.model.num_servers=2", "reward.model.gpus_per_server=2")
    assert (two.roles.total_gpus, two.roles.reward_gpus) == (12, 4)
    # --num-gpus counts every GPU of the job: the actor gets what the reward servers leave
    assert plan(num_gpus=20).roles.actor_gpus == 16
    # disaggregated: actor + rollout + reward
    dis = plan("trainer.placement=disaggregated", "trainer.rollout_gpus=4")
    assert (dis.roles.total_gpus, dis.roles.actor_gpus, dis.roles.rollout_gpus) == (16, 8, 4)


def test_a_judge_servers_memory_by_hand():
    rs = plan().reward
    assert rs.params == QWEN25_7B  # a judge is the whole causal LM
    weights = QWEN25_7B * 2  # bf16, TP=1
    pool = 0.6 * 80 * GIB  # rollout.sglang.mem_fraction_static of the GPU
    kv_per_token = 2 * 28 * 4 * 128 * 2  # K and V, 28 layers, 4 KV heads of 128, bf16
    assert (rs.memory.weights, rs.memory.static_pool, rs.memory.kv_bytes_per_token) == (
        weights,
        pool,
        kv_per_token,
    )
    assert rs.memory.kv_tokens == int((pool - weights) // kv_per_token) == 633_167
    template = math.ceil(934 / 4)  # the recipe's template, 4 characters a token
    assert rs.mean_request == 200 + 0.25 * 4096 + template == 1458
    assert rs.longest_request == 2048 + 4096 + template + 64  # + reward.model.max_new_tokens


def test_scoring_time_by_hand_and_it_overlaps_decoding():
    pl = plan()
    responses = 192 * 16  # one round of gen_batch_size prompts (64 / (192 x 0.5) < 1)
    prefill_rate = 989e12 * 0.3 / (2 * QWEN25_7B)  # 2 FLOPs a parameter at MFU 0.3: 19,480 tok/s
    decode_rate = 40_000 / (QWEN25_7B / 1e9)  # the engines' rule for a 7.6 B model on H100
    sc = pl.scoring
    assert sc.requests == responses and sc.prefill_tokens == responses * 1458
    assert sc.prefill_s == pytest.approx(responses * 1458 / (prefill_rate * 4))  # 57.5 s
    assert sc.verdict_s == pytest.approx(responses * 8 / (decode_rate * 4))  # 1.2 s
    decode_s = responses * 1024 / (decode_rate * 8)  # 74.9 s on the 8 engines
    t = pl.times
    assert (t.decode_s, t.score_s) == (pytest.approx(decode_s), pytest.approx(sc.prefill_s + sc.verdict_s))
    assert t.rollout_s == pytest.approx(decode_s)  # 58.7 s of scoring hides behind 74.9 of decoding
    one = plan("reward.model.num_servers=1").times
    assert one.score_s == pytest.approx(4 * t.score_s) and one.rollout_s == one.score_s  # 234.6 s > 74.9


def test_a_classifier_has_a_score_head_and_no_verdicts():
    pl = plan(
        "reward.model.kind=classifier",
        "reward.model.prompt_template=null",
        "reward.model.parser=yes_no",
        "reward.model.max_new_tokens=1024",
    )
    rs = pl.reward
    assert rs.params == QWEN25_7B - 152064 * 3584 + 3584  # no LM head; a 3584 x 1 score head
    assert rs.mean_request == 200 + 1024 and rs.longest_request == 2048 + 4096
    assert pl.scoring.verdict_tokens == 0 and pl.scoring.verdict_s == 0.0
    assert not any(row[0].startswith("judge") for row in pl.assumptions)


def test_a_reward_model_by_url_counts_no_gpus_and_says_so():
    pl = plan("reward.model.path=null", "reward.model.url=http://judge:30000", "reward.model.num_servers=1")
    assert pl.roles.total_gpus == 8 and pl.reward is None and pl.scoring is None and pl.times.score_s == 0
    (row,) = [r for r in pl.assumptions if r[0] == "reward model"]
    assert "http://judge:30000" in row[1] and "none of its GPUs" in row[2]


def test_a_reward_server_that_does_not_fit_gets_a_fix():
    # 3 does not divide 28 heads / 4 KV heads
    bad = plan("reward.model.gpus_per_server=3")
    (check,) = [c for c in bad.checks if c.role == "reward"]
    assert not check.ok and check.fix == ["reward.model.gpus_per_server=2"]
    # a 24 GiB GPU: 14.4 GiB pool, 14.2 GiB of weights, KV for ~4k tokens < 6,442
    small = plan(gpu=gpu_for("h100", 24.0))
    (check,) = [c for c in small.checks if c.role == "reward"]
    assert not check.ok and "longest request of 6,442" in check.what
    assert check.fix == ["reward.model.gpus_per_server=2"]


def test_the_builtin_template_size_is_the_judges():
    assert len(DEFAULT_PROMPT_TEMPLATE) == BUILTIN_JUDGE_TEMPLATE_CHARS
    pl = plan("reward.model.prompt_template=null")
    assert pl.reward.mean_request == 200 + 1024 + math.ceil(BUILTIN_JUDGE_TEMPLATE_CHARS / 4)


def test_the_scoring_assumptions_are_printed_and_have_flags(capsys):
    assert main(["plan", RECIPE]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in (
        "4 GPUs of their own: 4 SGLang servers x TP=1, judge",
        "19,480 prefill tok/s per reward GPU",
        "8 tokens at 5,252 tok/s per GPU",
        "234 tokens a request",
        "mem_fraction_static=0.6",
        "3,072 requests, 4.5 M tokens prefilled",
        "within decoding's 1.2 min",
    ):
        assert text in out, text
    assert main(["plan", RECIPE, "--score-tok-s-per-gpu", "5000", "--verdict-tokens", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "5,000 prefill tok/s per reward GPU" in out and "2 tokens at" in out
    # 4.5 M tokens / (4 x 5,000 tok/s) = 3.7 min, longer than 1.2 min of decoding
    assert (
        "= 3.7 min, longer than decoding (1.2 min)" in out and "bounds the rollout; add reward servers" in out
    )
    a = Assumptions(score_tok_s_per_gpu=5000.0, verdict_tokens=2.0)
    assert plan(a=a).scoring.prefill_s == pytest.approx(3072 * 1458 / (5000 * 4))
    assert main(["plan", RECIPE, "--score-tok-s-per-gpu", "0"]) == 2


def test_colocated_reward_servers_add_no_gpus_share_memory_and_add_their_time_to_decoding():
    """reward.model.placement=colocated, by hand: the 4 judge servers sit on 4 of the 8 engine
    GPUs (which are the actor's: trainer.placement=colocated), in 0.3 of each beside the engine's
    0.6; scoring no longer overlaps decoding but adds to it."""
    own = plan()
    pl = plan("reward.model.placement=colocated", "reward.model.mem_fraction_static=0.3")
    r = pl.roles
    assert (r.total_gpus, r.actor_gpus, r.rollout_gpus, r.reward_gpus) == (8, 8, 8, 0)
    weights, kv_per_token = QWEN25_7B * 2, 2 * 28 * 4 * 128 * 2
    pool = 0.3 * 80 * GIB
    assert (pl.reward.memory.static_pool, pl.reward.memory.weights) == (pool, weights)
    assert pl.reward.memory.kv_tokens == int((pool - weights) // kv_per_token)
    # the same scoring work on the same 4 GPUs, now added to the 74.9 s of decoding
    assert pl.scoring.score_s == pytest.approx(own.scoring.score_s)
    assert pl.times.rollout_s == pytest.approx(pl.times.decode_s + pl.scoring.score_s)
    assert own.times.rollout_s == pytest.approx(own.times.decode_s)
    # the server never releases its 24 GiB: the actor's generation phase counts it
    assert pl.rollout_phase_bytes == pytest.approx(own.rollout_phase_bytes + pool)
    (row,) = [row for row in pl.assumptions if row[0] == "reward placement"]
    assert "shared with rollout engines" in row[1]


def test_colocated_placement_is_refused_where_it_cannot_hold():
    from megatron_dapo.config import ConfigError

    with pytest.raises(ConfigError, match=r"rollout.sglang.mem_fraction_static=0.75 or lower"):
        load_config(RECIPE, ["reward.model.placement=colocated", "rollout.sglang.mem_fraction_static=0.8"])
    assert load_config(RECIPE, ["reward.model.placement=colocated"]).reward.model.mem_fraction_static == 0.15
    with pytest.raises(ConfigError, match=r"rollout.sglang.mem_fraction_static=0.5 or lower"):
        load_config(RECIPE, ["reward.model.placement=colocated", "reward.model.mem_fraction_static=0.4"])
    with pytest.raises(ConfigError, match=r"num_servers=9 must be <= rollout.num_engines=8"):
        load_config(RECIPE, ["reward.model.placement=colocated", "reward.model.num_servers=9"])
    with pytest.raises(ConfigError, match=r"a reward.model.url server runs where it was started"):
        load_config(
            RECIPE,
            [
                "reward.model.placement=colocated",
                "reward.model.path=null",
                "reward.model.url=http://j:30000",
                "reward.model.num_servers=1",
            ],
        )
    with pytest.raises(ConfigError, match=r"rollout.engine=sglang or auto.*reward.model.placement=own"):
        load_config(RECIPE, ["reward.model.placement=colocated", "rollout.engine=hf"])
    with pytest.raises(ConfigError, match=r"reward.model.placement='shared' is not one of own, colocated"):
        load_config(RECIPE, ["reward.model.placement=shared"])
