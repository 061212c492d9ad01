"""HF engine on a tiny random Qwen2: seeded determinism, log-probs vs an independent forward pass,
stop tokens / max_new_tokens / finish reasons, abort, and weight loading from HF-named buckets."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import tiny_hf_config

from megatron_dapo.rollout.hf_engine import HFEngine, WeightLoadError
from megatron_dapo.rollout.types import GenerationRequest, SamplingParams

torch.set_num_threads(1)


def tiny_model(seed=0, tie=False):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_hf_config(vocab=128, hidden=32, heads=4, kv_heads=2, tie_word_embeddings=tie),
        dtype=torch.float32,
    )
    with torch.no_grad():  # larger weights than the init default, so the distribution is far from uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    return model.eval()


def requests(n=4, **sampling):
    params = dict(temperature=0.9, max_new_tokens=10)
    params.update(sampling)
    return [
        GenerationRequest(f"r{i}", [5 + i] * (2 + 3 * i), SamplingParams(seed=100 + i, **params))
        for i in range(n)
    ]


def reference_logprobs(model, prompt, output, temperature):
    """log_softmax(logits / T) of each output token from one unpadded full-sequence forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1 : -1]
    return logp.gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_deterministic_under_seed_and_independent_of_batch(model):
    engine = HFEngine(model=model)
    reqs = requests()
    first = engine.generate(reqs)
    again = engine.generate(reqs)
    assert [r.output_ids for r in first] == [r.output_ids for r in again]
    alone = engine.generate([reqs[2]])[0]  # same seed, no batch mates, no left padding
    assert alone.output_ids == first[2].output_ids
    reseeded = engine.generate(
        [GenerationRequest("x", reqs[2].prompt_ids, SamplingParams(0.9, max_new_tokens=10, seed=7))]
    )
    assert reseeded[0].output_ids != first[2].output_ids


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, -1), (0.7, 0.8, 20), (1.3, 1.0, 5)])
def test_logprobs_match_a_separate_forward_at_the_sampling_temperature(model, temperature, top_p, top_k):
    engine = HFEngine(model=model)
    reqs = requests(temperature=temperature, top_p=top_p, top_k=top_k)
    for req, res in zip(reqs, engine.generate(reqs)):
        ref = reference_logprobs(model, req.prompt_ids, res.output_ids, temperature)
        # SGLang semantics: the full-vocabulary temperature-scaled distribution, not the truncated one
        torch.testing.assert_close(torch.tensor(res.logprobs), ref, atol=1e-5, rtol=0)


def test_top_k_one_and_greedy_pick_the_argmax(model):
    engine = HFEngine(model=model)
    greedy = engine.generate(requests(temperature=0.0))
    top1 = engine.generate(requests(top_k=1))
    for req, g, t in zip(requests(), greedy, top1):
        with torch.no_grad():
            seq = req.prompt_ids + g.output_ids
            logits = model(torch.tensor([seq])).logits[0, len(req.prompt_ids) - 1 : -1]
        assert g.output_ids == logits.argmax(-1).tolist()
        assert t.output_ids == g.output_ids


def test_each_row_is_handed_over_at_the_decode_step_it_stops(model):
    """``on_result`` gets row i after its own k_i-th token (k_i forwards: the prefill and k_i - 1
    decode steps), while the longer rows still decode; the results are the call's own and equal
    to a call without the hand-over."""
    budgets = [6, 2, 9, 4]
    reqs = [
        GenerationRequest(f"r{i}", [5 + i] * 3, SamplingParams(0.9, max_new_tokens=k, seed=100 + i))
        for i, k in enumerate(budgets)
    ]
    forwards = []
    hook = model.register_forward_hook(lambda *_: forwards.append(1))
    handed = []
    try:
        results = HFEngine(model=model).generate(reqs, on_result=lambda r: handed.append((r, len(forwards))))
    finally:
        hook.remove()
    assert [(r.request_id, at) for r, at in handed] == [("r1", 2), ("r3", 4), ("r0", 6), ("r2", 9)]
    by_id = {r.request_id: r for r, _ in handed}
    assert all(by_id[r.request_id] is r for r in results)  # the same objects, not copies
    plain = HFEngine(model=model).generate(reqs)
    assert [(r.output_ids, r.logprobs, r.finish_reason) for r in results] == [
        (r.output_ids, r.logprobs, r.finish_reason) for r in plain
    ]
    assert [len(r.output_ids) for r in results] == budgets


