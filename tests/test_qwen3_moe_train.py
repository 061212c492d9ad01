"""One DAPO train step on a tiny Qwen3-MoE (8 experts, top-2, 2 layers) on CPU, through megatron's
alltoall token dispatcher (the one the train step's variable_seq_lengths needs), against an
independent reference: transformers' Qwen3MoeForCausalLM, the same DAPO loss (``algo.policy_loss``
on its log-probs, float64) plus 0.1 x the routers' load-balancing loss (transformers'
``load_balancing_loss_func`` per layer and sequence, weighted like the token-mean loss)
backpropagated, clipped to norm 1.0 and stepped with torch's AdamW (weight decay off for 1-D
parameters, as megatron's optimizer does). The same step at EP2, PP2, TP2, CP2, EP2 x TP2 and with
other micro-batching equals it; with coefficient 0 the step is the policy loss's alone.

Before the CPU stand-in in ``actor/compat.py`` (patch 7) the actor could not be built on CPU:
megatron-core 0.16's alltoall dispatcher creates a ``torch.cuda.Stream()``.
"""

from __future__ import annotations

import io

import pytest
import torch
from helpers import random_hf_model, tiny_hf_config

from megatron_dapo.actor.spawn import run_ranks

TEMPERATURE = 0.8
CLIP = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
TIS_CAP = 1.5
OPTIM = dict(lr=1e-2, weight_decay=0.1, clip_grad=1.0, lr_warmup_steps=0, adam_eps=1e-2)
P_LENS = [3, 5, 4, 6, 2, 5, 3, 4]
R_LENS = [6, 2, 8, 3, 5, 7, 1, 4]
LOSS_MASK = [True, True, True, False, True, True, True, True]
# tool answers inside two responses (multi-turn episodes): sample -> response positions the model
# read but did not sample, out of the policy loss, its normaliser and the aux loss's weights
ENV_TOKENS = {0: [2, 3], 5: [1, 2]}


def _with_env_tokens(batch):
    from dataclasses import replace

    sampled = batch.response_mask.clone()
    for i, gap in ENV_TOKENS.items():
        sampled[i, gap] = False
    return replace(batch, response_mask=batch.response_mask & sampled, sampled_mask=sampled)


# The routers' load-balancing loss in the objective, large enough to move the router visibly.
AUX_COEF = 0.1


def _checkpoint(path, num_layers=2):
    """Random weights at a scale where the router's choices vary from token to token."""

    config = tiny_hf_config("qwen3_moe", num_layers=num_layers)
    model = random_hf_model(config, 41)
    model.save_pretrained(str(path))
    return str(path)


