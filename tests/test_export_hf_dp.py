"""export_hf with data parallelism (DP=2 on two CPU ranks): only the first replica gathers and
writes (before, every replica gathered the whole model and the others wrote it to a scratch
directory), and what it writes is the HF checkpoint it was built from, bit for bit (fp32)."""

from __future__ import annotations

import torch

from megatron_dapo.actor.spawn import run_ranks

MODEL = dict(family="qwen2", tie_word_embeddings=False, num_layers=2, vocab=200, seed=4)


def _rank(rank, world, hf_dir, out_dir):
    from megatron_dapo.actor.model import build_gpt_model
    from megatron_dapo.actor.parallel import init_parallel
    from megatron_dapo.weights import save_hf
    from megatron_dapo.weights.load import load_hf_weights

    init_parallel(tp=1, pp=1)
    chunks = build_gpt_model(hf_dir)
    load_hf_weights(chunks, hf_dir)
    calls = []
    real = save_hf.iter_hf_buckets

    def counted(*a, **k):
        calls.append(1)
        yield from real(*a, **k)

    save_hf.iter_hf_buckets = counted
    result = save_hf.export_hf_checkpoint(chunks, out_dir, hf_metadata_dir=hf_dir)
    return dict(gathers=len(calls), result=result)


def test_only_the_first_dp_replica_gathers_and_writes(tiny_hf_checkpoint, tmp_path):
    from helpers import hf_state_dict

    hf_dir = tiny_hf_checkpoint(**MODEL)
    out = tmp_path / "export"
    r0, r1 = run_ranks(_rank, 2, str(hf_dir), str(out), timeout_s=600)
    assert r0 == dict(gathers=1, result=str(out))
    assert r1 == dict(gathers=0, result=None)
    assert not [p for p in tmp_path.iterdir() if p.name != "export"]  # no scratch copies
    src, got = hf_state_dict(hf_dir), hf_state_dict(out)
    assert sorted(src) == sorted(got)
    for name, tensor in src.items():
        assert torch.equal(tensor, got[name]), name