def test_stop_tokens_max_new_tokens_and_finish_reasons(model):
    engine = HFEngine(model=model)
    free = engine.generate(requests(max_new_tokens=10))
    assert all(r.finish_reason == "length" and len(r.output_ids) == 10 for r in free)
    # stop on the 4th token that request 0 sampled: same seed, same prefix, so it stops there
    stop_tok = free[0].output_ids[3]
    first_hit = free[0].output_ids.index(stop_tok)
    stopped = engine.generate(requests(max_new_tokens=10, stop_token_ids=[stop_tok]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.output_ids == free[0].output_ids[: first_hit + 1]  # the stop token is kept
    short = engine.generate(requests(max_new_tokens=3))
    assert all(len(r.output_ids) == 3 and r.finish_reason == "length" for r in short)
    # the model's EOS id stops a request unless ignore_eos
    model.generation_config.eos_token_id = stop_tok
    try:
        eos_engine = HFEngine(model=model)
        assert eos_engine.generate(requests(max_new_tokens=10))[0].finish_reason == "stop"
        assert eos_engine.generate(requests(max_new_tokens=10, ignore_eos=True))[0].finish_reason == "length"
    finally:
        model.generation_config.eos_token_id = None


def test_abort_returns_partial_responses(model, monkeypatch):
    engine = HFEngine(model=model)
    reqs = [GenerationRequest("long", [3, 4, 5], SamplingParams(max_new_tokens=100, seed=1))]
    # abort only once decoding is under way (an abort before the call starts is a different case)
    decoding, forward = threading.Event(), model.forward

    def forward_and_tell(*args, **kwargs):
        decoding.set()
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward_and_tell)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", engine.generate(reqs)))
    t.start()
    assert decoding.wait(timeout=120), "generation never started"
    engine.abort()
    t.join(timeout=120)
    res = out["r"][0]
    assert res.finish_reason == "abort" and len(res.output_ids) < 100
    assert engine.generate(requests(1, max_new_tokens=2))[0].finish_reason == "length"  # later calls run


def _buckets(state, size=5):
    items = list(state.items())
    return [dict(items[i : i + size]) for i in range(0, len(items), size)]


@pytest.mark.parametrize("tie", [False, True])
def test_bucket_loading_equals_load_state_dict(tie):
    target = tiny_model(seed=1, tie=tie)
    engine = HFEngine(model=tiny_model(seed=0, tie=tie))
    before = engine.generate(requests())
    state = {k: v.clone() for k, v in target.state_dict().items()}
    engine.load_weights(_buckets(state), version=7)
    reference = tiny_model(seed=0, tie=tie)
    reference.load_state_dict(state)
    expected = HFEngine(model=reference).generate(requests())
    got = engine.generate(requests())
    assert [r.output_ids for r in got] == [r.output_ids for r in expected]
    assert [r.logprobs for r in got] == [r.logprobs for r in expected]
    assert [r.output_ids for r in got] != [r.output_ids for r in before]
    assert got[0].weight_version == 7 and engine.health()
    if tie:  # the tied head may come without lm_head.weight
        state.pop("lm_head.weight", None)
        engine.load_weights(_buckets(state), version=8)


def test_moe_buckets_with_per_expert_names_load_into_fused_experts(tmp_path):
    """The weight sync sends a MoE checkpoint's per-expert names (experts.{e}.gate_proj.weight);
    transformers 5's Qwen3-MoE holds the experts fused. Loaded from the saved checkpoint's
    tensors, the engine's model equals transformers' own load of that checkpoint."""
    from helpers import hf_state_dict, random_hf_model
    from transformers import AutoModelForCausalLM

    random_hf_model(tiny_hf_config("qwen3_moe"), 1).save_pretrained(str(tmp_path))
    state = hf_state_dict(tmp_path)
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in state
    engine = HFEngine(model=random_hf_model(tiny_hf_config("qwen3_moe"), 2).eval())
    engine.load_weights(_buckets(state), version=3)
    want = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).state_dict()
    got = engine.model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    state.pop("model.layers.1.mlp.experts.5.down_proj.weight")
    with pytest.raises(WeightLoadError, match=r"lacks 1 tensors.*experts.5.down_proj.weight"):
        engine.load_weights([state], 4)


