"""Rollout routing replay on a tiny random Qwen3-MoE (8 experts, top-2, 2 layers) whose trainer
weights differ from the engine's in the routers, so the two route some tokens differently.

- The HF engine's recorded experts equal the top-k of an independent full (no-cache) forward of
  the engine's model, on every prompt and generated token whose top-k is not a float near-tie.
- With ``routing_replay: rollout`` the actor's routers choose exactly the recorded experts on every
  token, in the log-prob pass and in the training forward, at EP=1 and EP=2, and its log-probs
  equal an HF forward of the trainer's weights forced to those experts (a reference written here);
  with replay off the routers choose otherwise on some tokens and the log-probs are the unforced
  HF ones.
- Packed micro-batches give the right-padded ones' log-probs, metrics and updated weights within
  1e-6, the tolerance of the other layout tests.
- Replaying the trainer's own choice gives bitwise the no-replay log-probs.
"""

from __future__ import annotations

import pytest
import torch
from helpers import hf_state, random_hf_model, tiny_hf_config

from megatron_dapo.actor.spawn import run_ranks

TEMPERATURE = 0.9
PROMPTS = [[5, 17, 88, 3], [200, 9, 41], [7, 7, 120, 33, 64, 1], [99, 150]]
NEW_TOKENS = 6


def _random_moe(seed):

    config = tiny_hf_config("qwen3_moe", num_layers=2)
    model = random_hf_model(config, seed)
    return model.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The engine's model and the trainer's checkpoint: the same weights but the routers moved."""
    root = tmp_path_factory.mktemp("routing_replay")
    engine_model = _random_moe(43)
    engine_model.save_pretrained(str(root / "engine"))
    trainer = _random_moe(43)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    trainer.save_pretrained(str(root / "trainer"))
    return engine_model, str(root / "trainer")


@pytest.fixture(scope="module")
def rollout(models):
    from megatron_dapo.rollout.hf_engine import HFEngine
    from megatron_dapo.rollout.types import GenerationRequest, SamplingParams

    engine = HFEngine(model=models[0], record_routing=True)
    reqs = [
        GenerationRequest(
            f"r{i}",
            p,
            SamplingParams(temperature=TEMPERATURE, max_new_tokens=NEW_TOKENS, seed=i, ignore_eos=True),
        )
        for i, p in enumerate(PROMPTS)
    ]
    return engine.generate(reqs)


def _forced_router(forced, own=None):
    """Qwen3MoeTopKRouter.forward with its top-k replaced by ``forced[layer]`` ([tokens, k]); the
    weights are the softmax's at those experts, renormalised as norm_topk_prob asks."""

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        if own is not None:
            own.append(logits.topk(self.top_k, dim=-1).indices)
        idx = forced[self.layer_idx].long()
        top = probs.gather(1, idx)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), idx

    return forward


def _hf_logprobs(model, ids, prompt_len, forced=None, own=None):
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    original = m.Qwen3MoeTopKRouter.forward
    if forced is not None:
        for i, layer in enumerate(model.model.layers):
            layer.mlp.gate.layer_idx = i
        m.Qwen3MoeTopKRouter.forward = _forced_router(forced, own)
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].double()
    finally:
        m.Qwen3MoeTopKRouter.forward = original
    lp = torch.log_softmax(logits / TEMPERATURE, -1)[prompt_len - 1 : len(ids) - 1]
    return lp.gather(-1, torch.tensor(ids[prompt_len:])[:, None]).squeeze(-1)


def test_engine_records_the_experts_of_a_full_forward(models, rollout):
    model = models[0]
    checked = 0
    for prompt, res in zip(PROMPTS, rollout):
        assert res.finish_reason == "length" and len(res.output_ids) == NEW_TOKENS
        ids = prompt + res.output_ids[:-1]
        assert res.routed_experts.shape == (len(ids), 2, 2)
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_router_logits=True)  # no mask: aux loss is fine
        for layer, logits in enumerate(out.router_logits):
            top = logits.topk(3, dim=-1)
            clear = (top.values[:, 1] - top.values[:, 2]) > 1e-4  # not a float near-tie
            want = top.indices[:, :2].sort(-1).values
            got = res.routed_experts[:, layer].long().sort(-1).values
            assert torch.equal(got[clear], want[clear]), (res.request_id, layer)
            checked += int(clear.sum())
    assert checked >= 0.9 * sum(len(p) + NEW_TOKENS - 1 for p in PROMPTS) * 2


