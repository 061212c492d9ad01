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


# -- the dynamic batcher: concurrent calls share decode batches ---------------------------------


class Gate:
    """A forward pre-hook that records each forward's rows and holds the first one until
    ``release``: calls made meanwhile queue for the next batch."""

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
    """Until ``n`` calls wait for a batch (the engine's queue)."""
    for _ in range(12000):
        if len(engine._pending) >= n:
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"{n} calls never queued")


def test_calls_pending_when_a_batch_starts_are_decoded_together(model):
    """One-request calls made while a batch decodes go in the next batch together: 2 batches for
    3 calls, the second of 2 rows (one call at a time: 3 batches of 1). Each response is the one
    it gets alone (its own seed): the same tokens, log-probs equal up to float rounding."""
    alone = [HFEngine(model=model).generate([_one(i)])[0] for i in range(3)]
    serial = HFEngine(model=model)
    for i in range(3):
        serial.generate([_one(i)])
    assert serial.stats["batches"] == 3

    engine = HFEngine(model=model)
    gate = Gate(model)
    try:
        out, threads = _in_threads(engine, [[_one(0)], [_one(1)], [_one(2)]])
        threads[0].start()
        assert gate.started.wait(timeout=120)
        for t in threads[1:]:
            t.start()
        _wait_queued(engine, 2)
        gate.open.set()
        for t in threads:
            t.join(timeout=120)
    finally:
        gate.remove()
    assert gate.rows[0] == 1 and gate.rows[-1] == 2 and engine.stats["batches"] == 2
    got = [o[0] for o in out]
    assert [r.output_ids for r in got] == [r.output_ids for r in alone]
    for r, a in zip(got, alone):
        assert r.logprobs == pytest.approx(a.logprobs, abs=1e-5)
    assert engine.stats["requests"] == 3 and engine.stats["tokens"] == 18


def test_a_call_of_several_requests_is_decoded_alone_and_an_abort_reaches_queued_calls(model):
    """A call of several requests (a unit) is not mixed with one-request calls: its batch is
    exactly what it would be alone, so its responses are bitwise those of a call made alone.
    An abort answers every call in flight, the ones still waiting for a batch included, "abort"
    with what they had; a call made after it runs."""
    unit = [_one(3), _one(4), _one(5)]
    reference = HFEngine(model=model).generate(unit)
    engine = HFEngine(model=model)
    gate = Gate(model)
    try:
        out, threads = _in_threads(engine, [[_one(0)], unit, [_one(1)], [_one(2)]])
        threads[0].start()
        assert gate.started.wait(timeout=120)
        for k in (1, 2, 3):
            threads[k].start()
            _wait_queued(engine, k)
        gate.open.set()
        for t in threads:
            t.join(timeout=120)
    finally:
        gate.remove()
    # the batches: the first call, the unit alone, then the two one-request calls together
    assert engine.stats["batches"] == 3
    assert [(r.output_ids, r.logprobs) for r in out[1]] == [(r.output_ids, r.logprobs) for r in reference]
    sizes = [n for n in gate.rows if n > 1]
    assert sizes[0] == 3 and sizes[-1] == 2

    engine = HFEngine(model=model)
    gate = Gate(model)
    try:
        long = GenerationRequest("long", [3, 4, 5], SamplingParams(max_new_tokens=100, seed=1))
        out, threads = _in_threads(engine, [[long], [_one(1)], unit])
        threads[0].start()
        assert gate.started.wait(timeout=120)
        for k in (1, 2):
            threads[k].start()
            _wait_queued(engine, k)
        engine.abort()
        gate.open.set()
        for t in threads:
            t.join(timeout=120)
    finally:
        gate.remove()
    assert out[0][0].finish_reason == "abort" and len(out[0][0].output_ids) < 100
    assert [(r.finish_reason, r.output_ids) for r in out[1] + out[2]] == [("abort", [])] * 4
    assert engine.stats["batches"] == 1 and engine.stats["aborted"] == 5
    assert engine.generate([_one(1)])[0].finish_reason == "length"


def test_a_weight_load_waits_for_the_batch_in_flight(model):
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
        assert load.is_alive() and engine.weight_version == 0  # the batch holds the model
        gate.open.set()
        threads[0].join(timeout=120)
        load.join(timeout=120)
    finally:
        gate.remove()
    assert out[0][0].weight_version == 0 and engine.weight_version == 5
    assert engine.generate([_one(1)])[0].weight_version == 5


def test_generate_apart_queues_its_requests_as_calls_of_their_own(model):
    """What a Ray host does with episodes' later turns: several one-request calls in one call,
    batched with the other one-request calls pending (one batch of 3 rows after the held one),
    each the response it gets alone."""
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
    assert engine.stats["batches"] == 2 and gate.rows[-1] == 3
    got = [out[1][0], *apart["r"]]
    assert [r.output_ids for r in got] == [r.output_ids for r in alone]