def test_bucket_loading_is_strict_and_names_the_tensor():
    engine = HFEngine(model=tiny_model())
    state = {k: v.clone() for k, v in tiny_model(seed=1).state_dict().items()}
    with pytest.raises(WeightLoadError, match=r"'model.layers.0.bogus'"):
        engine.load_weights([{"model.layers.0.bogus": torch.zeros(1)}], 1)
    assert not engine.health()  # a half-applied update is not served
    bad = dict(state)
    bad["model.norm.weight"] = torch.ones(3)
    with pytest.raises(WeightLoadError, match=r"model.norm.weight.*\(3,\).*\(32,\)"):
        engine.load_weights([bad], 1)
    partial = dict(state)
    partial.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(WeightLoadError, match=r"lacks 1 tensors.*model.layers.1.mlp.up_proj.weight"):
        engine.load_weights([partial], 1)
    engine.load_weights([state], 2)
    assert engine.health() and engine.weight_version == 2


def test_load_from_disk_and_from_path(tiny_hf_checkpoint):
    path = tiny_hf_checkpoint(vocab=128, hidden=32, heads=4, kv_heads=2, max_shard_size="20KB")
    from_path = HFEngine(path)
    engine = HFEngine(model=tiny_model(seed=3))
    engine.load_from_disk(path, version=4)
    assert [r.output_ids for r in engine.generate(requests())] == [
        r.output_ids for r in from_path.generate(requests())
    ]


# -- continuous batching: rows join and leave the decode at any step -----------------------------


class Gate:
    """A forward pre-hook that records each forward's rows and holds the first one until
    ``release``: calls made meanwhile queue for the next step."""

    def __init__(self, model):
        self.rows, self.started, self.open = [], threading.Event(), threading.Event()
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        self.rows.append(kwargs["input_ids"].shape[0])
        self.started.set()
        assert self.open.wait(timeout=120), "the test never released the first forward"

    def remove(self):
        self.open.set()
        self.handle.remove()


def _one(i, tokens=6):
    return GenerationRequest(
        f"q{i}", [5 + i] * (2 + i), SamplingParams(0.9, max_new_tokens=tokens, seed=300 + i)
    )


def _in_threads(engine, calls):
    out = [None] * len(calls)

    def go(k):
        out[k] = engine.generate(calls[k])

    threads = [threading.Thread(target=go, args=(k,)) for k in range(len(calls))]
    return out, threads


def _wait_queued(engine, n):
    """Until ``n`` rows wait for a slot (the engine's queue)."""
    for _ in range(12000):
        if len(engine._pending) >= n:
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"{n} rows never queued")


def _bits(results):
    return [(r.output_ids, r.logprobs, r.finish_reason) for r in results]


