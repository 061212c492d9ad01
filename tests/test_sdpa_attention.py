"""The local spec's core attention on torch's scaled_dot_product_attention (actor/sdpa_attention.py)
against megatron-core's unfused ``DotProductAttention`` (the local spec's attention before), fp32
on CPU, in one launch of 2 gloo ranks:
- the module: outputs and input gradients with GQA, causal and with an explicit mask; packed
  (THD) samples against megatron's module run on each sample alone;
- the model: logits at TP=1, TP=2 and PP=2 within 1e-5;
- the actor: one DAPO step at TP=2 (padded micro-batches, which megatron's module takes) equal in
  loss, grad norm and weights (1e-6 relative), and log-probs at CP=2 (the CPU context-parallel
  stand-in, packed) equal to megatron's module at CP=1 within 1e-5;
- megatron's module with packed micro-batches is refused naming actor.pack_sequences.
"""

from __future__ import annotations

import pytest
import torch
from helpers import as_bytes, from_bytes, hf_state
from layout_harness import BIG, CLIP, SMALL, TEMPERATURE, TIS_CAP, close

from megatron_dapo.actor.spawn import run_ranks

# packed samples of the module check: short ones attend in one padded call, ragged long ones
# per sample (sdpa_attention._one_padded_call)
LENGTHS = {"packed": [5, 11, 1, 7], "packed-ragged": [150, 3, 9]}


def _actor(hf_dir, attention, budget=BIG, pack=True):
    from megatron_dapo.actor.actor import ActorConfig, build_actor
    from megatron_dapo.actor.optimizer import OptimizerSettings

    cfg = ActorConfig(
        ppo_mini_batch_size=4,
        micro_batch_max_tokens=budget,
        temperature=TEMPERATURE,
        tis_cap=TIS_CAP,
        shuffle=False,
        pack_sequences=pack,
        **CLIP,
    )
    optim = OptimizerSettings(lr=1e-2, weight_decay=0.1, clip_grad=1.0, lr_warmup_steps=0, adam_eps=1e-2)
    return build_actor(hf_dir, cfg, optim, total_updates=8, model_kwargs=dict(local_attention=attention))


