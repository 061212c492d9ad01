"""The two-mini-batch policy losses through the whole stack once (Ray, 2 Megatron ranks at TP=2,
the HF engine, the weight sync): one step of the cheapest end-to-end run per loss, with dynamic
sampling on so every group carries a gradient. (gspo and sapo run one mini-batch, where every
ratio is 1 and their value follows from the dumped rewards and lengths alone: they are checked on
runs test_driver_e2e makes anyway, test_two_steps_end_to_end and the hung-rank run, by
``e2e_harness.check_one_update_loss``.)

cispo and gpg weigh ``log pi``, and at ratio 1 CISPO's clipped weight is 1: its loss would be
GPG's. They run two mini-batches (two groups each, in batch order), so the second update's ratio
``pi / pi_old`` is not 1. Their step is recomputed here in float64, independently of the trainer:
the dumped responses re-tokenised (the demo's tokenizer is one token per character), HF
transformers' log-probs of the initial weights, the advantages by hand (rloo and
reinforce_plus_plus_baseline), each loss written out, the first mini-batch's gradient by autograd,
the first AdamW step by hand (grad clipping, decoupled weight decay on matrices only, Adam's first
step ``lr g / (|g| + eps)`` with ``eps`` far above the gradients so it is well conditioned), then
the second mini-batch's loss at the moved weights against the first log-probs as pi_old. The run's
``actor/pg_loss`` (the mean over the two updates), ``actor/grad_norm`` and ``actor/ppo_kl`` must
equal those; CISPO's clip binds on some tokens, and the other loss's value (CISPO with weight 1 is
GPG, GPG with a clipped weight is CISPO) is shown to miss.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from e2e_harness import (
    DAPO_ON,
    REPO,
    Float64Policy,
    outcome_advantages,
    read_metrics,
    read_rollouts,
    token_ids,
    train_overrides,
)

from megatron_dapo.driver.launch import load_for_cli, run_train

CHEAPEST = {
    "trainer.val_before_train": "false",
    "trainer.test_freq": 0,
    "trainer.save_freq": 0,
    "trainer.hf_export_at_end": "false",
    "logging.plots_at_end": "false",
    "rollout.dump_rollouts": "true",
}
# Two updates of two groups each, in batch order. A step large enough that the second update's
# ratios reach CISPO's upper clip; eps far above the gradients keeps Adam's first step linear in
# them, so fp32 noise in a near-zero gradient entry is not turned into a step of ~lr.
LR, EPS, WEIGHT_DECAY, CLIP_GRAD = 1e-2, 1e-2, 0.1, 1.0
TWO_UPDATES = {
    "actor.ppo_mini_batch_size": 2,
    "actor.shuffle": "false",
    "optim.lr": LR,
    "optim.adam_eps": EPS,
    "optim.weight_decay": WEIGHT_DECAY,
    "optim.clip_grad": CLIP_GRAD,
    "optim.lr_warmup_steps": 0,
}
CLIP_HIGH = 0.28  # the schema's default clip_ratio_high
RUNS = {
    "cispo": {
        "algorithm.clip_ratio_low": "1.0",
        "algorithm.adv_estimator": "reinforce_plus_plus_baseline",
        **TWO_UPDATES,
    },
    "gpg": {"algorithm.adv_estimator": "rloo", **TWO_UPDATES},
}
CLIP_LOW = {"cispo": 1.0, "gpg": 0.2}  # gpg's is the default, which only the GPG-as-CISPO slip reads


def _two_updates_by_hand(hf_dir, rows: list[dict], adv: list[float], loss: str) -> dict:
    """The step of a two-mini-batch run of ``loss`` (cispo or gpg) in float64, as the module
    docstring says: the metrics it reports, the same step's ``pg_loss`` under the other loss, and
    the second update's largest ratio."""
    policy = Float64Policy(hf_dir)
    samples = token_ids(hf_dir, rows)
    groups = list(dict.fromkeys(r["group_id"] for r in rows))
    minis = [[i for i, r in enumerate(rows) if r["group_id"] in groups[k : k + 2]] for k in (0, 2)]

    def terms(lp: torch.Tensor, old: torch.Tensor, a: float, kind: str) -> torch.Tensor:
        if kind == "gpg":  # -A log pi
            return -a * lp
        # cispo: -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi
        weight = torch.exp(lp.detach() - old).clamp(1 - CLIP_LOW[loss], 1 + CLIP_HIGH)
        return -weight * a * lp

    def mini_batch(indices: list[int], old: dict | None) -> dict:
        """The token-mean loss (its gradient left in .grad) and the other loss's value, against
        ``old`` as pi_old (the current policy when None)."""
        n = sum(len(samples[i][1]) for i in indices)
        lps = dict(zip(indices, policy.logprobs([samples[i] for i in indices])))
        olds = {i: lps[i].detach() if old is None else old[i] for i in indices}
        value = sum(terms(lps[i], olds[i], adv[i], loss).sum() for i in indices) / n
        value.backward()
        other = "gpg" if loss == "cispo" else "cispo"
        other_value = sum(float(terms(lps[i].detach(), olds[i], adv[i], other).sum()) for i in indices) / n
        log_ratio = torch.cat([lps[i].detach() - olds[i] for i in indices])
        return dict(
            loss=float(value.detach()), other=other_value, norm=policy.grad_norm(), log_ratio=log_ratio
        )

    first = mini_batch(minis[0], None)
    with torch.no_grad():  # pi_old, recomputed before the first update
        pi_old = dict(zip(minis[1], policy.logprobs([samples[i] for i in minis[1]])))
    policy.first_adamw_step(lr=LR, eps=EPS, weight_decay=WEIGHT_DECAY, clip_grad=CLIP_GRAD)
    second = mini_batch(minis[1], pi_old)
    tokens = sum(r["length"] for r in rows)
    return dict(
        pg_loss=(first["loss"] + second["loss"]) / 2,
        other_pg_loss=(first["other"] + second["other"]) / 2,
        grad_norm=(first["norm"] + second["norm"]) / 2,
        ppo_kl=float(-second["log_ratio"].sum()) / tokens,  # token-weighted over both updates
        max_ratio=float(second["log_ratio"].exp().max()),
    )


