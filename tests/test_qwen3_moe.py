"""Qwen3-MoE (8 experts, top-2, 2 layers, q/k norms, head_dim 24) built in megatron-core from the
HF config on CPU: logits equal transformers' Qwen3MoeForCausalLM (1e-5, fp32) and the weight-sync
buckets equal HF's state dict bit for bit (per-expert names), at DP2, PP2, EP2 and TP2 (experts
split over TP as megatron's expert tensor parallel = TP, sequence parallel on), with and without
renormalised top-k probabilities; HF -> Megatron dist checkpoint -> HF bit-exact at PP2, TP2 and
EP2 x TP2 (4 ranks), whose logits verify-model checks at the checkpoint's layout."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_forward_reference, hf_state_dict, random_hf_model, tiny_hf_config

from megatron_dapo.actor.model import transformer_config_from_hf
from megatron_dapo.actor.spawn import run_ranks
from megatron_dapo.arch import ModelConfigError, arch_spec

MODELS = ("norm-topk", "tied-raw-topk")  # untied with norm_topk_prob; tied without
LAYOUTS = [(1, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 1)]  # (tp, pp, ep) on 2 ranks; tp=pp=1 is DP 2
BATCH, SEQ = 2, 12


def _ids(vocab):
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def _checkpoint(path, seed, norm_topk, tied):
    """A tiny random Qwen3-MoE checkpoint; random norms and router too, so a swapped expert or a
    wrong top-k normalisation shows in the logits."""

    config = tiny_hf_config("qwen3_moe", tie_word_embeddings=tied, num_layers=2)
    config.norm_topk_prob = norm_topk
    model = random_hf_model(config, seed)
    model.save_pretrained(str(path))
    return path


def _rank_run(rank, world, model_dirs):
    from megatron_dapo.actor.model import build_gpt_model, forward_logits
    from megatron_dapo.actor.parallel import init_parallel
    from megatron_dapo.arch import load_hf_config
    from megatron_dapo.weights.gather import iter_hf_buckets
    from megatron_dapo.weights.load import load_hf_weights

    out = {}
    for name, hf_dir in model_dirs.items():
        config = load_hf_config(hf_dir)
        for tp, pp, ep in LAYOUTS:
            init_parallel(tp=tp, pp=pp, ep=ep)
            chunks = build_gpt_model(config, perform_initialization=False)
            load_hf_weights(chunks, hf_dir)
            logits = forward_logits(chunks, _ids(config.vocab_size))
            state = {}
            for bucket in iter_hf_buckets(chunks, bucket_bytes=32 << 10):
                if bucket is not None:
                    state.update(bucket)
            # At EP=2 both ranks hold buckets (one per data-parallel replica), each with all experts.
            out[(name, tp, pp, ep)] = dict(logits=logits, state=state if rank == 0 or ep > 1 else None)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_moe")
    return {
        "norm-topk": _checkpoint(root / "a", 31, norm_topk=True, tied=False),
        "tied-raw-topk": _checkpoint(root / "b", 32, norm_topk=False, tied=True),
    }


@pytest.fixture(scope="module")
def runs(checkpoints):
    return run_ranks(_rank_run, 2, {k: str(v) for k, v in checkpoints.items()}, timeout_s=900)


@pytest.fixture(scope="module")
def hf_reference(checkpoints):
    return hf_forward_reference(checkpoints, _ids)


CASES = [(m, *layout) for m in MODELS for layout in LAYOUTS]


@pytest.mark.slow
@pytest.mark.parametrize("model,tp,pp,ep", CASES)
def test_moe_logits_match_hf(runs, hf_reference, model, tp, pp, ep):
    ref = hf_reference[model]["logits"]
    got = [r[(model, tp, pp, ep)]["logits"] for r in runs if r[(model, tp, pp, ep)]["logits"] is not None]
    assert len(got) == 2 // pp  # the last stage of each replica (both TP ranks return logits)
    for g in got:
        diff = (g - ref).abs().max().item()
        assert diff < 1e-5, f"max |logit diff| {diff:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("model,tp,pp,ep", CASES)
def test_moe_sync_buckets_equal_hf_state_dict(runs, hf_reference, model, tp, pp, ep):
    ref = hf_reference[model]["state"]
    states = [r[(model, tp, pp, ep)]["state"] for r in runs if r[(model, tp, pp, ep)]["state"] is not None]
    assert len(states) == (2 if ep > 1 else 1)
    for state in states:
        assert sorted(state) == sorted(ref)
        assert "model.layers.1.mlp.experts.7.down_proj.weight" in state
        for key, tensor in ref.items():
            assert state[key].dtype == tensor.dtype and torch.equal(state[key], tensor), key


def test_moe_expected_shapes_equal_hfs(checkpoints):
    from megatron_dapo.arch import load_hf_config
    from megatron_dapo.weights.plan import expected_hf_shapes

    for path in checkpoints.values():
        state = hf_state_dict(path)
        assert expected_hf_shapes(load_hf_config(path)) == {k: tuple(v.shape) for k, v in state.items()}


def test_moe_config_fields_and_refusals():
    hf = tiny_hf_config("qwen3_moe")
    spec = arch_spec(hf)
    assert (spec.num_experts, spec.moe_topk, spec.moe_ffn_hidden_size, spec.norm_topk_prob) == (
        8,
        2,
        32,
        True,
    )
    cfg = transformer_config_from_hf(hf)
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (8, 2, 32)
    assert not cfg.moe_router_pre_softmax and cfg.qk_layernorm and cfg.kv_channels == 24
    # TP for MoE: experts split over TP too (megatron-core's default expert_tensor_parallel_size),
    # and sequence parallel on, without which megatron's MoE layer refuses to train.
    tp2 = transformer_config_from_hf(hf, tp=2)
    assert (tp2.expert_tensor_parallel_size, tp2.sequence_parallel) == (2, True)
    assert transformer_config_from_hf(hf).expert_tensor_parallel_size == 1
    hf.mlp_only_layers = [0]
    with pytest.raises(ModelConfigError, match="mlp_only_layers=\\[0\\]"):
        arch_spec(hf)


def test_moe_aux_loss_coefficient_defaults_to_hfs_only_when_hf_trains_with_it():
    """HF's Qwen3-MoE adds router_aux_loss_coef x its load-balancing loss only when
    output_router_logits is true; the actor's default follows it. A dense model refuses one."""
    from types import SimpleNamespace

    from megatron_dapo.actor.actor import _moe_aux_loss_coeff

    hf = tiny_hf_config("qwen3_moe")
    hf.router_aux_loss_coef = 0.001
    moe = SimpleNamespace(num_moe_experts=8)
    hf.output_router_logits = False
    assert arch_spec(hf).router_aux_loss_coef == 0.0 and _moe_aux_loss_coeff(None, moe, hf) == 0.0
    hf.output_router_logits = True
    assert arch_spec(hf).router_aux_loss_coef == 0.001 and _moe_aux_loss_coeff(None, moe, hf) == 0.001
    assert _moe_aux_loss_coeff(0.02, moe, hf) == 0.02  # the actor's knob wins
    dense = SimpleNamespace(num_moe_experts=None)
    assert _moe_aux_loss_coeff(None, dense, tiny_hf_config("qwen3")) is None  # nothing computed
    with pytest.raises(ValueError, match="moe_aux_loss_coeff=0.1 is for MoE models"):
        _moe_aux_loss_coeff(0.1, dense, tiny_hf_config("qwen3"))
    # activation recomputation: refused with a coefficient, not measured without one
    recompute = SimpleNamespace(num_moe_experts=8, recompute_granularity="full")
    with pytest.raises(ValueError, match="set model.recompute=false or actor.moe_aux_loss_coeff=0"):
        _moe_aux_loss_coeff(0.02, recompute, hf)
    assert _moe_aux_loss_coeff(0.0, recompute, hf) is None


