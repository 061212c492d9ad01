"""The reference-policy KL through the whole stack (Ray, 2 Megatron ranks at TP=2, the HF engine,
the weight sync), as a loss term and as a reward penalty with the adaptive controller at once.
That a resume restores the controller's coefficient and builds the reference from the initial
weights, not from the checkpoint it resumes, is test_driver_e2e's SIGTERM-then-SIGKILL test (its
runs have this KL on, and must equal the uninterrupted run bit for bit).

The uninterrupted run's KL metrics are checked against a float64 reference built without the
trainer (tests/e2e_harness.py): step 1's update by hand from its dumped rollouts (at step 1 the
actor is the reference, so the KL terms have value and gradient 0 and every ratio is 1: the
gradient is the policy loss's, ``-sum_i A_i grad log pi_i / N``) on HF transformers' model of the
initial weights, then step 2's dumped responses scored by that model before (the reference) and
after (pi_old) the update: ``actor/kl_loss`` and ``actor/ref_kl`` are the token mean of k3,
``actor/reward_kl_penalty`` the mean over responses of each one's mean k1, and the controller's
coefficient follows Ziegler et al.'s rule by hand, the one after step 2 read from its checkpoint.
"""

from __future__ import annotations

import pytest
import torch
from e2e_harness import (
    DAPO_ON,
    Float64Policy,
    outcome_advantages,
    read_metrics,
    read_rollouts,
    token_ids,
    train_overrides,
    train_to_end,
)

STEPS = 2
# Adam's eps far above the gradients keeps its first step linear in them (no fp32 noise of a
# near-zero gradient entry turned into a step of ~lr, which the reference could not follow); the
# step is large enough that the KL at step 2 stands well above the fp32 path's noise.
LR, EPS, WEIGHT_DECAY, CLIP_GRAD = 1e-2, 1e-2, 0.1, 1.0
COEF, TARGET_KL, HORIZON = 0.05, 1e-6, 16
KL_ON = {
    **DAPO_ON,
    "trainer.val_before_train": "false",
    "trainer.test_freq": 0,
    "logging.plots_at_end": "false",
    "actor.use_kl_loss": "true",
    "actor.kl_loss_coef": 0.1,
    "actor.kl_loss_type": "low_var_kl",
    "algorithm.use_kl_in_reward": "true",
    "algorithm.kl_penalty": "kl",
    # adaptive, a horizon of one step's 16 responses: the coefficient moves by up to 20% a step
    "algorithm.kl_ctrl.type": "adaptive",
    "algorithm.kl_ctrl.kl_coef": COEF,
    "algorithm.kl_ctrl.target_kl": TARGET_KL,
    "algorithm.kl_ctrl.horizon": HORIZON,
    "trainer.resume": "auto",
    "rollout.dump_rollouts": "true",
    "optim.lr": LR,
    "optim.adam_eps": EPS,
    "optim.weight_decay": WEIGHT_DECAY,
    "optim.clip_grad": CLIP_GRAD,
    "optim.lr_warmup_steps": 0,
}


@pytest.fixture(scope="module")
def uninterrupted(assets, tmp_path_factory):
    runs = tmp_path_factory.mktemp("kl_runs")
    train_to_end(train_overrides(assets, runs, "kl", STEPS, **KL_ON))
    return runs / "kl"


def _kl_by_hand(hf_dir, run) -> dict:
    """Step 1's gradient norm and step 2's KL metrics in float64 (module docstring)."""
    policy = Float64Policy(hf_dir)
    rows = read_rollouts(run, 1)
    adv = outcome_advantages(rows, "grpo")
    first = token_ids(hf_dir, rows)
    tokens = sum(len(response) for _, response in first)
    (sum(-a * lp.sum() for a, lp in zip(adv, policy.logprobs(first))) / tokens).backward()
    first_grad_norm = policy.grad_norm()
    second = token_ids(hf_dir, read_rollouts(run, 2))
    with torch.no_grad():
        ref = policy.logprobs(second)  # the reference: the initial weights
        policy.first_adamw_step(lr=LR, eps=EPS, weight_decay=WEIGHT_DECAY, clip_grad=CLIP_GRAD)
        old = policy.logprobs(second)  # pi_old at step 2: the actor after step 1
    d = [o - r for o, r in zip(old, ref)]  # log pi - log pi_ref per token
    k3 = torch.cat([torch.exp(-x) + x - 1 for x in d])
    return dict(
        first_grad_norm=first_grad_norm,
        k3=float(k3.mean()),
        k1_per_response=sum(float(x.mean()) for x in d) / len(d),
        k1_per_token=float(torch.cat(d).mean()),
        k3_swapped=float(torch.cat([torch.exp(x) - x - 1 for x in d]).mean()),
    )


def _adaptive(coef: float, kl: float, responses: int) -> float:
    """The adaptive controller's next coefficient (Ziegler et al. 2019, section 2.2)."""
    error = min(max(kl / TARGET_KL - 1, -0.2), 0.2)
    return coef * (1 + error * responses / HORIZON)


def test_kl_metrics_and_the_controller(assets, uninterrupted):
    first, second = read_metrics(uninterrupted)
    assert [first["step"], second["step"]] == [1, 2]
    # step 1: the actor is the reference, so the KL is 0 in the loss and in the reward
    assert abs(first["actor/ref_kl"]) < 1e-6 and abs(first["actor/kl_loss"]) < 1e-6
    assert abs(first["actor/reward_kl_penalty"]) < 1e-6
    assert first["actor/reward_kl_penalty_coeff"] == COEF
    # KL 0 is below the target: the coefficient shrank by the clipped 20% (16 responses / 16)
    responses = [len(read_rollouts(uninterrupted, step)) for step in (1, 2)]
    assert responses == [16, 16]
    assert second["actor/reward_kl_penalty_coeff"] == pytest.approx(0.04, rel=1e-12)
    assert _adaptive(COEF, 0.0, responses[0]) == pytest.approx(0.04, rel=1e-12)

    want = _kl_by_hand(assets.hf_dir, uninterrupted)
    # the reference's step 1 is the run's (its gradient norm to ~1e-9), and step 2's KL metrics
    # land within ~4e-6 of it; 5e-5 keeps a margin while what a slip would report, from the same
    # float64 log-probs, falls outside
    rel = 5e-5
    assert first["actor/grad_norm"] == pytest.approx(want["first_grad_norm"], rel=1e-6)
    near_misses = {"k3 with pi and pi_ref swapped": (want["k3_swapped"], want["k3"])}
    near_misses["k1 as a token mean"] = (want["k1_per_token"], want["k1_per_response"])
    for name, (miss, right) in near_misses.items():
        assert abs(miss - right) > 10 * rel * right, f"{name} ({miss}) is not told apart from {right}"
    assert second["actor/kl_loss"] == pytest.approx(want["k3"], rel=rel)  # token-mean, one update
    assert second["actor/ref_kl"] == pytest.approx(want["k3"], rel=rel)
    assert second["actor/reward_kl_penalty"] == pytest.approx(want["k1_per_response"], rel=rel)
    # the coefficient after step 2 (the KL above the target: up by the clipped 20%), from the
    # controller state its checkpoint holds
    common = torch.load(uninterrupted / "checkpoints" / "step_00000002" / "common.pt", weights_only=False)
    after = common["trainer"]["trainer_state"]["kl_ctrl"]
    assert after["type"] == "adaptive"
    assert after["value"] == pytest.approx(_adaptive(0.04, want["k1_per_response"], responses[1]), rel=1e-12)