@pytest.mark.parametrize("loss", RUNS)
def test_each_policy_loss_trains_end_to_end(assets, tmp_path, loss):
    over = {**DAPO_ON, **CHEAPEST, "algorithm.policy_loss": loss, **RUNS[loss]}
    cfg = load_for_cli(str(REPO / "configs/demo.yaml"), train_overrides(assets, tmp_path, loss, 1, **over))
    run = Path(run_train(cfg)["run_dir"])
    (record,) = read_metrics(run)
    assert record["step"] == 1 and record["actor/num_updates"] == 2
    pg = record["actor/pg_loss"]
    assert math.isfinite(pg) and 0 < record["actor/grad_norm"] < math.inf

    rows = read_rollouts(run, 1)
    assert record["actor/tokens"] == sum(r["length"] for r in rows)
    adv = outcome_advantages(rows, RUNS[loss]["algorithm.adv_estimator"])
    assert "actor/entropy_loss" not in record
    want = _two_updates_by_hand(assets.hf_dir, rows, adv, loss)
    # The run lands within ~1e-7 of the reference (pg_loss, absolute: a small difference of
    # opposite-signed terms), within ~1e-6 (grad_norm) and ~1e-5 (ppo_kl) relative.
    tol = 2e-6
    assert abs(want["other_pg_loss"] - want["pg_loss"]) > 100 * tol, "the other loss is not told apart"
    if loss == "cispo":
        assert want["max_ratio"] > 1 + CLIP_HIGH, "the clip must bind on some token of the second update"
    assert pg == pytest.approx(want["pg_loss"], abs=tol), f"{loss}: pg_loss {pg}, by hand {want}"
    assert record["actor/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert record["actor/ppo_kl"] == pytest.approx(want["ppo_kl"], rel=1e-4)