def test_a_response_is_bitwise_the_same_alone_in_a_batch_and_joining_one_mid_way(model):
    """Batch invariance: prompts of different lengths (a left-padded batch rounds each row
    differently from its decode alone), a batch with them, and rows joining a decode that is
    under way: every response is bitwise the one it gets alone, log-probs included. This is what
    keeps a seeded multi-turn run reproducible when its turns meet in the engine by timing."""
    reqs = [_one(i, tokens=12) for i in range(6)]
    alone = [HFEngine(model=model, frame=64).generate([q])[0] for q in reqs]
    assert len({len(q.prompt_ids) for q in reqs}) == 6
    assert _bits(HFEngine(model=model, frame=64).generate(reqs)) == _bits(alone)
    assert _bits(HFEngine(model=model, frame=64).generate(reqs[::-1])) == _bits(alone[::-1])

    engine = HFEngine(model=model, frame=64)
    long = GenerationRequest("long", [9] * 7, SamplingParams(0.9, max_new_tokens=30, seed=11))
    long_alone = HFEngine(model=model, frame=64).generate([long])[0]
    gate = Gate(model)
    try:
        out, threads = _in_threads(engine, [[long], reqs[:3], [reqs[3]], reqs[4:]])
        threads[0].start()
        assert gate.started.wait(timeout=120)
        for k in (1, 2, 3):
            threads[k].start()
        _wait_queued(engine, 6)
        gate.open.set()
        for t in threads:
            t.join(timeout=120)
    finally:
        gate.remove()
    assert _bits(out[0]) == _bits([long_alone])
    assert _bits(out[1] + out[2] + out[3]) == _bits(alone)


def test_a_call_made_while_others_decode_joins_at_the_next_step(model):
    """An episode's later turn sent while a long response decodes is answered while that one is
    still decoding (it does not wait for the batch to end): the engine's forwards are the long
    row's plus one prefill, not the sum of both calls'."""
    engine = HFEngine(model=model)
    long = GenerationRequest(
        "long", [3, 4, 5], SamplingParams(0.9, max_new_tokens=40, seed=1, ignore_eos=True)
    )
    short = GenerationRequest("short", [7, 8], SamplingParams(0.9, max_new_tokens=3, seed=2, ignore_eos=True))
    short_done, long_left = threading.Event(), {}
    gate = Gate(model)
    try:
        out, threads = _in_threads(engine, [[long]])
        threads[0].start()
        assert gate.started.wait(timeout=120)
        t = threading.Thread(target=lambda: (engine.generate([short]), short_done.set()))
        t.start()
        _wait_queued(engine, 1)
        gate.open.set()
        assert short_done.wait(timeout=120)
        long_left["alive"] = threads[0].is_alive()
        threads[0].join(timeout=120)
        t.join(timeout=120)
    finally:
        gate.remove()
    assert long_left["alive"], "the short call waited for the long one"
    assert len(out[0][0].output_ids) == 40
    # 40 forwards for the long row (a prefill, 39 steps), one prefill for the short row
    assert engine.stats["prefills"] == 2 and engine.stats["steps"] == 39


def test_an_abort_reaches_rows_in_flight_and_queued(model):
    """An abort answers every row in flight "abort" with what it sampled, and every queued one
    "abort" with nothing; a call made after it runs."""
    engine = HFEngine(model=model)
    gate = Gate(model)
    unit = [_one(3), _one(4), _one(5)]
    try:
        long = GenerationRequest("long", [3, 4, 5], SamplingParams(max_new_tokens=100, seed=1))
        out, threads = _in_threads(engine, [[long], [_one(1)], unit])
        threads[0].start()
        assert gate.started.wait(timeout=120)
        for k in (1, 2):
            threads[k].start()
        _wait_queued(engine, 4)
        engine.abort()
        gate.open.set()
        for t in threads:
            t.join(timeout=120)
    finally:
        gate.remove()
    assert out[0][0].finish_reason == "abort" and 0 < len(out[0][0].output_ids) < 100
    assert [(r.finish_reason, r.output_ids) for r in out[1] + out[2]] == [("abort", [])] * 4
    assert engine.stats["aborted"] == 5
    assert engine.generate([_one(1)])[0].finish_reason == "length"


