"""The DAPO train step under TP/PP/DP/micro-batch layouts, against HF transformers.

One fixed rollout batch (4 groups x 2 samples, ragged prompts/responses, one sample masked out of
the loss, pi_old and rollout log-probs near the true ones so clipping, dual-clip and TIS all
act) is trained for one optimizer step in every layout. Two spawns (1 and 2 processes) run all
layouts, since process start-up dominates; the tests compare:
- loss, grad norm and the updated weights (gathered to HF names) across TP=1/2, PP=1/2, DP=1/2
  and 1 vs 4 micro-batches, within 1e-6 relative, for token-mean and seq-mean-token-mean;
- packed micro-batches (the default) against right-padded ones at TP=2, PP=2, DP=2 and several
  micro-batches, to the same tolerance;
- the loss against ``algo.policy_loss`` on log-probs from the HF transformers model (float64);
- pi_old recomputed before the first update equals the current policy (ppo_kl ~ 0, clipfrac 0),
  and trainer log-probs equal HF's;
- a non-finite loss skips the update and stops the run after max_consecutive_skips;
- every other policy loss (gspo, cispo, sapo, gpg; ``LOSS_RUNS``) equal at several micro-batches,
  TP=2 and PP=2 to its TP=1 run, and its loss to ``algo.policy_loss`` on HF's log-probs;
- the gradient with an entropy bonus (``entropy_coeff``) at TP=1 and TP=2 equals autograd
  through HF transformers' log_softmax entropy on the unsplit mini-batch (float64).
"""

from __future__ import annotations

import pytest
import torch
from helpers import as_bytes, from_bytes, hf_state
from layout_harness import BIG, CLIP, MODES, SMALL, TEMPERATURE, TIS_CAP, close, layout_actor

from megatron_dapo.actor.spawn import run_ranks

# Each loss other than vanilla with one aggregation (verl aggregates gspo and sapo per sequence).
LOSS_RUNS = {
    "gspo": "seq-mean-token-mean",
    "cispo": "token-mean",
    "sapo": "seq-mean-token-mean",
    "gpg": "token-mean",
}
ENTROPY_COEFF = 0.3
# Dr. GRPO (seq-mean-token-sum-norm): the run's generation budget, far from the batch's longest
# response (8), and an explicit actor.loss_scale_factor
DR_GRPO = "seq-mean-token-sum-norm"
DR_GRPO_BUDGET, DR_GRPO_SCALE = 40, 13