@pytest.mark.slow
# TP2's logits are checked by test_moe_logits_match_hf (same loader): no verify-model launch there.
@pytest.mark.parametrize(
    "tp,pp,ep,verify", [(1, 2, 1, True), (2, 1, 1, False), (2, 1, 2, True)], ids=["pp2", "tp2", "ep2xtp2"]
)
def test_moe_converts_hf_to_megatron_to_hf_bit_exact_and_verify_model(
    tiny_hf_checkpoint, tmp_path, capsys, tp, pp, ep, verify
):
    from megatron_dapo.cli import main as cli
    from megatron_dapo.convert import hf_to_megatron, megatron_to_hf
    from megatron_dapo.weights.dist_ckpt import read_layout

    src = tiny_hf_checkpoint(family="qwen3_moe", num_layers=4, seed=33)
    meg, back = tmp_path / "meg", tmp_path / "hf_back"
    hf_to_megatron(src, meg, tp=tp, pp=pp, ep=ep, progress=False)
    layout = read_layout(meg)
    assert (layout["tp"], layout["pp"], layout["ep"]) == (tp, pp, ep)
    megatron_to_hf(meg, back, progress=False)
    a, b = hf_state_dict(src), hf_state_dict(back)
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    if not verify:
        return
    # Logits of the dist checkpoint loaded at its own layout (EP2 x TP2: 4 ranks, all-to-all).
    layout_args = ["--tp", str(tp), "--pp", str(pp), "--ep", str(ep)]
    assert (
        cli(
            ["verify-model", "--hf-dir", str(src), "--megatron-dir", str(meg), "--atol", "1e-5", *layout_args]
        )
        == 0
    )
    assert f"Megatron(tp={tp}, pp={pp}, ep={ep}," in capsys.readouterr().out