def test_a_weight_load_waits_for_the_rows_in_flight(model):
    """A load waits until the rows in flight are answered (a response comes from one version of
    the weights), and a row queued meanwhile starts after it, on the new weights."""
    engine = HFEngine(model=model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    gate = Gate(model)
    try:
        out, threads = _in_threads(engine, [[_one(0)]])
        threads[0].start()
        assert gate.started.wait(timeout=120)
        load = threading.Thread(target=engine.load_weights, args=([state], 5))
        load.start()
        load.join(timeout=0.2)
        assert load.is_alive() and engine.weight_version == 0  # the row in flight holds the model
        gate.open.set()
        threads[0].join(timeout=120)
        load.join(timeout=120)
    finally:
        gate.remove()
    assert out[0][0].weight_version == 0 and engine.weight_version == 5
    assert engine.generate([_one(1)])[0].weight_version == 5


def test_generate_apart_queues_its_requests_as_calls_of_their_own(model):
    """What a Ray host does with episodes' later turns: several one-request calls in one call,
    decoded with the rows in flight, each bitwise the response it gets alone."""
    alone = [HFEngine(model=model).generate([_one(i)])[0] for i in range(3)]
    engine = HFEngine(model=model)
    gate = Gate(model)
    try:
        out, threads = _in_threads(engine, [[_one(5)], [_one(0)]])
        threads[0].start()
        assert gate.started.wait(timeout=120)
        threads[1].start()
        _wait_queued(engine, 1)
        apart = {}
        t = threading.Thread(target=lambda: apart.setdefault("r", engine.generate_apart([_one(1), _one(2)])))
        t.start()
        _wait_queued(engine, 3)
        gate.open.set()
        for x in [*threads, t]:
            x.join(timeout=120)
    finally:
        gate.remove()
    assert _bits([out[1][0], *apart["r"]]) == _bits(alone)
    # the first row's first step, then the four together for 5 steps (one at a time: 20)
    assert engine.stats["steps"] == 6


def test_a_request_longer_than_the_frame_grows_it(model, caplog):
    """A frame too small for a request grows (with a warning: rows after it round differently),
    and the response is still the model's (log-probs against a separate forward)."""
    engine = HFEngine(model=model, frame=8)
    req = GenerationRequest("big", [5] * 10, SamplingParams(0.9, max_new_tokens=20, seed=4))
    with caplog.at_level("WARNING"):
        res = engine.generate([req])[0]
    assert "frame grows" in caplog.text and engine._frame.width == 64
    ref = reference_logprobs(model, req.prompt_ids, res.output_ids, 0.9)
    torch.testing.assert_close(torch.tensor(res.logprobs), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("qwen3", "eager"), ("qwen3_moe", "sdpa")])
def test_logprobs_match_a_separate_forward_across_families_and_attention(family, attn):
    """The engine's frame and masks in other architectures and in eager attention (an additive
    mask): log-probs equal a plain unpadded forward's."""
    from helpers import random_hf_model

    model = random_hf_model(tiny_hf_config(family, vocab=128), 0).eval()
    model.config._attn_implementation = attn
    engine = HFEngine(model=model)
    reqs = requests(3)
    for req, res in zip(reqs, engine.generate(reqs)):
        ref = reference_logprobs(model, req.prompt_ids, res.output_ids, 0.9)
        torch.testing.assert_close(torch.tensor(res.logprobs), ref, atol=1e-5, rtol=0)


def _episodes(engine, n=3):
    """Three turns of ``n`` episodes through ``engine``, each turn a call once the last answered:
    turn k's prompt is turn k-1's prompt, its response and a tool answer, sent with the earlier
    prompts' lengths (what the episode runner sends). Returns each turn's requests and results."""
    prompts = [[5 + i] * (3 + 5 * i) for i in range(n)]
    cuts: list[tuple[int, ...]] = [() for _ in range(n)]
    turns = []
    for k in range(3):
        reqs = [
            GenerationRequest(
                f"e{i}/t{k}", p, SamplingParams(0.9, max_new_tokens=8, seed=50 + 10 * i + k), prefix_lengths=c
            )
            for i, (p, c) in enumerate(zip(prompts, cuts))
        ]
        results = engine.generate(reqs)
        turns.append((reqs, results))
        cuts = [c + (len(p),) for p, c in zip(prompts, cuts)]
        prompts = [p + r.output_ids + [7 + k] * (2 + i) for i, (p, r) in enumerate(zip(prompts, results))]
    return turns


