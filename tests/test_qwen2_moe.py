"""Qwen2-MoE's shared expert (shared_expert + sigmoid shared_expert_gate) on a tiny random
Qwen2MoeForCausalLM (8 experts, top-2, 2 layers, q/k/v bias): built in megatron-core from the HF
config, its logits equal transformers' within 1e-5 (fp32), the weight-sync buckets equal the HF
state dict bit for bit (HF -> Megatron -> HF), at EP=1, EP=2 and TP=2, with and without renormalised
top-k probabilities."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_forward_reference, random_hf_model

from megatron_dapo.actor.spawn import run_ranks

SEQ = 12


def _ids(vocab):
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(7))


def _checkpoint(path, seed, norm_topk):
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        architectures=["Qwen2MoeForCausalLM"],
    )
    model = random_hf_model(config, seed)
    model.save_pretrained(str(path))
    return str(path)


LAYOUTS = [(1, 1), (1, 2), (2, 1)]  # (tp, ep) on 2 ranks; TP2 splits the shared expert and experts


def _rank_run(rank, world, model_dirs):
    from megatron_dapo.actor.model import build_gpt_model, forward_logits
    from megatron_dapo.actor.parallel import init_parallel
    from megatron_dapo.arch import load_hf_config
    from megatron_dapo.weights.gather import iter_hf_buckets
    from megatron_dapo.weights.load import load_hf_weights

    out = {}
    for name, hf_dir in model_dirs.items():
        config = load_hf_config(hf_dir)
        for tp, ep in LAYOUTS:
            init_parallel(tp=tp, pp=1, ep=ep)
            chunks = build_gpt_model(config, perform_initialization=False)
            load_hf_weights(chunks, hf_dir)
            logits = forward_logits(chunks, _ids(config.vocab_size))
            state = {}
            for bucket in iter_hf_buckets(chunks, bucket_bytes=32 << 10):
                if bucket is not None:
                    state.update(bucket)
            out[(name, tp, ep)] = dict(logits=logits, state=state if state else None)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen2_moe")
    return {"raw-topk": _checkpoint(root / "a", 51, False), "norm-topk": _checkpoint(root / "b", 52, True)}


@pytest.fixture(scope="module")
def runs(checkpoints):
    return run_ranks(_rank_run, 2, checkpoints, timeout_s=600)


@pytest.mark.parametrize("name", ["raw-topk", "norm-topk"])
@pytest.mark.parametrize("tp,ep", LAYOUTS, ids=["dp2", "ep2", "tp2"])
def test_qwen2_moe_logits_and_buckets_equal_hf(runs, checkpoints, name, tp, ep):
    ref = hf_forward_reference({name: checkpoints[name]}, _ids)[name]
    assert any(".mlp.shared_expert_gate.weight" in k for k in ref["state"])
    # one bucket holder per data-parallel replica (TP rank 0)
    assert sum(r[(name, tp, ep)]["state"] is not None for r in runs) == 2 // tp
    for r in runs:
        got = r[(name, tp, ep)]
        assert (got["logits"] - ref["logits"]).abs().max() <= 1e-5
        if got["state"] is None:
            continue
        assert got["state"].keys() == ref["state"].keys()
        for k, w in ref["state"].items():
            assert torch.equal(got["state"][k], w), k


def test_qwen2_moe_expected_shapes_equal_hfs(checkpoints):
    from helpers import hf_state_dict

    from megatron_dapo.arch import load_hf_config
    from megatron_dapo.weights.plan import expected_hf_names, expected_hf_shapes

    path = checkpoints["raw-topk"]
    state = hf_state_dict(path)
    shapes = expected_hf_shapes(load_hf_config(path))
    assert sorted(expected_hf_names(load_hf_config(path))) == sorted(state)
    assert shapes == {k: tuple(v.shape) for k, v in state.items()}