def _module_checks(hf_dir):
    """SDPAttention vs DotProductAttention on random inputs (4 heads, 2 KV groups)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dapo.actor.model import transformer_config_from_hf
    from megatron_dapo.actor.sdpa_attention import SDPAttention

    config = transformer_config_from_hf(hf_dir)
    ours = SDPAttention(config, 1, AttnMaskType.causal, "self")
    theirs = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    gen = torch.Generator().manual_seed(0)
    heads, groups, hn = config.num_attention_heads, config.num_query_groups, config.kv_channels
    s, b = 13, 3

    def inputs(*lead):
        q = torch.randn(*lead, heads, hn, generator=gen, requires_grad=True)
        k, v = (torch.randn(*lead, groups, hn, generator=gen, requires_grad=True) for _ in range(2))
        return q, k, v

    def run(module, q, k, v, mask=None, packed=None):
        for x in (q, k, v):
            x.grad = None
        out = module(q, k, v, mask, packed_seq_params=packed)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach(), [x.grad.clone() for x in (q, k, v)]

    out = {}
    q, k, v = inputs(s, b)
    out["causal"] = (run(ours, q, k, v), run(theirs, q, k, v))
    mask = torch.rand(b, 1, s, s, generator=gen) < 0.3  # True: not attended (megatron's convention)
    mask[..., torch.arange(s), torch.arange(s)] = False
    out["mask"] = (run(ours, q, k, v, mask), run(theirs, q, k, v, mask))
    for case, lengths in LENGTHS.items():
        q, k, v = inputs(sum(lengths))
        cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=max(lengths),
            max_seqlen_kv=max(lengths),
        )
        packed = run(ours, q, k, v, packed=params)
        # reference: megatron's module on each sample alone, the same upstream gradient
        ref_out, ref_grads = [], [torch.zeros_like(x) for x in (q, k, v)]
        weights = torch.linspace(-1, 1, packed[0].numel()).view_as(packed[0])
        for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):
            qs, ks, vs = (x.detach()[lo:hi].unsqueeze(1).requires_grad_() for x in (q, k, v))
            o = theirs(qs, ks, vs, None).squeeze(1)
            (o * weights[lo:hi]).sum().backward()
            ref_out.append(o.detach())
            for g, x in zip(ref_grads, (qs, ks, vs)):
                g[lo:hi] = x.grad.squeeze(1)
        out[case] = (packed, (torch.cat(ref_out), ref_grads))
    return out


def _rank_run(rank, world, hf_dir, batch, old):
    from megatron_dapo.actor.model import build_gpt_model, forward_logits
    from megatron_dapo.actor.parallel import init_parallel
    from megatron_dapo.weights.load import load_hf_weights

    out = {}
    init_parallel()
    out["module"] = _module_checks(hf_dir)
    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(7))
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        init_parallel(tp=tp, pp=pp)
        for attention in ("sdpa", "unfused"):
            chunks = build_gpt_model(hf_dir, perform_initialization=False, local_attention=attention)
            load_hf_weights(chunks, hf_dir)
            out[("logits", tp, pp, attention)] = forward_logits(chunks, ids)
    init_parallel(tp=2)
    for attention in ("sdpa", "unfused"):
        actor = _actor(hf_dir, attention, SMALL, pack=False)
        metrics = actor.update(batch.with_old_logprobs(old.float()))
        out[("step", attention)] = dict(metrics=metrics, state=hf_state(actor))
    try:
        _actor(hf_dir, "unfused")
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    init_parallel(cp=2)
    out[("cp", "sdpa")] = _actor(hf_dir, "sdpa", SMALL).compute_logprobs(batch, TEMPERATURE)
    init_parallel(cp=1)
    out[("cp", "unfused")] = _actor(hf_dir, "unfused", BIG, pack=False).compute_logprobs(batch, TEMPERATURE)
    return as_bytes(out)


@pytest.fixture(scope="module")
def results(layout_hf_dir, layout_data):
    batch, old, _ = layout_data
    return [from_bytes(r) for r in run_ranks(_rank_run, 2, layout_hf_dir, batch, old, timeout_s=900)]


def test_packed_samples_take_one_padded_call_only_when_it_is_cheaper():
    from megatron_dapo.actor.sdpa_attention import _one_padded_call

    assert _one_padded_call(LENGTHS["packed"]) and not _one_padded_call(LENGTHS["packed-ragged"])
    assert (
        _one_padded_call([40] * 64) and not _one_padded_call([1000]) and not _one_padded_call([256, 12] * 4)
    )


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: the packed path's kernel choice (torch's varlen flash
    kernel only for CUDA fp16/bf16) runs here without a GPU; the kernel itself is a stand-in."""

    @property
    def is_cuda(self):
        return True