def _chosen_experts(router_maps, tokens_seen, samples):
    """Per sample ``[tokens, layers, k]`` sorted experts the routers chose, from hook captures of
    the micro-batch tokens and each router's routing map."""
    got = {}
    for (tokens, cu), maps in zip(tokens_seen, router_maps):
        b, length = tokens.shape
        # (row, start) of every sample: one per row padded, back to back in one row packed
        spans = [(row, 0) for row in range(b)] if cu is None else [(0, start) for start in cu[:-1]]
        for row, start in spans:
            match = [
                i
                for i, s in enumerate(samples)
                if torch.equal(tokens[row, start : start + len(s)], torch.tensor(s))
            ]
            if not match:
                continue  # a padding row
            i = match[0]
            per_layer = []
            for layer in sorted(maps):
                rmap = maps[layer].view(length, b, -1)[start : start + len(samples[i]), row]
                per_layer.append(rmap.nonzero()[:, 1].view(len(samples[i]), -1))
            got[i] = torch.stack(per_layer, dim=1)
    return got


def _rank_run(rank, world, trainer_dir, prompts, responses, experts):
    from dataclasses import replace

    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_dapo.actor.actor import ActorConfig, build_actor
    from megatron_dapo.actor.batch import make_actor_batch
    from megatron_dapo.actor.optimizer import OptimizerSettings
    from megatron_dapo.actor.parallel import init_parallel

    samples = [p + r for p, r in zip(prompts, responses)]
    n = len(samples)
    batch = make_actor_batch(
        prompts,
        responses,
        advantages=[1.0, -0.5] * (n // 2),  # not summing to 0: a loss of 0 would match anything
        group_index=list(range(n)),
        routed_experts=experts,
    )

    def actor_for(ep, mode, tp=1, pp=1, pack=True):
        init_parallel(tp=tp, pp=pp, ep=ep)
        cfg = ActorConfig(
            ppo_mini_batch_size=n,
            micro_batch_max_tokens=24,
            temperature=TEMPERATURE,
            shuffle=False,
            routing_replay=mode,
            pack_sequences=pack,
        )
        # adam_eps far above the gradients makes Adam's first step ~ lr * g / eps (as in
        # tests/layout_harness.py): with a tiny eps it is ~ lr * sign(g), and a gradient entry near
        # zero would turn fp32 summation-order noise between layouts into weight differences of ~lr.
        optim = OptimizerSettings(lr=1e-3, lr_warmup_steps=0, adam_eps=1e-2)
        actor = build_actor(trainer_dir, cfg, optim, total_updates=1)
        tokens_seen, maps = [], []

        def see_tokens(_m, args, kwargs):
            packed = kwargs.get("packed_seq_params")
            cu = None if packed is None else packed.cu_seqlens_q.tolist()
            tokens_seen.append((args[0].cpu(), cu))
            maps.append({})

        def see_routing(m, _args, out):
            maps[-1][m.layer_number - 1] = out[1].detach().bool().cpu()

        for module in actor.model[0].modules():
            if isinstance(module, GPTModel):
                module.register_forward_pre_hook(see_tokens, with_kwargs=True)
            if isinstance(module, TopKRouter):
                module.register_forward_hook(see_routing)
        return actor, tokens_seen, maps

    out = {}
    # TP=2 (sequence parallel, which MoE at TP > 1 forces): each rank's routers replay their
    # shard of the sequence; its log-probs and mismatch metric are checked below
    # and PP=2: each stage's routers replay their own global layers
    # and EP=2 on right-padded micro-batches (the rest are packed): the same log-probs and step
    layouts = (
        (1, 1, 1, "none"),
        (1, 1, 1, "rollout"),
        (1, 1, 2, "rollout"),
        (1, 2, 1, "rollout"),
        (1, 1, 2, "padded"),
        (2, 1, 1, "rollout"),  # last: the model whose routers megatron's list must hold
    )
    for tp, pp, ep, mode in layouts:
        if mode == "padded":
            actor, _, _ = actor_for(ep, "rollout", tp, pp, pack=False)
            lp, metrics = actor.compute_logprobs(batch), actor.update(batch)
            out["ep2-padded"] = dict(logprobs=lp, metrics=metrics, state=hf_state(actor))
            continue
        actor, tokens_seen, maps = actor_for(ep, mode, tp, pp)
        lp = actor.compute_logprobs(batch)
        if tp > 1 or pp > 1:
            out[f"tp{tp}pp{pp}"] = dict(logprobs=lp, metrics=actor.update(batch))
            continue
        chosen = _chosen_experts(maps, tokens_seen, samples)
        out[(ep, mode)] = dict(logprobs=lp, chosen=chosen)
        # Replaying the trainer's own choice gives bitwise its unreplayed log-probs. One sample per
        # micro-batch (a budget of 12 tokens): padding tokens change the experts' GEMM sizes and
        # with them the last bit of real tokens' outputs, replayed or not.
        actor.cfg.micro_batch_max_tokens = 12
        if mode == "none":
            del tokens_seen[:], maps[:]
            out["free_unpadded"] = actor.compute_logprobs(batch)
            every = [None] * world
            torch.distributed.all_gather_object(every, _chosen_experts(maps, tokens_seen, samples))
            own = {i: e for part in every for i, e in part.items()}
        if mode == "rollout" and ep == 1:
            mine = replace(batch, routed_experts=[own[i].to(torch.int32) for i in range(n)])
            out["own_choice_logprobs"] = actor.compute_logprobs(mine)
        actor.cfg.micro_batch_max_tokens = 24
        if mode == "rollout":  # the training forward replays too
            del tokens_seen[:], maps[:]
            out[(ep, mode)]["metrics"] = actor.update(batch)
            out[(ep, mode)]["train_chosen"] = _chosen_experts(maps, tokens_seen, samples)
            if ep == 2:  # against the right-padded run ("ep2-padded")
                out[(ep, mode)]["state"] = hf_state(actor)
    from megatron.core.transformer.moe.router_replay import RouterReplay

    # megatron's class-level list of replay instances holds the last model's routers only, not
    # every replay model built in this process (two here)
    out["replay_instances"] = len(RouterReplay.global_router_replay_instances)
    out["routers"] = sum(isinstance(m, TopKRouter) for m in actor.model[0].modules())
    return out


@pytest.fixture(scope="module")
def ranks(models, rollout):
    prompts = PROMPTS
    responses = [r.output_ids for r in rollout]
    experts = [r.routed_experts for r in rollout]
    return run_ranks(_rank_run, 2, models[1], prompts, responses, experts, timeout_s=600)


def _merged(ranks, key, field):
    return {i: e for r in ranks for i, e in r[key][field].items()}


def test_replay_makes_the_actor_route_as_the_engine(ranks, rollout):
    recorded = [r.routed_experts.long().sort(-1).values for r in rollout]
    for key in ((1, "rollout"), (2, "rollout")):
        for field in ("chosen", "train_chosen"):
            got = _merged(ranks, key, field)
            assert sorted(got) == list(range(len(PROMPTS))), (key, field)
            for i, rec in enumerate(recorded):
                assert torch.equal(got[i][: len(rec)], rec), (key, field, i)
    # without replay the trainer's moved routers choose other experts on some tokens
    free = _merged(ranks, (1, "none"), "chosen")
    differ = sum(int((free[i][: len(rec)] != rec).any(-1).any(-1).sum()) for i, rec in enumerate(recorded))
    total = sum(len(rec) for rec in recorded)
    assert 0 < differ < total, (differ, total)


def test_replayed_logprobs_equal_hf_forced_to_the_recorded_experts(models, ranks, rollout):
    from transformers import AutoModelForCausalLM

    from megatron_dapo.actor.routing_replay import pad_value

    trainer = AutoModelForCausalLM.from_pretrained(models[1], dtype=torch.float32).eval()
    forced_gap = 0.0
    for i, (prompt, res) in enumerate(zip(PROMPTS, rollout)):
        ids = prompt + res.output_ids
        rec = res.routed_experts.long()
        full = torch.cat([rec, pad_value(2).long().expand(1, 2, 2)])  # the last token's, unused
        forced = _hf_logprobs(trainer, ids, len(prompt), forced=[full[:, layer] for layer in range(2)])
        free = _hf_logprobs(trainer, ids, len(prompt))
        n = len(res.output_ids)
        for r in ranks:
            for key in ((1, "rollout"), (2, "rollout"), "tp2pp1", "tp1pp2"):
                got = r[key]["logprobs"][i, :n].double()
                assert (got - forced).abs().max() <= 1e-5, (key, i)
            got_free = r[(1, "none")]["logprobs"][i, :n].double()
            assert (got_free - free).abs().max() <= 1e-5, i
        forced_gap = max(forced_gap, float((forced - free).abs().max()))
    assert forced_gap > 1e-3  # the routings' difference shows in the log-probs


def test_routing_mismatch_metric_counts_response_routings_the_trainer_would_change(models, ranks, rollout):
    """actor/routing_mismatch of the replayed step: (response token, layer) pairs whose trainer
    top-k differs from the replayed one. Reference: the trainer's weights in HF, forced to the
    recorded experts (so each layer sees the replayed layers before it), their own top-k per layer
    (the one update runs at the initial weights)."""
    from transformers import AutoModelForCausalLM

    trainer = AutoModelForCausalLM.from_pretrained(models[1], dtype=torch.float32).eval()
    differ = total = 0
    for prompt, res in zip(PROMPTS, rollout):
        ids = prompt + res.output_ids
        rec = res.routed_experts.long()
        forced = torch.cat([rec, torch.tensor([[[0, 1], [0, 1]]])])
        own = []
        _hf_logprobs(trainer, ids, len(prompt), forced=[forced[:, layer] for layer in range(2)], own=own)
        positions = slice(len(prompt) - 1, len(prompt) - 1 + len(res.output_ids))
        for layer in range(2):
            mine = own[layer][positions].sort(-1).values
            differ += int((mine != rec[positions, layer].sort(-1).values).any(-1).sum())
            total += mine.shape[0]
    assert differ > 0
    for r in ranks:
        for key in ((1, "rollout"), (2, "rollout"), "tp2pp1", "tp1pp2"):
            assert r[key]["metrics"]["routing_mismatch"] == pytest.approx(differ / total, abs=1e-12), key


def test_packed_replay_equals_padded(models, ranks):
    """EP=2 with replay: packed micro-batches (each sample's recorded experts at its positions of
    the packed row) give the padded micro-batches' log-probs, loss, grad norm, routing mismatch
    and updated weights, within the 1e-6 of the other layout tests (tests/test_actor_layouts.py)."""
    from helpers import hf_state_dict

    initial = hf_state_dict(models[1])
    for r in ranks:
        packed, padded = r[(2, "rollout")], r["ep2-padded"]
        lp_diff = float((packed["logprobs"] - padded["logprobs"]).abs().max())
        assert lp_diff <= 1e-6 * float(padded["logprobs"].abs().max()), lp_diff
        got, ref = packed["metrics"], padded["metrics"]
        assert got["num_updates"] == ref["num_updates"] == 1
        assert got["routing_mismatch"] == pytest.approx(ref["routing_mismatch"], abs=1e-12)
        assert ref["loss"] != 0 and got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-6)
        assert got["padding_fraction"] < ref["padding_fraction"]
        assert packed["state"].keys() == padded["state"].keys() == initial.keys()
        for name, w in padded["state"].items():
            diff, scale = float((packed["state"][name] - w).abs().max()), float(w.abs().max())
            assert diff <= 1e-6 * scale, (
                f"{name}: packed and padded weights differ by {diff} (max |w| {scale})"
            )
            # each tensor moved well past that bound (experts no token reached: weight decay
            # alone, 1e-4 of |w|), or two untouched copies would pass
            moved = float((w - initial[name]).abs().max())
            assert moved > 1e-5 * scale, f"{name} moved only {moved} in the update"