def _token_logprobs(model, prompts, responses, with_aux=False):
    """Per-sequence forwards: response log-probs, and with ``with_aux`` each sequence's
    load-balancing loss: transformers' ``load_balancing_loss_func`` on one layer's router logits
    of the sequence, averaged over the layers (actor/moe_aux_loss.py's definition)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    out, aux = [], []
    for p, r in zip(prompts, responses):
        result = model(torch.tensor([p + r]), output_router_logits=with_aux)
        logits = result.logits[0, len(p) - 1 : len(p) - 1 + len(r)].double()
        out.append(
            torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        )
        if with_aux:
            cfg = model.config
            layers = [
                load_balancing_loss_func((g,), cfg.num_experts, cfg.num_experts_per_tok)
                for g in result.router_logits
            ]
            aux.append(sum(layers) / len(layers))
    return (out, aux) if with_aux else out


def _padded(rows, width):
    mat = torch.zeros(len(rows), width, dtype=torch.float64)
    for i, row in enumerate(rows):
        mat[i, : len(row)] = row
    return mat


def _make_inputs(hf_dir):
    """Prompts, responses, advantages, rollout and pi_old log-probs near the true ones (so clipping
    and TIS act)."""
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (k,), generator=gen).tolist() for k in P_LENS]
    responses = [torch.randint(0, 256, (k,), generator=gen).tolist() for k in R_LENS]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        true = _token_logprobs(model, prompts, responses)
    rollout = [(lp + 0.05 * torch.randn(lp.shape, generator=gen, dtype=torch.float64)) for lp in true]
    old = [lp + 0.25 * torch.randn(lp.shape, generator=gen, dtype=torch.float64) for lp in true]
    return dict(
        prompts=prompts,
        responses=responses,
        advantages=torch.randn(len(prompts), generator=gen),
        rollout=_padded(rollout, max(R_LENS)).float(),
        old=_padded(old, max(R_LENS)).float(),
    )


def _as_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _vpp_ep2_logprobs(deep, pack):
    """PP=2 x VPP=2 x EP=2 on the 4-layer model: the log-prob pass (megatron's forward-only
    interleaved schedule), the micro-batch count of this rank, and the refusal of the update on
    gloo (its interleaved 1F1B schedule is wrong there, see Actor.update)."""
    from megatron_dapo.actor.actor import ActorConfig, build_actor
    from megatron_dapo.actor.batch import make_actor_batch
    from megatron_dapo.actor.optimizer import OptimizerSettings
    from megatron_dapo.actor.parallel import init_parallel

    n = len(deep["prompts"])
    batch = make_actor_batch(
        deep["prompts"], deep["responses"], advantages=torch.ones(n), group_index=list(range(n))
    )
    init_parallel(tp=1, pp=2, vpp=2, ep=2)
    cfg = ActorConfig(
        ppo_mini_batch_size=n,
        micro_batch_max_tokens=VPP_BUDGET,
        temperature=TEMPERATURE,
        shuffle=False,
        moe_aux_loss_coeff=0.0,
        pack_sequences=pack,
        **CLIP,
    )
    actor = build_actor(deep["hf_dir"], cfg, OptimizerSettings(**OPTIM), total_updates=8)
    logprobs = actor.compute_logprobs(batch)
    micro_batches = len(actor._my_micro_batches(batch, list(range(n))))
    try:
        actor.update(batch.with_old_logprobs(logprobs))
        refused = None
    except ValueError as e:
        refused = str(e)
    return dict(logprobs=logprobs, micro_batches=micro_batches, refused=refused)


def _rank_run(rank, world, hf_dir, inputs, layouts, deep=None):
    from megatron_dapo.actor.actor import ActorConfig, build_actor
    from megatron_dapo.actor.batch import make_actor_batch
    from megatron_dapo.actor.optimizer import OptimizerSettings
    from megatron_dapo.actor.parallel import init_parallel
    from megatron_dapo.weights.gather import is_bucket_holder, iter_hf_buckets

    batch = make_actor_batch(
        inputs["prompts"],
        inputs["responses"],
        advantages=inputs["advantages"],
        group_index=[0, 0, 1, 1, 2, 2, 3, 3],
        rollout_logprobs=[row[:n].tolist() for row, n in zip(inputs["rollout"], R_LENS)],
        loss_mask=LOSS_MASK,
    )
    batch = _with_env_tokens(batch).with_old_logprobs(inputs["old"])
    out = {}
    for layout in layouts:
        if layout.get("vpp"):
            out[tuple(sorted(layout.items()))] = _vpp_ep2_logprobs(deep, layout.get("pack", True))
            continue
        budget = layout.get("budget", 10_000)
        init_parallel(**{k: v for k, v in layout.items() if k not in ("budget", "aux", "pack")})
        cfg = ActorConfig(
            ppo_mini_batch_size=4,
            micro_batch_max_tokens=budget,
            loss_agg_mode="token-mean",
            temperature=TEMPERATURE,
            tis_cap=TIS_CAP,
            shuffle=False,
            moe_aux_loss_coeff=layout.get("aux", AUX_COEF),
            pack_sequences=layout.get("pack", True),
            **CLIP,
        )
        actor = build_actor(hf_dir, cfg, OptimizerSettings(**OPTIM), total_updates=8)
        metrics = actor.update(batch)
        state = {}
        for bucket in iter_hf_buckets(actor.model):
            if bucket:
                state.update({k: v.clone() for k, v in bucket.items()})
        # Each data-parallel replica has a holder (TP and PP rank 0); at EP=2 keep every one.
        keep = is_bucket_holder() and (rank == 0 or layout.get("ep", 1) > 1)
        out[tuple(sorted(layout.items()))] = dict(metrics=metrics, state=state if keep else None)
    return _as_bytes(out)


def _results(hf_dir, inputs, world, layouts, deep=None):
    raws = run_ranks(_rank_run, world, hf_dir, inputs, layouts, deep, timeout_s=600)
    return [torch.load(io.BytesIO(raw), weights_only=False) for raw in raws]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("qwen3_moe_train") / "model")


@pytest.fixture(scope="module")
def inputs(hf_dir):
    return _make_inputs(hf_dir)


@pytest.fixture(scope="module")
def reference(hf_dir, inputs, tmp_path_factory):
    return _reference(hf_dir, inputs, tmp_path_factory, AUX_COEF)


@pytest.fixture(scope="module")
def reference_no_aux(hf_dir, inputs, tmp_path_factory):
    return _reference(hf_dir, inputs, tmp_path_factory, 0.0)


def _reference(hf_dir, inputs, tmp_path_factory, aux_coef):
    """The step done by hand on transformers' model: loss, grad norm before clipping, new weights.
    The objective is the DAPO loss plus ``aux_coef`` times the load-balancing loss: each
    sequence's, weighted like the token-mean policy loss (its loss tokens / all loss tokens)."""
    from helpers import hf_state_dict
    from transformers import AutoModelForCausalLM

    from megatron_dapo.actor.batch import make_actor_batch
    from megatron_dapo.algo import policy_loss

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).train()
    mask = _with_env_tokens(
        make_actor_batch(
            inputs["prompts"],
            inputs["responses"],
            advantages=inputs["advantages"],
            group_index=[0, 0, 1, 1, 2, 2, 3, 3],
            loss_mask=LOSS_MASK,
        )
    ).response_mask
    token_lps, seq_aux = _token_logprobs(model, inputs["prompts"], inputs["responses"], with_aux=True)
    logprobs = _padded(token_lps, max(R_LENS))
    loss, _ = policy_loss(
        logprobs,
        inputs["old"].double(),
        inputs["advantages"].double(),
        mask,
        **CLIP,
        loss_agg_mode="token-mean",
        rollout_logprobs=inputs["rollout"].double(),
        tis_cap=TIS_CAP,
    )
    n = mask.sum(dim=1).double()
    aux = sum(w * a for w, a in zip(n / n.sum(), seq_aux))
    (loss + aux_coef * aux).backward()
    params = dict(model.named_parameters())
    grad_norm = torch.nn.utils.clip_grad_norm_(list(params.values()), OPTIM["clip_grad"])
    decay = [p for p in params.values() if p.dim() > 1]
    no_decay = [p for p in params.values() if p.dim() <= 1]
    optim = torch.optim.AdamW(
        [dict(params=decay, weight_decay=OPTIM["weight_decay"]), dict(params=no_decay, weight_decay=0.0)],
        lr=OPTIM["lr"],
        eps=OPTIM["adam_eps"],
        betas=(0.9, 0.999),
    )
    optim.step()
    # Saved and read back: the checkpoint's names are the per-expert ones the sync buckets carry.
    updated = tmp_path_factory.mktemp("qwen3_moe_reference")
    model.save_pretrained(str(updated))
    return dict(
        loss=float(loss.detach()), aux=float(aux), grad_norm=float(grad_norm), state=hf_state_dict(updated)
    )


