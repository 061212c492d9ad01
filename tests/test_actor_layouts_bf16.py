"""One DAPO step in bf16 (megatron-core's Float16Optimizer, fp32 master weights) at TP=1, TP=2
and PP=2 (two gloo processes), on the batch and settings of tests/test_actor_layouts.py.

Tolerances, from bf16's 8 significant bits (relative rounding up to 2^-9 per operation, one ulp
2^-8):
- Layouts differ only in summation order: TP=2 sums each row-parallel matmul (attention output,
  MLP down-projection; hidden 64, ffn 128) as two bf16 partial sums added after the all-reduce,
  PP=2 does not change the arithmetic but moves activations between processes. These K-term dot
  products dominate: each output element carries one extra bf16 rounding (2^-9 relative) per
  row-parallel layer, 2 per layer x 2 layers = 4 roundings on the final hidden state, which reach
  the log-probs through the logits (cross-entropy itself runs in fp32). The loss is a token mean
  of ratio * advantage terms, so its relative error is bounded by ~4 * 2^-9 ~ 8e-3 per token;
  errors of opposite sign cancel in the mean, so 2^-6 (1.6e-2) relative is a bound with margin,
  and the same for the grad norm (the backward repeats the same row-parallel sums).
- Updated weights: Adam (eps=1e-2, above the clipped gradients) steps ~lr * g / eps, so a
  relative gradient difference of 2^-6 moves the fp32 master by at most lr * 2^-6 per coordinate;
  the bf16 copy of that master can then round to a neighbouring value: one ulp, which is between
  2^-8 and 2^-7 of |w| (8 significant bits; 2^-7 just above a power of two). The bound is
  lr * 2^-6 + 2^-7 * max|w| per tensor (measured: the embedding, max|w| ~0.6, differs by 3.4e-3
  between TP=1 and TP=2, one ulp of a weight in [0.25, 1); the bound is 4.8e-3).
- The bf16 step itself must differ from the fp32 step (the test would pass trivially if bf16
  were silently ignored) and stay within the same bounds of it (fp32 is the exact reference).
"""

from __future__ import annotations

import pytest
import torch
from helpers import as_bytes, from_bytes, hf_state
from layout_harness import BIG, layout_actor

from megatron_dapo.actor.spawn import run_ranks

LR = 1e-2
REL = 2.0**-6  # loss / grad norm, derived in the module docstring
ULP = 2.0**-7  # one bf16 ulp, relative, at most


def _rank_run(rank, world, hf_dir, batch, old, runs):
    from megatron_dapo.actor.parallel import init_parallel

    out = {}
    for tp, pp, dtype in runs:
        init_parallel(tp=tp, pp=pp)
        actor = layout_actor(hf_dir, BIG, "token-mean", params_dtype=dtype)
        dtypes = {str(p.dtype) for c in actor.model for p in c.parameters()}
        metrics = actor.update(batch.with_old_logprobs(old.float()))
        state = hf_state(actor)
        out[(tp, pp, str(dtype))] = dict(metrics=metrics, dtypes=dtypes, state=state if rank == 0 else None)
    return as_bytes(out)


@pytest.fixture(scope="module")
def results(layout_hf_dir, layout_data):
    hf_dir = layout_hf_dir
    batch, old, _ = layout_data
    solo = [(1, 1, torch.bfloat16), (1, 1, torch.float32)]
    pair = [(2, 1, torch.bfloat16), (1, 2, torch.bfloat16)]
    one = from_bytes(run_ranks(_rank_run, 1, hf_dir, batch, old, solo, timeout_s=600)[0])
    two = from_bytes(run_ranks(_rank_run, 2, hf_dir, batch, old, pair, timeout_s=600)[0])
    return {**one, **two}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b))


def _weight_gap(got: dict, ref: dict) -> dict[str, tuple[float, float]]:
    """Per tensor: (max |diff|, the bound lr * REL + one bf16 ulp of the tensor's largest weight)."""
    assert got.keys() == ref.keys()
    return {
        k: (float((got[k].float() - w.float()).abs().max()), LR * REL + ULP * float(w.float().abs().max()))
        for k, w in ref.items()
    }


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_bf16_step_is_layout_invariant_within_bf16_rounding(results, layout):
    ref, got = results[(1, 1, "torch.bfloat16")], results[(*layout, "torch.bfloat16")]
    assert ref["dtypes"] == got["dtypes"] == {"torch.bfloat16"}
    ref_u, got_u = ref["metrics"]["updates"][0], got["metrics"]["updates"][0]
    assert ref_u["updated"] and got_u["updated"]
    assert _rel(got_u["loss"], ref_u["loss"]) <= REL, (got_u["loss"], ref_u["loss"])
    assert _rel(got_u["grad_norm"], ref_u["grad_norm"]) <= REL, (got_u["grad_norm"], ref_u["grad_norm"])
    for name, (diff, bound) in _weight_gap(got["state"], ref["state"]).items():
        assert diff <= bound, (name, diff, bound)


@pytest.mark.slow
def test_bf16_step_is_bf16_and_close_to_fp32(results):
    bf, fp = results[(1, 1, "torch.bfloat16")], results[(1, 1, "torch.float32")]
    assert all(v.dtype == torch.bfloat16 for v in bf["state"].values())
    bf_u, fp_u = bf["metrics"]["updates"][0], fp["metrics"]["updates"][0]
    assert bf_u["loss"] != fp_u["loss"]  # bf16 really ran
    assert _rel(bf_u["loss"], fp_u["loss"]) <= REL, (bf_u["loss"], fp_u["loss"])
    assert _rel(bf_u["grad_norm"], fp_u["grad_norm"]) <= REL, (bf_u["grad_norm"], fp_u["grad_norm"])
    for name, (diff, bound) in _weight_gap(bf["state"], fp["state"]).items():
        assert diff <= bound, (name, diff, bound)
