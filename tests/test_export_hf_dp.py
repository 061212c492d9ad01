"""export_hf with data parallelism (DP=2 on two CPU ranks): only the first replica gathers and
writes (before, every replica gathered the whole model and the others wrote it to a scratch
directory), and what it writes is the HF checkpoint it was built from, bit for bit (fp32). With
expert parallelism (a Qwen3-MoE at EP=2, the same two ranks) the second DP replica holds half the
experts and gathers too (before, rank 0 waited forever in the expert gather: the end-of-run
export of an EP run hung)."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.actor.spawn import run_ranks

MODEL = dict(family="qwen2", tie_word_embeddings=False, num_layers=2, vocab=200, seed=4)


def _export(hf_dir, out_dir, ep):
    from megatron_dapo.actor.model import build_gpt_model
    from megatron_dapo.actor.parallel import init_parallel
    from megatron_dapo.weights import save_hf
    from megatron_dapo.weights.load import load_hf_weights

    init_parallel(tp=1, pp=1, ep=ep)
    chunks = build_gpt_model(hf_dir)
    load_hf_weights(chunks, hf_dir)
    calls = []
    real = save_hf.iter_hf_buckets

    def counted(*a, **k):
        calls.append(1)
        yield from real(*a, **k)

    save_hf.iter_hf_buckets = counted
    try:
        result = save_hf.export_hf_checkpoint(chunks, out_dir, hf_metadata_dir=hf_dir)
    finally:
        save_hf.iter_hf_buckets = real
    return dict(gathers=len(calls), result=result)


def _rank(rank, world, dense_dir, dense_out, moe_dir, moe_out):
    return _export(dense_dir, dense_out, ep=1), _export(moe_dir, moe_out, ep=2)


def _assert_same_checkpoint(src_dir, out_dir):
    from helpers import hf_state_dict

    src, got = hf_state_dict(src_dir), hf_state_dict(out_dir)
    assert sorted(src) == sorted(got)
    for name, tensor in src.items():
        assert torch.equal(tensor, got[name]), name


@pytest.fixture(scope="module")
def exported(tiny_hf_checkpoint, tmp_path_factory):
    dense = tiny_hf_checkpoint(**MODEL)
    moe = tiny_hf_checkpoint(**{**MODEL, "family": "qwen3_moe"})
    root = tmp_path_factory.mktemp("export_dp")
    outs = root / "dense", root / "moe"
    ranks = run_ranks(_rank, 2, str(dense), str(outs[0]), str(moe), str(outs[1]), timeout_s=600)
    return dense, moe, root, outs, ranks


def test_only_the_first_dp_replica_gathers_and_writes(exported):
    dense, _, root, (out, _), ((r0, _), (r1, _)) = exported
    assert r0 == dict(gathers=1, result=str(out))
    assert r1 == dict(gathers=0, result=None)
    assert sorted(p.name for p in root.iterdir()) == ["dense", "moe"]  # no scratch copies
    _assert_same_checkpoint(dense, out)


def test_with_expert_parallelism_the_replicas_holding_experts_gather_too(exported):
    _, moe, _, (_, out), ((_, r0), (_, r1)) = exported
    assert r0 == dict(gathers=1, result=str(out))
    assert r1 == dict(gathers=1, result=None)  # its 4 of the 8 experts
    _assert_same_checkpoint(moe, out)