@pytest.fixture(scope="module")
def ep1_runs(hf_dir, inputs):
    """One rank, with the load-balancing loss in the objective and with coefficient 0."""
    return _results(hf_dir, inputs, 1, [dict(tp=1, pp=1), dict(tp=1, pp=1, aux=0.0)])[0]


@pytest.fixture(scope="module")
def ep1(ep1_runs):
    return ep1_runs[(("pp", 1), ("tp", 1))]


EP2, PP2 = (("ep", 2), ("pp", 1), ("tp", 1)), (("ep", 1), ("pp", 2), ("tp", 1))
TP2 = (("ep", 1), ("pp", 1), ("tp", 2))
CP2 = (("cp", 2), ("pp", 1), ("tp", 1))
EP2_TP2 = (("ep", 2), ("pp", 1), ("tp", 2))
# A budget of 14 tokens packs the two data-parallel halves into 4 and 3 micro-batches.
EP2_UNEVEN = (("budget", 14), ("ep", 2), ("pp", 1), ("tp", 1))
EP2_PADDED = (("ep", 2), ("pack", False), ("pp", 1), ("tp", 1))


@pytest.fixture(scope="module")
def two_ranks(hf_dir, inputs):
    """EP=2 (the experts split over the two data-parallel ranks, tokens exchanged all-to-all over
    gloo) and PP=2, in one launch."""
    layouts = [
        dict(tp=1, pp=1, ep=2),
        dict(tp=1, pp=2, ep=1),
        dict(tp=1, pp=1, ep=2, budget=14),
        dict(tp=2, pp=1, ep=1),
        dict(tp=1, pp=1, cp=2),
        dict(tp=1, pp=1, ep=2, pack=False),
    ]
    return _results(hf_dir, inputs, 2, layouts)