def _rank_run(rank, world, hf_dir, batch, old, runs):
    from megatron_dapo.actor.parallel import init_parallel

    out = {}
    for tp, pp, budget, mode, *extra in runs:  # extra: "padded" or a loss type
        init_parallel(tp=tp, pp=pp)
        loss = next((e for e in extra if e in LOSS_RUNS), "vanilla")
        knobs = {}
        if mode == DR_GRPO:
            knobs = dict(max_response_length=DR_GRPO_BUDGET)
            if "scale" in extra:
                knobs["loss_scale_factor"] = DR_GRPO_SCALE
        actor = layout_actor(
            hf_dir, budget, mode, pack_sequences="padded" not in extra, policy_loss=loss, **knobs
        )
        metrics = actor.update(batch.with_old_logprobs(old.float()))
        state = hf_state(actor)
        out[(tp, pp, world // (tp * pp), budget, mode, *extra)] = dict(
            metrics=metrics, state=state if rank == 0 else None
        )
    if world == 2:
        out["pi_old"] = _pi_old_checks(hf_dir, batch)
        out["entropy_grads"] = _entropy_grads(hf_dir, batch, old, tp=2)
    else:
        out["skips"] = _skip_checks(hf_dir, batch)
        out["entropy_grads"] = _entropy_grads(hf_dir, batch, old, tp=1)
    return as_bytes(out)


def _entropy_grads(hf_dir, batch, old, tp):
    """The gradient of one mini-batch's loss with the entropy bonus under HF names: the optimizer
    step is replaced by copying each parameter's reduced gradient into it."""
    from unittest import mock

    from megatron_dapo.actor.optimizer import StepOutcome
    from megatron_dapo.actor.parallel import init_parallel

    init_parallel(tp=tp, pp=1)
    actor = layout_actor(hf_dir, SMALL, "token-mean", entropy_coeff=ENTROPY_COEFF)

    def grads_into_params(optimizer, scheduler, loss):
        with torch.no_grad():
            for chunk in actor.model:
                for param in chunk.parameters():
                    param.copy_(param.main_grad)
        return StepOutcome(True, 0.0)

    with mock.patch("megatron_dapo.actor.actor.guarded_step", grads_into_params):
        metrics = actor.update(batch.with_old_logprobs(old.float()))
    return dict(metrics=metrics, grads=hf_state(actor))


def _pi_old_checks(hf_dir, batch):
    """TP=2: log-probs before any update, then a 2-mini-batch step (pi_old recomputed) and a
    single-update step (pi_old = current policy, detached)."""
    from megatron_dapo.actor.parallel import init_parallel

    init_parallel(tp=2, pp=1)
    actor = layout_actor(hf_dir, BIG, "token-mean", mini_batch=2)
    logprobs, entropy = actor.compute_logprobs(batch, TEMPERATURE, with_entropy=True)
    recomputed = actor.update(batch)
    single = layout_actor(hf_dir, BIG, "token-mean", mini_batch=4).update(batch)
    epochs = layout_actor(hf_dir, BIG, "token-mean", mini_batch=4, ppo_epochs=2).update(batch)
    return dict(logprobs=logprobs, entropy=entropy, recomputed=recomputed, single=single, epochs=epochs)


def _skip_checks(hf_dir, batch):
    from megatron_dapo.actor.actor import TrainingDivergedError
    from megatron_dapo.actor.parallel import init_parallel
    from megatron_dapo.weights.model_io import unwrap

    init_parallel(tp=1, pp=1)
    actor = layout_actor(hf_dir, BIG, "token-mean", mini_batch=4, max_consecutive_skips=2)
    norm = unwrap(actor.model[-1]).decoder.final_layernorm.weight
    with torch.no_grad():
        norm[0] = float("nan")
    before = {k: v.clone() for k, v in unwrap(actor.model[0]).state_dict().items() if torch.is_tensor(v)}
    first = actor.update(batch)
    after = {k: v for k, v in unwrap(actor.model[0]).state_dict().items() if torch.is_tensor(v)}
    unchanged = all(torch.equal(before[k], after[k]) for k in before if k != "decoder.final_layernorm.weight")
    try:
        actor.update(batch)
        error = None
    except TrainingDivergedError as e:
        error = str(e)
    return dict(first=first, unchanged=unchanged, error=error, state=actor.state)


# right-padded micro-batches (actor.pack_sequences=false) at TP=2, PP=2 and DP=2
PADDED_PAIRS = [(2, 1, BIG, "token-mean", "padded"), (1, 2, BIG, "seq-mean-token-mean", "padded")]
PADDED_PAIRS += [(1, 1, BIG, "token-mean", "padded")]


@pytest.fixture(scope="module")
def results(layout_hf_dir, layout_data):
    batch, old, _ = layout_data
    solo = [(1, 1, b, m) for m in MODES for b in (BIG, SMALL)] + [(1, 1, SMALL, m, "padded") for m in MODES]
    solo += [(1, 1, b, m, loss) for loss, m in LOSS_RUNS.items() for b in (BIG, SMALL)]
    solo += [(1, 1, b, DR_GRPO) for b in (BIG, SMALL)] + [(1, 1, BIG, DR_GRPO, "scale")]
    pair = [(tp, pp, BIG, m) for m in MODES for tp, pp in ((2, 1), (1, 2), (1, 1))] + PADDED_PAIRS
    pair += [(tp, pp, BIG, m, loss) for loss, m in LOSS_RUNS.items() for tp, pp in ((2, 1), (1, 2))]
    pair += [(2, 1, BIG, DR_GRPO)]
    one = from_bytes(run_ranks(_rank_run, 1, layout_hf_dir, batch, old, solo, timeout_s=600)[0])
    two = from_bytes(run_ranks(_rank_run, 2, layout_hf_dir, batch, old, pair, timeout_s=600)[0])
    two["entropy_grads_tp2"] = two.pop("entropy_grads")
    return {**one, **two}


def test_small_budget_gives_four_micro_batches(layout_data):
    from megatron_dapo.actor.micro_batches import pack_by_real_tokens, pack_by_token_budget

    batch = layout_data[0]
    lengths = batch.seq_lens.tolist()
    assert len(pack_by_token_budget(lengths, list(range(len(batch))), SMALL)) == 4
    assert len(pack_by_token_budget(lengths, list(range(len(batch))), BIG)) == 1
    # packed, the budget counts real tokens: the 68 tokens fill three micro-batches of <= 24
    assert len(pack_by_real_tokens(lengths, list(range(len(batch))), SMALL)) == 3


@pytest.mark.parametrize(
    "padded",
    [(1, 1, 1, SMALL, m, "padded") for m in MODES]
    + [(tp, pp, 2 // (tp * pp), b, m, p) for tp, pp, b, m, p in PADDED_PAIRS],
    ids=str,
)
def test_packed_equals_padded(results, padded):
    """The same step on packed micro-batches (samples back to back, THD) and on right-padded
    ones: loss, grad norm, metrics and weights within the layouts' tolerance; only the padding
    differs (actor/padding_fraction: none packed, as no layout here pads a sample)."""
    ref, got = results[padded], results[padded[:-1]]
    ref_u, got_u = ref["metrics"]["updates"][0], got["metrics"]["updates"][0]
    assert ref_u["updated"] and got_u["updated"]
    assert close(got_u["loss"], ref_u["loss"]), (got_u["loss"], ref_u["loss"])
    assert close(got_u["grad_norm"], ref_u["grad_norm"]), (got_u["grad_norm"], ref_u["grad_norm"])
    for key in ("clipfrac", "ppo_kl", "entropy", "tis_mean", "mismatch_k3", "tokens", "seqs"):
        assert close(got_u[key], ref_u[key], 1e-5), key
    assert got["metrics"]["padding_fraction"] == 0 < ref["metrics"]["padding_fraction"] < 1
    if ref["state"] is not None:
        for name, w in ref["state"].items():
            diff = (got["state"][name] - w).abs().max()
            assert diff <= 1e-6 * w.abs().max(), (name, float(diff))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "layout", [(1, 1, 1, SMALL), (2, 1, 1, BIG), (1, 2, 1, BIG), (1, 1, 2, BIG)], ids=str
)
def test_layout_invariance(results, mode, layout):
    tp, pp, dp, budget = layout
    ref = results[(1, 1, 1, BIG, mode)]
    got = results[(tp, pp, dp, budget, mode)]
    ref_u, got_u = ref["metrics"]["updates"][0], got["metrics"]["updates"][0]
    assert ref_u["updated"] and got_u["updated"]
    assert close(got_u["loss"], ref_u["loss"]), (got_u["loss"], ref_u["loss"])
    assert close(got_u["grad_norm"], ref_u["grad_norm"]), (got_u["grad_norm"], ref_u["grad_norm"])
    for key in ("clipfrac", "clipfrac_high", "clipfrac_low", "clipfrac_lower", "tis_mean", "mismatch_k3"):
        assert close(got_u[key], ref_u[key], 1e-5), key
    assert got["state"].keys() == ref["state"].keys()
    for name, w in ref["state"].items():
        diff = (got["state"][name] - w).abs().max()
        assert diff <= 1e-6 * w.abs().max(), (name, float(diff))


def test_step_really_trains_and_clips(results, layout_hf_dir):
    from helpers import hf_state_dict

    initial = hf_state_dict(layout_hf_dir)
    updated = results[(1, 1, 1, BIG, "token-mean")]["state"]
    assert all((updated[k] - w).abs().max() > 1e-4 for k, w in initial.items() if "layernorm" not in k)
    m = results[(1, 1, 1, BIG, "token-mean")]["metrics"]
    # 36 response tokens: sample 3's 3 masked, 6 the environment's
    assert m["num_updates"] == 1 and m["tokens"] == 27
    assert m["clipfrac"] > 0 and m["clipfrac_high"] > 0 and m["clipfrac_low"] > 0
    assert m["grad_norm"] > 1.0  # clipping to 1.0 is active
    assert 0.5 < m["tis_mean"] <= TIS_CAP


@pytest.mark.parametrize("mode", MODES)
def test_loss_equals_policy_loss_on_hf_logprobs(results, layout_data, mode):
    from megatron_dapo.algo import policy_loss

    batch, old, hf = layout_data
    loss, metrics = policy_loss(
        hf,
        old.float().double(),
        batch.advantages.double(),
        batch.response_mask,
        **CLIP,
        loss_agg_mode=mode,
        rollout_logprobs=batch.rollout_logprobs.double(),
        tis_cap=TIS_CAP,
    )
    got = results[(1, 1, 1, BIG, mode)]["metrics"]["updates"][0]
    assert abs(got["loss"] - float(loss)) < 1e-5 * max(1.0, abs(float(loss)))
    assert abs(got["ppo_kl"] - float(metrics["ppo_kl"])) < 1e-5
    assert got["clipfrac"] == pytest.approx(float(metrics["clipfrac"]), abs=1e-9)


@pytest.mark.parametrize("scale", [None, DR_GRPO_SCALE], ids=["budget", "loss_scale_factor"])
def test_dr_grpo_divides_by_the_budget_not_the_longest_response(results, layout_data, scale):
    """seq-mean-token-sum-norm's divisor is data.max_response_length (or actor.loss_scale_factor),
    a constant: the loss equals algo.policy_loss on HF's log-probs with that divisor, at one and
    at several micro-batches and at TP=2, and not the value the batch's longest response gives.
    Before, the actor divided by the step's longest response."""
    from megatron_dapo.algo import policy_loss

    batch, old, hf = layout_data
    divisor = scale or DR_GRPO_BUDGET
    assert batch.max_response_len != divisor

    def expected(norm_len):
        loss, _ = policy_loss(
            hf,
            old.float().double(),
            batch.advantages.double(),
            batch.response_mask,
            **CLIP,
            loss_agg_mode=DR_GRPO,
            norm_len=norm_len,
            rollout_logprobs=batch.rollout_logprobs.double(),
            tis_cap=TIS_CAP,
        )
        return float(loss)

    want, longest = expected(divisor), expected(batch.max_response_len)
    assert abs(want - longest) > 0.5 * abs(want)  # the two divisors are far apart
    runs = [(1, 1, 1, BIG, DR_GRPO, "scale")] if scale else [(1, 1, 1, b, DR_GRPO) for b in (BIG, SMALL)]
    runs += [] if scale else [(2, 1, 1, BIG, DR_GRPO)]
    for key in runs:
        got = results[key]["metrics"]["updates"][0]["loss"]
        assert abs(got - want) < 1e-5 * max(1.0, abs(want)), (key, got, want, longest)


def test_pi_old_is_current_policy_before_first_update(results, layout_data):
    batch, _, hf = layout_data
    r = results["pi_old"]
    mask = torch.arange(batch.max_response_len)[None] < batch.response_lens[:, None]
    assert (r["logprobs"].double() - hf).abs()[mask].max() < 1e-5
    assert r["entropy"][mask].min() > 0
    first = r["recomputed"]["updates"][0]
    assert len(r["recomputed"]["updates"]) == 2
    assert abs(first["ppo_kl"]) < 1e-7 and first["clipfrac"] == 0
    assert r["recomputed"]["updates"][1]["ppo_kl"] != 0  # the second mini-batch sees updated weights
    single = r["single"]["updates"][0]
    assert single["ppo_kl"] == 0 and single["clipfrac"] == 0
    # one mini-batch but two epochs: pi_old is recomputed and stays fixed for the second pass
    first, second = r["epochs"]["updates"]
    assert abs(first["ppo_kl"]) < 1e-7 and first["clipfrac"] == 0
    assert abs(second["ppo_kl"]) > 1e-5 and r["epochs"]["num_updates"] == 2
    # train/rollout mismatch: |pi_old - rollout| ~ 0.05 * sqrt(2/pi) for the injected noise
    assert 0.02 < r["recomputed"]["mismatch_abs"] < 0.08


def test_non_finite_loss_skips_then_stops(results):
    r = results["skips"]
    assert r["first"]["skipped_updates"] == 1 and r["first"]["num_updates"] == 0
    assert r["unchanged"]
    assert r["error"] is not None and "2 consecutive optimizer updates were skipped" in r["error"]
    assert "non-finite" in r["error"]


@pytest.mark.parametrize("loss", LOSS_RUNS)
@pytest.mark.parametrize("layout", [(1, 1, 1, SMALL), (2, 1, 1, BIG), (1, 2, 1, BIG)], ids=str)
def test_each_loss_type_is_layout_invariant(results, loss, layout):
    tp, pp, dp, budget = layout
    mode = LOSS_RUNS[loss]
    ref = results[(1, 1, 1, BIG, mode, loss)]
    got = results[(tp, pp, dp, budget, mode, loss)]
    ref_u, got_u = ref["metrics"]["updates"][0], got["metrics"]["updates"][0]
    assert ref_u["updated"] and got_u["updated"]
    assert close(got_u["loss"], ref_u["loss"]), (got_u["loss"], ref_u["loss"])
    assert close(got_u["grad_norm"], ref_u["grad_norm"]), (got_u["grad_norm"], ref_u["grad_norm"])
    for key in ("clipfrac", "clipfrac_high", "clipfrac_low", "ppo_kl"):
        assert close(got_u[key], ref_u[key], 1e-5), key
    for name, w in ref["state"].items():
        diff = (got["state"][name] - w).abs().max()
        assert diff <= 1e-6 * w.abs().max(), (name, float(diff))
    # a different loss really ran: its update differs from vanilla's
    vanilla = results[(1, 1, 1, BIG, "token-mean")]["metrics"]["updates"][0]
    assert ref_u["loss"] != vanilla["loss"]


@pytest.mark.parametrize("loss", LOSS_RUNS)
def test_each_loss_type_equals_policy_loss_on_hf_logprobs(results, layout_data, loss):
    from megatron_dapo.algo import policy_loss

    batch, old, hf = layout_data
    want, metrics = policy_loss(
        hf,
        old.float().double(),
        batch.advantages.double(),
        batch.response_mask,
        **CLIP,
        loss_type=loss,
        loss_agg_mode=LOSS_RUNS[loss],
        rollout_logprobs=batch.rollout_logprobs.double(),
        tis_cap=TIS_CAP,
    )
    got = results[(1, 1, 1, BIG, LOSS_RUNS[loss], loss)]["metrics"]["updates"][0]
    assert abs(got["loss"] - float(want)) < 1e-5 * max(1.0, abs(float(want))), (got["loss"], float(want))
    assert got["clipfrac"] == pytest.approx(float(metrics["clipfrac"]), abs=1e-9)


def _hf_entropy_bonus_grads(hf_dir, batch, old, coeff):
    """Autograd through HF transformers (float64) of policy loss - coeff x token-mean entropy,
    on the unsplit mini-batch: a plain log_softmax over the whole vocabulary."""
    from transformers import AutoModelForCausalLM

    from megatron_dapo.algo import policy_loss

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64)
    model.train(False)
    rows_lp, rows_ent = [], []
    for i in range(len(batch)):
        p, r = int(batch.prompt_lens[i]), int(batch.response_lens[i])
        ids = batch.input_ids[i][None]
        logits = model(ids).logits[0, p - 1 : p - 1 + r] / TEMPERATURE
        logp = torch.log_softmax(logits, -1)
        rows_lp.append(logp.gather(-1, ids[0, p : p + r, None]).squeeze(-1))
        rows_ent.append(-(logp.exp() * logp).sum(-1))
    lps = torch.nn.utils.rnn.pad_sequence(rows_lp, batch_first=True)
    ents = torch.nn.utils.rnn.pad_sequence(rows_ent, batch_first=True)
    mask = batch.response_mask
    pg, _ = policy_loss(
        lps,
        old.float().double(),
        batch.advantages.double(),
        mask,
        **CLIP,
        loss_agg_mode="token-mean",
        rollout_logprobs=batch.rollout_logprobs.double(),
        tis_cap=TIS_CAP,
    )
    entropy = torch.where(mask, ents, torch.zeros_like(ents)).sum() / mask.sum()
    (pg - coeff * entropy).backward()
    return (
        {name: p.grad.clone() for name, p in model.named_parameters()},
        float(pg.detach()),
        float(entropy.detach()),
    )


@pytest.mark.parametrize("world", [1, 2], ids=["tp1", "tp2"])
def test_entropy_bonus_gradient_equals_autograd_through_hf_entropy(
    results, layout_hf_dir, layout_data, world
):
    batch, old, _ = layout_data
    want, pg, entropy = _hf_entropy_bonus_grads(layout_hf_dir, batch, old, ENTROPY_COEFF)
    without, _, _ = _hf_entropy_bonus_grads(layout_hf_dir, batch, old, 0.0)
    got = results["entropy_grads"] if world == 1 else results["entropy_grads_tp2"]
    u = got["metrics"]["updates"][0]
    assert (
        abs(u["loss"] - pg) < 1e-5 * max(1.0, abs(pg)) and abs(u["entropy_loss"] - entropy) < 1e-5 * entropy
    )
    grads = got["grads"]
    assert grads.keys() == want.keys()
    for name, g in want.items():
        scale = g.abs().max()
        assert (grads[name].double() - g).abs().max() <= 1e-4 * scale, (
            name,
            float((grads[name].double() - g).abs().max() / scale),
        )
    # the entropy term moves the gradient well beyond that tolerance
    assert max(float((want[k] - without[k]).abs().max() / want[k].abs().max()) for k in want) > 1e-2