def _packed_with_fixed_scale_varlen(monkeypatch, softmax_scale, head_dim=24, lengths=(3, 5, 2)):
    """SDPAttention's packed forward (bf16, GQA) where torch's varlen kernel has no ``scale``
    argument (torch 2.10: always 1/sqrt(head_dim)); returns (whether that kernel ran, output,
    per-sample SDPA at ``softmax_scale``)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_dapo.actor import sdpa_attention

    class _OneRank:
        def size(self):
            return 1

    calls = []

    def varlen(q, k, v, *args, **kwargs):
        calls.append(kwargs)
        return torch.zeros_like(q)

    monkeypatch.setattr(sdpa_attention, "_varlen_attn", lambda: (varlen, {"is_causal": True}, False, False))
    heads, groups = 4, 2
    config = TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        attention_dropout=0.0,
    )
    module = sdpa_attention.SDPAttention(
        config,
        1,
        AttnMaskType.causal,
        "self",
        softmax_scale=softmax_scale,
        pg_collection=sdpa_attention.ProcessGroupCollection(tp=_OneRank()),
    )
    gen = torch.Generator().manual_seed(0)
    t = sum(lengths)
    q, k, v = (
        torch.randn(t, n, head_dim, generator=gen).to(torch.bfloat16).as_subclass(_OnCuda)
        for n in (heads, groups, groups)
    )
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths))
    out = module(q, k, v, None, packed_seq_params=params).as_subclass(torch.Tensor)
    ref = []
    for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (x.as_subclass(torch.Tensor)[lo:hi].float().transpose(0, 1) for x in (q, k, v))
        ks, vs = (x.repeat_interleave(heads // groups, 0) for x in (ks, vs))
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=softmax_scale)
        ref.append(o.transpose(0, 1).reshape(hi - lo, heads * head_dim))
    return bool(calls), out.float(), torch.cat(ref)


@pytest.mark.parametrize("head_dim", [24, 80, 128])
def test_packed_varlen_takes_the_default_scale_up_to_float_rounding(monkeypatch, head_dim):
    import math

    # 1/sqrt(head_dim) computed in float32, as a config or checkpoint may carry it: not equal to
    # head_dim ** -0.5 in double for these head dims, the same scale for any kernel
    scale = float(torch.tensor(1 / math.sqrt(head_dim), dtype=torch.float32))
    assert scale != head_dim**-0.5
    used_varlen, _, _ = _packed_with_fixed_scale_varlen(monkeypatch, scale, head_dim=head_dim)
    assert used_varlen


def test_packed_varlen_is_passed_over_for_another_scale(monkeypatch):
    # a different scale (here twice the default) cannot go to a kernel fixed at 1/sqrt(head_dim):
    # the per-sample SDPA path computes it with that scale
    used_varlen, out, ref = _packed_with_fixed_scale_varlen(monkeypatch, 2 * 24**-0.5)
    assert not used_varlen
    assert (out - ref).abs().max() <= 2e-2, float((out - ref).abs().max())


@pytest.mark.parametrize("case", ["causal", "mask", "packed", "packed-ragged"])
def test_module_equals_megatron_dot_product_attention(results, case):
    (out, grads), (ref_out, ref_grads) = results[0]["module"][case]
    assert out.shape == ref_out.shape
    assert (out - ref_out).abs().max() <= 1e-5, float((out - ref_out).abs().max())
    for name, g, ref in zip("qkv", grads, ref_grads):
        assert (g - ref).abs().max() <= 1e-5, (name, float((g - ref).abs().max()))


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_logits_equal_unfused_attention(results, tp, pp):
    for rank in results:
        ours, theirs = rank[("logits", tp, pp, "sdpa")], rank[("logits", tp, pp, "unfused")]
        if theirs is None:  # not the last pipeline stage
            assert ours is None
            continue
        assert (ours - theirs).abs().max() <= 1e-5, float((ours - theirs).abs().max())


def test_dapo_step_equals_unfused_attention(results):
    ours, theirs = results[0][("step", "sdpa")], results[0][("step", "unfused")]
    got, ref = ours["metrics"]["updates"][0], theirs["metrics"]["updates"][0]
    assert got["updated"] and ref["updated"]
    assert close(got["loss"], ref["loss"]) and close(got["grad_norm"], ref["grad_norm"])
    for name, w in theirs["state"].items():
        assert (ours["state"][name] - w).abs().max() <= 1e-6 * w.abs().max(), name


def test_context_parallel_logprobs_equal_unfused_attention(results, layout_data):
    batch = layout_data[0]
    mask = torch.arange(batch.max_response_len)[None] < batch.response_lens[:, None]
    for rank in results:
        diff = (rank[("cp", "sdpa")] - rank[("cp", "unfused")]).abs()[mask].max()
        assert diff <= 1e-5, float(diff)


def test_unfused_attention_refuses_packed_micro_batches(results):
    assert "actor.pack_sequences" in results[0]["refused"]
