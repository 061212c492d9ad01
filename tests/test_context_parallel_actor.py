"""Context parallelism wired through the actor, on CPU (2 gloo ranks, CP=2, with the CPU stand-in
for TE's CP attention, ``actor/cpu_cp_attention.py``).

One launch of 2 ranks checks, on the ragged batch of ``test_actor_layouts`` (short rows, loss
tokens unevenly spread over the two CP ranks):
- log-probs of every response token at CP=2 equal an HF transformers forward within 1e-5, and
  the entropy equals the CP=1 run's;
- one DAPO step at CP=2 with packed micro-batches (each sample cut into 2 * CP chunks on its
  own) equals CP=1 with one right-padded micro-batch (DP=2; DP is checked against DP=1 by
  test_actor_layouts): loss, grad norm, clip fractions and every updated weight within the fp32
  tolerance of the dense layout test (1e-6 relative);
- the CP=2 loss equals ``algo.policy_loss`` on HF log-probs (an independent reference);
- the same at CP=2 vs CP=1 with the whole-sequence quantities: ``seq-mean-token-mean`` (a row's
  token count spans the CP ranks) with a geometric-level TIS rollout correction (a row's mean
  log-ratio spans them), whose cap truncates some rows; and that loss equals ``policy_loss`` on
  HF log-probs too.
"""

from __future__ import annotations

import pytest
import torch
from helpers import as_bytes, from_bytes, hf_state
from layout_harness import BIG, CLIP, SMALL, TEMPERATURE, TIS_CAP, close, layout_actor

from megatron_dapo.actor.spawn import run_ranks
from megatron_dapo.algo import RolloutCorrection

# A cap near 1 so the geometric weights of some rows are truncated (rc_fraction > 0).
GEOMETRIC = RolloutCorrection(mode="tis", level="geometric", threshold=1.03)
SEQ_MODE = dict(mode="seq-mean-token-mean", tis_cap=None, rollout_correction=GEOMETRIC)


def _rank_run(rank, world, hf_dir, batch, old):
    from megatron_dapo.actor.parallel import init_parallel

    out = {}
    for cp, budget in ((2, SMALL), (1, BIG)):
        layout = init_parallel(cp=cp)
        assert layout.cp_size == cp and layout.dp_size == world // cp
        actor = layout_actor(hf_dir, budget, "token-mean", pack_sequences=cp == 2)
        logprobs, entropy = actor.compute_logprobs(batch, TEMPERATURE, with_entropy=True)
        metrics = actor.update(batch.with_old_logprobs(old.float()))
        out[cp] = dict(logprobs=logprobs, entropy=entropy, metrics=metrics, state=hf_state(actor))
        # Scoring is mode-independent: only the update of the sequence-level mode is checked.
        actor = layout_actor(hf_dir, budget, **SEQ_MODE, pack_sequences=cp == 2)
        metrics = actor.update(batch.with_old_logprobs(old.float()))
        out[("seq", cp)] = dict(metrics=metrics, state=hf_state(actor))
    return as_bytes(out)


@pytest.fixture(scope="module")
def results(layout_hf_dir, layout_data):
    batch, old, _ = layout_data
    ranks = run_ranks(_rank_run, 2, layout_hf_dir, batch, old, timeout_s=600)
    return [from_bytes(r) for r in ranks]


def test_cp2_logprobs_equal_transformers(results, layout_data):
    batch, _, hf = layout_data
    mask = batch.response_mask | (torch.arange(batch.max_response_len) < batch.response_lens[:, None])
    for per_rank in results:  # every rank returns the whole rows
        got = per_rank[2]["logprobs"].double()
        assert (got - hf).abs()[mask].max() < 1e-5
        assert torch.allclose(per_rank[2]["entropy"], per_rank[1]["entropy"], rtol=1e-5, atol=1e-6)


def test_cp2_step_equals_cp1(results):
    _check_step_equal(results, 1, 2)


def test_cp2_sequence_level_step_equals_cp1(results):
    """seq-mean-token-mean with a geometric rollout correction: per-row sums over CP."""
    _check_step_equal(results, ("seq", 1), ("seq", 2), keys=("clipfrac", "ppo_kl", "rc_weight_mean"))
    got = results[0][("seq", 2)]["metrics"]["updates"][0]
    ref = results[0][("seq", 1)]["metrics"]["updates"][0]
    # the cap bites on some rows, and the spread of whole-row weights is that of CP=1
    assert 0 < got["rc_fraction"] < 1 and close(got["rc_fraction"], ref["rc_fraction"]), (got, ref)
    for key in ("rc_weight_max", "rc_weight_min"):
        assert close(got[key], ref[key], 1e-6), (key, got[key], ref[key])


def _check_step_equal(results, ref_key, got_key, keys=None):
    keys = keys or (
        "clipfrac",
        "clipfrac_high",
        "clipfrac_low",
        "entropy",
        "ppo_kl",
        "tis_mean",
        "mismatch_k3",
    )
    ref, got = results[0][ref_key], results[0][got_key]
    ref_u, got_u = ref["metrics"]["updates"][0], got["metrics"]["updates"][0]
    assert ref_u["updated"] and got_u["updated"]
    assert close(got_u["loss"], ref_u["loss"]), (got_u["loss"], ref_u["loss"])
    assert close(got_u["grad_norm"], ref_u["grad_norm"]), (got_u["grad_norm"], ref_u["grad_norm"])
    for key in ("tokens", "seqs"):
        assert got_u[key] == ref_u[key], key
    for key in keys:
        assert close(got_u[key], ref_u[key], 1e-5), (key, got_u[key], ref_u[key])
    assert got["state"].keys() == ref["state"].keys()
    for name, w in ref["state"].items():
        diff = (got["state"][name] - w).abs().max()
        assert diff <= 1e-6 * w.abs().max(), (name, float(diff))
    # both CP ranks hold the same (DP x CP-reduced) weights
    for name, w in got["state"].items():
        assert torch.equal(results[1][got_key]["state"][name], w), name


def test_cp2_loss_equals_policy_loss_on_hf_logprobs(results, layout_data):
    from megatron_dapo.algo import policy_loss

    batch, old, hf = layout_data
    common = dict(
        old_logprobs=old.float().double(), advantages=batch.advantages.double(), mask=batch.response_mask
    )
    rollout = batch.rollout_logprobs.double()
    for key, extra in (
        (2, dict(loss_agg_mode="token-mean", tis_cap=TIS_CAP)),
        (("seq", 2), dict(loss_agg_mode="seq-mean-token-mean", rollout_correction=GEOMETRIC)),
    ):
        loss, _ = policy_loss(hf, **common, **CLIP, rollout_logprobs=rollout, **extra)
        got = results[0][key]["metrics"]["updates"][0]["loss"]
        assert abs(got - float(loss)) < 1e-5 * max(1.0, abs(float(loss))), (key, got, float(loss))


def test_config_accepts_sequence_level_losses_with_cp(tmp_path):
    """CP > 1 with seq-mean-token-mean or a sequence/geometric rollout correction loads (it was
    refused when a row had to be whole on one rank)."""
    from megatron_dapo.config.loader import load_config

    base = [f"model.path={tmp_path}", "parallel.actor_world_size=2", "parallel.context_parallel_size=2"]
    cfg = load_config(None, [*base, "algorithm.loss_agg_mode=seq-mean-token-mean"])
    assert cfg.parallel.context_parallel_size == 2
    load_config(
        None, [*base, "algorithm.rollout_correction.mode=mask", "algorithm.rollout_correction.level=sequence"]
    )
