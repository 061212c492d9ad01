"""Each policy loss other than vanilla through the whole stack once (Ray, 2 Megatron ranks at
TP=2, the HF engine, the weight sync): one step of the cheapest end-to-end run per loss, with
dynamic sampling on so every group carries a gradient.

The step is one mini-batch, so pi_old is the current policy and every ratio is exactly 1; the
losses that depend on the ratio only (gspo, sapo) then have a value computable from the dumped
rewards and lengths alone, which the run's ``actor/pg_loss`` must equal:
- gspo with seq-mean-token-mean: ``-mean_i A_i`` (its sequence ratio is 1);
- sapo: ``-sum_i A_i (4 / tau_i) sigmoid(0) len_i / N`` (tau_pos for A > 0, tau_neg otherwise),
  with an entropy bonus that is reported apart (``actor/entropy_loss``);
- cispo and gpg weigh ``log pi`` (not known from the dump): their loss is finite and differs
  from the ratio-1 value ``-sum_i A_i len_i / N``; they run with the rloo and
  reinforce_plus_plus_baseline advantages.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from e2e_harness import DAPO_ON, REPO, read_metrics, train_overrides

from megatron_dapo.driver.launch import load_for_cli, run_train

CHEAPEST = {
    "trainer.val_before_train": "false",
    "trainer.test_freq": 0,
    "trainer.save_freq": 0,
    "trainer.hf_export_at_end": "false",
    "logging.plots_at_end": "false",
    "rollout.dump_rollouts": "true",
}
RUNS = {
    "gspo": {"algorithm.loss_agg_mode": "seq-mean-token-mean"},
    "cispo": {"algorithm.clip_ratio_low": "1.0", "algorithm.adv_estimator": "reinforce_plus_plus_baseline"},
    "sapo": {"algorithm.tau_pos": "0.5", "algorithm.tau_neg": "2.0", "algorithm.entropy_coeff": "0.01"},
    "gpg": {"algorithm.adv_estimator": "rloo"},
}


def _advantages(rows: list[dict], estimator: str) -> list[float]:
    """verl's outcome advantages of the dumped responses, by hand."""
    groups: dict[int, list[float]] = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r["reward"])
    out = []
    for r in rows:
        g = groups[r["group_id"]]
        mean, n = sum(g) / len(g), len(g)
        if estimator == "grpo":
            std = math.sqrt(sum((x - mean) ** 2 for x in g) / (n - 1))
            out.append((r["reward"] - mean) / (std + 1e-6))
        elif estimator == "rloo":
            out.append(n / (n - 1) * (r["reward"] - mean))
        else:
            out.append(r["reward"] - mean)
    if estimator == "reinforce_plus_plus_baseline":  # whitened over the response tokens
        tokens = [a for a, r in zip(out, rows) for _ in range(r["length"])]
        m = sum(tokens) / len(tokens)
        v = sum((x - m) ** 2 for x in tokens) / (len(tokens) - 1)
        out = [(a - m) / math.sqrt(v + 1e-8) for a in out]
    return out


@pytest.mark.parametrize("loss", RUNS)
def test_each_policy_loss_trains_end_to_end(assets, tmp_path, loss):
    over = {**DAPO_ON, **CHEAPEST, "algorithm.policy_loss": loss, **RUNS[loss]}
    cfg = load_for_cli(str(REPO / "configs/demo.yaml"), train_overrides(assets, tmp_path, loss, 1, **over))
    run = Path(run_train(cfg)["run_dir"])
    (record,) = read_metrics(run)
    assert record["step"] == 1 and record["actor/num_updates"] == 1
    pg = record["actor/pg_loss"]
    assert math.isfinite(pg) and 0 < record["actor/grad_norm"] < math.inf
    assert record["actor/ppo_kl"] == 0.0  # one mini-batch: every ratio is 1

    rows = [json.loads(line) for line in (run / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    lengths = [r["length"] for r in rows]
    tokens = sum(lengths)
    assert record["actor/tokens"] == tokens
    adv = _advantages(rows, RUNS[loss].get("algorithm.adv_estimator", "grpo"))
    ratio_one = -sum(a * n for a, n in zip(adv, lengths)) / tokens
    if loss == "gspo":
        assert pg == pytest.approx(-sum(adv) / len(adv), abs=1e-5)
    elif loss == "sapo":
        gate = [2.0 / (0.5 if a > 0 else 2.0) for a in adv]  # 4 / tau * sigmoid(0)
        assert pg == pytest.approx(-sum(a * g * n for a, g, n in zip(adv, gate, lengths)) / tokens, abs=1e-5)
        # token-mean over the one mini-batch: the bonus's entropy is the reported mean entropy
        assert record["actor/entropy_loss"] == pytest.approx(record["actor/entropy"], rel=1e-5)
        assert record["actor/entropy"] > 0
    else:
        assert "actor/entropy_loss" not in record
        assert abs(pg - ratio_one) > 1e-3