def test_megatron_keeps_no_replay_instances_of_models_built_before(ranks):
    for rank in ranks:
        assert rank["routers"] == 2
        assert rank["replay_instances"] == rank["routers"]


def test_replaying_the_trainers_own_choice_is_bitwise_no_replay(ranks):
    for r in ranks:
        assert torch.equal(r["own_choice_logprobs"], r["free_unpadded"])


def _rollout_sample(group, prompt_ids, response_ids, experts):
    from megatron_dapo.data.types import PromptSample
    from megatron_dapo.rollout.types import RolloutSample

    prompt = PromptSample(
        index=group, data_source="d", messages=[], prompt_text="p", prompt_ids=prompt_ids, ground_truth="1"
    )
    return RolloutSample(
        group_id=group,
        prompt=prompt,
        response_ids=response_ids,
        rollout_logprobs=[-1.0] * len(response_ids),
        response_text="r",
        finish_reason="stop",
        score=float(group),
        acc=False,
        pred="",
        overlong_penalty=0.0,
        final_reward=float(len(response_ids)),
        weight_version=0,
        truncated=False,
        routed_experts=experts,
    )


def test_samples_carry_routed_experts_to_token_positions_of_micro_batches():
    """Rollout samples -> ActorBatch -> a micro-batch with the samples in another order: every
    token position holds its sample's recorded experts; padding and last tokens fixed ones."""
    from megatron_dapo.actor.micro_batches import collate
    from megatron_dapo.driver.batch_builder import build_actor_batch

    def experts(n, base):  # [n tokens, 2 layers, top-2], distinct per sample, layer and token
        return torch.tensor([[[base + t, base + 50 + t], [base + 100 + t, base + 150 + t]] for t in range(n)])

    samples = [
        _rollout_sample(0, [1, 2], [3, 4, 5], experts(4, 0)),  # 5 tokens, the engine forwarded 4
        _rollout_sample(0, [1, 2], [6], experts(2, 1000)),
        _rollout_sample(1, [7], [8, 9], experts(2, 2000)),
        _rollout_sample(1, [7], [9], experts(1, 3000)),
    ]
    batch, _ = build_actor_batch(samples)
    assert [int(e[0, 0, 0]) for e in batch.routed_experts] == [0, 1000, 2000, 3000]
    micro = collate(batch, [2, 0])
    assert micro.routed_experts.shape == (2, 5, 2, 2)
    pad = torch.tensor([0, 1])
    for t in range(5):
        for layer in range(2):
            want0 = experts(2, 2000)[t, layer] if t < 2 else pad  # 3 tokens + 2 padding positions
            want1 = experts(4, 0)[t, layer] if t < 4 else pad
            assert torch.equal(micro.routed_experts[0, t, layer], want0), (t, layer)
            assert torch.equal(micro.routed_experts[1, t, layer], want1), (t, layer)
    # one sample without a record: the batch carries none (the actor then refuses replay)
    samples[3].routed_experts = None
    assert build_actor_batch(samples)[0].routed_experts is None