def test_an_episodes_later_turn_reuses_its_earlier_prompt_with_the_same_bits(model):
    """Prefix reuse: an episode's turn restores its previous prompt's keys and values and prefills
    only what it adds. Its response is bitwise the one computed without the stored prefix (a new
    engine, a weight load between, batch mates), and its log-probs are the model's."""
    engine = HFEngine(model=model, frame=96)
    turns = _episodes(engine)
    reqs, results = turns[2]
    earlier = [len(q.prompt_ids) for q in turns[1][0]]  # each third turn restores its second prompt
    assert engine.stats["reused_tokens"] == sum(len(q.prompt_ids) for q in turns[0][0]) + sum(earlier)
    assert engine.stats["prefill_tokens"] == sum(len(q.prompt_ids) for q in turns[0][0]) + sum(
        len(q.prompt_ids) - len(p.prompt_ids) for t in (1, 2) for q, p in zip(turns[t][0], turns[t - 1][0])
    )
    for q, r in zip(reqs, results):
        torch.testing.assert_close(
            torch.tensor(r.logprobs),
            reference_logprobs(model, q.prompt_ids, r.output_ids, 0.9),
            atol=1e-5,
            rtol=0,
        )
    cold = HFEngine(model=model, frame=96)
    assert _bits([cold.generate([q])[0] for q in reqs]) == _bits(results)
    assert cold.stats["reused_tokens"] == 0
    mates = [_one(i, tokens=12) for i in range(3)]
    assert _bits(HFEngine(model=model, frame=96).generate(mates + reqs)[3:]) == _bits(results)
    engine.load_weights([dict(model.state_dict())], version=1)  # the stored prefixes go with the weights
    reused = engine.stats["reused_tokens"]
    assert _bits(engine.generate(reqs)) == _bits(results)
    assert engine.stats["reused_tokens"] == reused


def test_a_reused_prefix_keeps_its_routed_experts():
    """MoE routing replay covers the whole prompt when part of it came from the store."""
    from helpers import random_hf_model

    model = random_hf_model(tiny_hf_config("qwen3_moe", vocab=128), 0).eval()
    warm = HFEngine(model=model, record_routing=True, frame=96)
    reqs, results = _episodes(warm, n=2)[1]
    assert warm.stats["reused_tokens"] > 0
    cold = [HFEngine(model=model, record_routing=True, frame=96).generate([q])[0] for q in reqs]
    for q, hot, miss in zip(reqs, results, cold):
        assert hot.routed_experts.shape[0] == len(q.prompt_ids) + len(hot.output_ids) - 1
        assert torch.equal(hot.routed_experts, miss.routed_experts)
        assert hot.output_ids == miss.output_ids


def test_prefix_lengths_outside_the_prompt_are_refused_naming_the_field(model):
    bad = GenerationRequest("b", [5] * 6, SamplingParams(max_new_tokens=2), prefix_lengths=(4, 2))
    with pytest.raises(ValueError, match="prefix_lengths"):
        HFEngine(model=model).generate([bad])


def test_a_groups_episodes_share_their_first_prompts_stored_prefix(model):
    """A group's samples send one prompt: each of their second turns finds it stored (a store that
    handed an entry to the first taker would leave the others to compute it again)."""
    engine = HFEngine(model=model, frame=96)
    prompt = [6] * 9
    first = engine.generate(
        [
            GenerationRequest(
                f"g{i}/t0", prompt, SamplingParams(0.9, max_new_tokens=6, seed=i), prefix_lengths=()
            )
            for i in range(4)
        ]
    )
    second = [
        GenerationRequest(
            f"g{i}/t1",
            prompt + r.output_ids + [7, 7],
            SamplingParams(0.9, max_new_tokens=6, seed=9),
            prefix_lengths=(9,),
        )
        for i, r in enumerate(first)
    ]
    for q in second:  # one at a time, each after the one before took the entry
        engine.generate([q])
    assert engine.stats["reused_tokens"] == 4 * len(prompt)