# PP=2 x VPP=2 needs 4 equal stages: a 4-layer model. One 24-token sequence and twelve of 4
# tokens: balanced over DP=2, rank 0 gets the long one and three short ones, rank 1 nine short
# ones; at one fixed micro-batch shape within VPP_BUDGET tokens (the interleaved schedule's) that
# is 4 micro-batches of 1 x 24 against 2 of 6 x 4, and every EP rank must run as many forwards.
VPP_BUDGET = 24
VPP_EP2 = (("ep", 2), ("pp", 2), ("tp", 1), ("vpp", 2))
VPP_EP2_PADDED = (("ep", 2), ("pack", False), ("pp", 2), ("tp", 1), ("vpp", 2))


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    gen = torch.Generator().manual_seed(13)
    shape = [(12, 12)] + [(2, 2)] * 12
    return dict(
        hf_dir=_checkpoint(tmp_path_factory.mktemp("qwen3_moe_deep") / "model", num_layers=4),
        prompts=[torch.randint(0, 256, (p,), generator=gen).tolist() for p, _ in shape],
        responses=[torch.randint(0, 256, (r,), generator=gen).tolist() for _, r in shape],
    )


@pytest.fixture(scope="module")
def four_ranks(hf_dir, inputs, deep):
    """EP=2 x TP=2: experts split over EP and, within an EP rank, over TP (expert tensor parallel
    = TP), sequence parallel on, data parallel 2. Then, re-initialised in the same processes,
    PP=2 x VPP=2 x EP=2 (data parallel 2) on the 4-layer model, right-padded and packed."""
    layouts = [
        dict(tp=2, pp=1, ep=2),
        dict(tp=1, pp=2, vpp=2, ep=2, pack=False),
        dict(tp=1, pp=2, vpp=2, ep=2),
    ]
    return _results(hf_dir, inputs, 4, layouts, deep)


def _check_against_reference(got, reference):
    update = got["metrics"]["updates"][0]
    assert update["updated"]
    # the policy loss and the load-balancing loss are reported apart
    assert abs(update["loss"] - reference["loss"]) <= 1e-5 * max(1.0, abs(reference["loss"]))
    assert abs(update["moe_aux_loss"] - reference["aux"]) <= 1e-6 * reference["aux"]
    assert got["metrics"]["moe_aux_loss"] == update["moe_aux_loss"]
    assert abs(update["grad_norm"] - reference["grad_norm"]) <= 1e-5 * reference["grad_norm"]
    assert update["grad_norm"] > OPTIM["clip_grad"]  # clipping acts, so its scale is checked too
    assert got["state"].keys() == reference["state"].keys()
    for name, w in reference["state"].items():
        diff = (got["state"][name] - w).abs().max()
        assert diff <= 1e-5 * max(1.0, float(w.abs().max())), (name, float(diff))


def test_moe_train_step_ep1_equals_hf_reference(ep1, reference, hf_dir):
    from helpers import hf_state_dict

    _check_against_reference(ep1, reference)
    # the step moved every expert that saw tokens and the router
    initial = hf_state_dict(hf_dir)
    moved = [k for k in initial if not torch.equal(initial[k], ep1["state"][k])]
    assert any(".mlp.gate.weight" in k for k in moved)
    assert sum(".mlp.experts." in k for k in moved) >= 8


