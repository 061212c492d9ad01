"""Context parallelism combined with tensor and pipeline parallelism, on CPU (4 gloo ranks, the
CPU stand-in for TE's CP attention).

One launch of 4 ranks trains one DAPO step of the ragged batch of ``test_actor_layouts`` in
each layout on packed micro-batches (every sample cut into 2 * CP chunks on its own) and compares
it with the same step at CP=1 on right-padded micro-batches (TP=PP=1, DP=4; DP is checked
against DP=1 by test_actor_layouts):
- CP=2 x TP=2 (token-mean with TIS): four micro-batches;
- CP=2 x PP=2 (seq-mean-token-mean with a geometric TIS rollout correction, whose per-row sums
  over CP run on the last pipeline stage only);
- CP=2 x TP=2 with GSPO and an entropy bonus (seq-mean-token-mean): GSPO's sequence ratio sums
  each row's log-ratio over the CP ranks; a row is never split across micro-batches.
Loss and grad norm within 1e-6 relative, every weight within 1e-6 of its scale.

Sequence parallelism with CP is not run here: megatron-core 0.16.1's local spec refuses it
("sequence parallel not supported by torch LayerNorm"); it needs TE (the GPU path).
"""

from __future__ import annotations

import pytest
from helpers import as_bytes, from_bytes, hf_state
from layout_harness import BIG, SMALL, close, layout_actor

from megatron_dapo.actor.spawn import run_ranks
from megatron_dapo.algo import RolloutCorrection

GEOMETRIC = RolloutCorrection(mode="tis", level="geometric", threshold=1.03)
MODES = {
    "token": dict(mode="token-mean"),
    "seq": dict(mode="seq-mean-token-mean", tis_cap=None, rollout_correction=GEOMETRIC),
    "gspo": dict(mode="seq-mean-token-mean", policy_loss="gspo", entropy_coeff=0.3),
}
# (name, tp, pp, cp, mode, token budget)
LAYOUTS = [
    ("ref-token", 1, 1, 1, "token", BIG),
    ("ref-seq", 1, 1, 1, "seq", BIG),
    ("cp2-tp2", 2, 1, 2, "token", SMALL),
    ("cp2-pp2", 1, 2, 2, "seq", SMALL),
    ("ref-gspo", 1, 1, 1, "gspo", BIG),
    ("cp2-tp2-gspo", 2, 1, 2, "gspo", SMALL),
]


def _rank_run(rank, world, hf_dir, batch, old):
    from megatron_dapo.actor.parallel import init_parallel

    out = {}
    for name, tp, pp, cp, mode, budget in LAYOUTS:
        layout = init_parallel(tp=tp, pp=pp, cp=cp)
        assert (layout.tp_size, layout.pp_size, layout.cp_size) == (tp, pp, cp)
        actor = layout_actor(hf_dir, budget, **MODES[mode], pack_sequences=not name.startswith("ref"))
        metrics = actor.update(batch.with_old_logprobs(old.float()))
        out[name] = dict(metrics=metrics, state=hf_state(actor))
    return as_bytes(out)


@pytest.fixture(scope="module")
def results(layout_hf_dir, layout_data):
    batch, old, _ = layout_data
    ranks = run_ranks(_rank_run, 4, layout_hf_dir, batch, old, timeout_s=600)
    return [from_bytes(r) for r in ranks]


@pytest.mark.parametrize(
    "name,ref", [("cp2-tp2", "ref-token"), ("cp2-pp2", "ref-seq"), ("cp2-tp2-gspo", "ref-gspo")]
)
def test_cp_with_tp_or_pp_equals_cp1(results, name, ref):
    want, got = results[0][ref], results[0][name]
    ref_u, got_u = want["metrics"]["updates"][0], got["metrics"]["updates"][0]
    assert ref_u["updated"] and got_u["updated"]
    assert close(got_u["loss"], ref_u["loss"]), (got_u["loss"], ref_u["loss"])
    assert close(got_u["grad_norm"], ref_u["grad_norm"]), (got_u["grad_norm"], ref_u["grad_norm"])
    assert got_u["tokens"] == ref_u["tokens"] and got_u["seqs"] == ref_u["seqs"]
    for key in ("clipfrac", "ppo_kl", "entropy"):
        assert close(got_u[key], ref_u[key], 1e-5), (key, got_u[key], ref_u[key])
    if name == "cp2-tp2-gspo":
        assert close(got_u["entropy_loss"], ref_u["entropy_loss"]), (
            got_u["entropy_loss"],
            ref_u["entropy_loss"],
        )
        assert got_u["clipfrac"] > 0  # the sequence ratio clips: a wrong per-row sum shows
    if name == "cp2-pp2":
        assert 0 < got_u["rc_fraction"] < 1 and close(got_u["rc_fraction"], ref_u["rc_fraction"])
    assert got["state"].keys() == want["state"].keys()
    for key, w in want["state"].items():
        diff = (got["state"][key] - w).abs().max()
        assert diff <= 1e-6 * w.abs().max(), (key, float(diff))