def test_routing_replay_bad_inputs():
    from transformers import AutoModelForCausalLM

    from megatron_dapo.actor.actor import ActorConfig
    from megatron_dapo.actor.batch import BatchError, make_actor_batch
    from megatron_dapo.config import ConfigError, load_config
    from megatron_dapo.rollout.hf_engine import HFEngine

    # the actor's config is built from a loaded config; the choice is checked at load
    with pytest.raises(ConfigError, match="actor.routing_replay='always' is not one of none, rollout"):
        load_config(None, ["model.path=/nonexistent", "actor.routing_replay=always"])
    with pytest.raises(
        BatchError, match=r"routed_experts\[0\] must be an integer \[tokens, layers, k\] tensor with 3 or 4"
    ):
        make_actor_batch(
            [[1, 2]], [[3, 4]], [1.0], [0], routed_experts=[torch.zeros(2, 2, 2, dtype=torch.long)]
        )
    # replay asked but the rollout recorded nothing: refused, not trained without replay
    from types import SimpleNamespace

    from megatron_dapo.actor.actor import Actor
    from megatron_dapo.actor.routing_replay import RoutingReplayError, check_supported

    plain = make_actor_batch([[1, 2]], [[3, 4]], [1.0], [0])
    with pytest.raises(ValueError, match="actor.routing_replay: rollout but the batch has no routed_experts"):
        Actor._replayed(SimpleNamespace(cfg=ActorConfig(routing_replay="rollout")), plain)
    recorded = make_actor_batch(
        [[1, 2]], [[3, 4]], [1.0], [0], routed_experts=[torch.zeros(3, 2, 2, dtype=torch.long)]
    )
    assert Actor._replayed(SimpleNamespace(cfg=ActorConfig()), recorded).routed_experts is None
    with pytest.raises(RoutingReplayError, match="does not support activation recomputation"):
        check_supported(SimpleNamespace(recompute_granularity="full"))
    dense = AutoModelForCausalLM.from_config(tiny_hf_config("qwen2", num_layers=1))
    with pytest.raises(ValueError, match="record_routing needs a mixture-of-experts model"):
        HFEngine(model=dense, record_routing=True)