def test_moe_aux_loss_coefficient_zero_is_measured_not_trained(ep1_runs, reference, reference_no_aux):
    """With coefficient 0 the step equals the policy-loss-only HF step (no load-balancing gradient)
    and still reports the load-balancing loss; the two references differ in the routers, so the
    coefficient-0.1 step (checked above) got the loss's gradient into the router weights."""
    no_aux = ep1_runs[(("aux", 0.0), ("pp", 1), ("tp", 1))]
    _check_against_reference(no_aux, reference_no_aux)
    assert reference_no_aux["aux"] == reference["aux"]
    router = "model.layers.0.mlp.gate.weight"
    gap = (reference["state"][router] - reference_no_aux["state"][router]).abs().max()
    assert gap > 1e-3  # 100x the tolerance of _check_against_reference
    assert (no_aux["state"][router] - reference["state"][router]).abs().max() > 0.5 * gap


@pytest.mark.parametrize(
    "layout",
    [EP2, PP2, EP2_UNEVEN, TP2, CP2, EP2_PADDED],
    ids=["ep2", "pp2", "ep2-uneven-micro-batches", "tp2", "cp2", "ep2-padded"],
)
def test_moe_train_step_is_layout_invariant(two_ranks, ep1, reference, layout):
    """Packed micro-batches (the default) in every layout, right-padded ones at EP=2: each equals
    the one-rank step and the transformers reference."""
    ranks = [r[layout] for r in two_ranks]
    holders = [r for r in ranks if r["state"] is not None]
    # at EP=2 each replica gathers
    assert len(holders) == (2 if layout in (EP2, EP2_UNEVEN, EP2_PADDED) else 1)
    _check_layout(holders, ep1, reference)


def test_moe_train_step_ep2_x_tp2_equals_ep1(four_ranks, ep1, reference):
    ranks = [r[EP2_TP2] for r in four_ranks]
    holders = [r for r in ranks if r["state"] is not None]
    assert len(holders) == 2  # TP rank 0 of each data-parallel replica, each with all experts
    _check_layout(holders, ep1, reference)


def _check_layout(holders, ep1, reference):
    for got in holders:
        _check_against_reference(got, reference)
        ref_u, got_u = ep1["metrics"]["updates"][0], got["metrics"]["updates"][0]
        assert abs(got_u["loss"] - ref_u["loss"]) <= 1e-6 * abs(ref_u["loss"])
        assert abs(got_u["grad_norm"] - ref_u["grad_norm"]) <= 1e-6 * ref_u["grad_norm"]
        for name, w in ep1["state"].items():
            assert (got["state"][name] - w).abs().max() <= 1e-6 * w.abs().max(), name


def test_moe_vpp_x_ep2_log_probs_equal_hf_with_uneven_micro_batches(four_ranks, deep):
    """PP=2 x VPP=2 x EP=2 scores every response token as transformers' model does, although the
    two data-parallel ranks pack different right-padded micro-batch counts (the EP ranks then run the larger
    count: before, rank 1 left the all-to-all exchanges of the interleaved schedule early and
    rank 0 waited forever). The update under VPP is refused on CPU with a one-line error (a GPU
    check; megatron-core itself refuses no VPP x MoE combination)."""
    from transformers import AutoModelForCausalLM

    from megatron_dapo.actor.micro_batches import pack_fixed_shape, split_over_ranks

    lengths = [len(p) + len(r) for p, r in zip(deep["prompts"], deep["responses"])]
    parts = split_over_ranks(lengths, list(range(len(lengths))), 2)
    assert [len(pack_fixed_shape(lengths, p, VPP_BUDGET, 2)[0]) for p in parts] == [4, 2]
    model = AutoModelForCausalLM.from_pretrained(deep["hf_dir"], dtype=torch.float32).eval()
    with torch.no_grad():
        want = _padded(_token_logprobs(model, deep["prompts"], deep["responses"]), 12)
    for r in four_ranks:
        got = r[VPP_EP2_PADDED]
        assert got["micro_batches"] == 4
        assert (got["logprobs"].double() - want).abs().max() <= 1e-5
        assert "virtual pipeline stages (vpp) is not supported on the CPU/gloo path" in got["refused"]
        # packed (one row shape for every micro-batch, the budget counting real tokens): two
        # micro-batches on each rank, the same log-probs
        packed = r[VPP_EP2]
        assert packed["micro_batches"] == 2
        assert (packed["logprobs"].double() - want).abs().max() <= 1e-5