def test_sglang_reply_routed_experts_are_parsed_per_forwarded_token():
    """SGLang 0.5.23's reply shape (read from its source: io_struct.GenerateReqInput's
    return_routed_experts / routed_experts_start_len, tokenizer_manager's base64 int32
    meta_info.routed_experts over positions [start, seq_len - 1)), built by hand here."""
    import base64

    import numpy as np

    from megatron_dapo.rollout.types import GenerationRequest, SamplingParams
    from megatron_dapo.sglang.client import SGLangError, parse_generate_reply, payload_generate

    req = GenerationRequest("a", [5, 6, 7], SamplingParams(max_new_tokens=4))
    assert "return_routed_experts" not in payload_generate(req)
    asked = payload_generate(req, routed_experts=True)
    assert asked["return_routed_experts"] is True and asked["routed_experts_start_len"] == 0
    experts = np.arange(4 * 3 * 2, dtype=np.int32).reshape(4, 3, 2)  # 3 prompt + 2 output - 1 tokens
    meta = {
        "finish_reason": {"type": "stop"},
        "output_token_logprobs": [[-0.5, 11, None], [-0.25, 12, None]],
        "routed_experts": base64.b64encode(experts.tobytes()).decode(),
    }
    res = parse_generate_reply({"meta_info": meta}, req, "sglang-0", routed_experts_shape=(3, 2))
    assert res.output_ids == [11, 12] and torch.equal(
        res.routed_experts.long(), torch.from_numpy(experts).long()
    )
    assert parse_generate_reply({"meta_info": meta}, req, "sglang-0").routed_experts is None
    with pytest.raises(SGLangError, match=r"holds 24 ids, expected 4 tokens x 2 layers x top-2"):
        parse_generate_reply({"meta_info": meta}, req, "sglang-0", routed_experts_shape=(2, 2))
    del meta["routed_experts"]
    with pytest.raises(SGLangError, match="--enable-return-routed-experts"):
        parse_generate_reply({"meta_info": meta}, req, "sglang-0", routed_experts_shape=(3, 2))


def test_routing_replay_is_accepted_with_sglang_engines():
    """The driver wires SGLang's routed experts (tests/test_sglang_routing_replay.py), so the
    engine choice no longer depends on routing replay."""
    from omegaconf import OmegaConf

    from megatron_dapo.driver.launch import resolve_engine

    cfg = OmegaConf.create({"rollout": {"engine": "auto"}, "actor": {"routing_replay": "rollout"}})
    assert resolve_engine(cfg, "cpu") == "hf"
    assert resolve_engine(cfg, "cuda") == "sglang"
    cfg.rollout.engine = "sglang"
    assert resolve_engine(cfg, "cpu") == "sglang"
