"""RolloutManager against a scripted engine and scorer: refill, budget, abort, failures, accounting.

The scripted engine answers prompt ``p`` by its class (``prompt_ids[0]``): 0 = mixed (half the
samples right), 1 = all right, 2 = all wrong. The tokenizer decodes token 1 as "right"; the
scorer gives +1 / -1 for right / wrong. Expected batches and counts are worked out by hand.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from rollout_fakes import (
    MIXED,
    RIGHT,
    WRONG,
    Dataset,
    Scorer,
    ScriptedEngine,
    StepClock,
    Tokenizer,
    accounted,
    manager_config,
)

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.rollout.dump import dump_rollouts
from megatron_dapo.rollout.engine import EngineError
from megatron_dapo.rollout.manager import NoEngineAliveError, RolloutManager, RolloutManagerConfig
from megatron_dapo.rollout.rollout_metrics import TIMING_DEPENDENT_METRICS
from megatron_dapo.rollout.types import GenerationResult


def test_refill_across_rounds_keeps_only_mixed_groups_in_draw_order():
    mgr = RolloutManager([ScriptedEngine("e0")], Scorer(), manager_config(), Tokenizer())
    batch = mgr.collect(Dataset([MIXED, RIGHT, WRONG]), weight_version=3)
    m = batch.metrics
    # rounds of 4 prompts; mixed prompts are 0, 3 | 6 | 9 -> 3 rounds
    assert m["rollout/gen_rounds"] == 3
    assert m["rollout/prompts_drawn"] == 12
    assert [s.prompt.index for s in batch.samples[::4]] == [0, 3, 6, 9]
    assert batch.group_index == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    # prompts 0-9 decide the batch (the 4th mixed one is 9); 10 and 11 are past the cut, unused
    assert m["rollout/filtered_all_correct"] == 3  # prompts 1, 4, 7
    assert m["rollout/filtered_all_wrong"] == 3  # prompts 2, 5, 8
    assert m["rollout/unused"] == 2
    assert m["rollout/keep_rate"] == pytest.approx(4 / 10)
    assert accounted(m) == 12
    assert m["rollout/acc/mean"] == 0.5
    # length 3 <= 8 - 4: no overlong penalty, reward is the +-1 score
    assert sorted({s.final_reward for s in batch.samples}) == [-1.0, 1.0]
    assert all(s.weight_version == 3 for s in batch.samples)


def test_overlong_penalty_is_added_to_the_score():
    # length 6 with L_max 8, buffer 4: penalty -(6 - 4) / 4 * 0.5 = -0.25
    mgr = RolloutManager(
        [ScriptedEngine("e0", length=6)], Scorer(), manager_config(overlong_penalty_factor=0.5), Tokenizer()
    )
    batch = mgr.collect(Dataset([MIXED]), 0)
    assert {s.overlong_penalty for s in batch.samples} == {-0.25}
    assert sorted({s.final_reward for s in batch.samples}) == [-1.25, 0.75]
    assert batch.metrics["rollout/response_length/mean"] == 6


def test_filter_on_seq_final_reward_and_disabled_filter():
    mgr = RolloutManager(
        [ScriptedEngine("e0")], Scorer(), manager_config(filter_groups_enable=False), Tokenizer()
    )
    batch = mgr.collect(Dataset([RIGHT, WRONG]), 0)
    assert batch.metrics["rollout/gen_rounds"] == 1 and len(batch) == 16
    mgr = RolloutManager(
        [ScriptedEngine("e0")], Scorer(), manager_config(filter_metric="seq_final_reward"), Tokenizer()
    )
    assert mgr.collect(Dataset([WRONG, MIXED]), 0).metrics["rollout/filtered_all_wrong"] == 4


def test_zero_spread_fraction_is_measured_with_the_filter_off_and_on():
    # filter off: one round of 4 prompts (classes R, W, M, R) is the batch; 3 of its 4 groups
    # have a constant acc -> 3/4, not the 0 it read when only filtered groups were counted
    mgr = RolloutManager(
        [ScriptedEngine("e0")], Scorer(), manager_config(filter_groups_enable=False), Tokenizer()
    )
    m = mgr.collect(Dataset([RIGHT, WRONG, MIXED]), 0).metrics
    assert m["rollout/prompts_drawn"] == 4 and m["rollout/zero_spread_fraction"] == pytest.approx(3 / 4)
    # filter on: prompts 0-9 decide the batch, 6 of them constant (1, 2, 4, 5, 7, 8) -> 6/10
    mgr = RolloutManager([ScriptedEngine("e0")], Scorer(), manager_config(), Tokenizer())
    m = mgr.collect(Dataset([MIXED, RIGHT, WRONG]), 0).metrics
    assert m["rollout/zero_spread_fraction"] == pytest.approx(6 / 10)


def test_budget_exhaustion_raises_with_verl_advice():
    mgr = RolloutManager([ScriptedEngine("e0")], Scorer(), manager_config(max_num_gen_batches=2), Tokenizer())
    with pytest.raises(ValueError, match=r"max_num_gen_batches=0") as e:
        mgr.collect(Dataset([WRONG]), 0)
    assert "num_gen_batches=2" in str(e.value) and "too difficult" in str(e.value)


def test_budget_exhaustion_partial_batch_when_allowed():
    classes = [MIXED] + [WRONG] * 7  # one mixed prompt in the first 8 drawn
    mgr = RolloutManager(
        [ScriptedEngine("e0")],
        Scorer(),
        manager_config(max_num_gen_batches=2, allow_partial_batch=True),
        Tokenizer(),
    )
    batch = mgr.collect(Dataset(classes), 0)
    m = batch.metrics
    assert batch.num_groups == 1 and m["rollout/partial_batch"] == 1.0
    assert m["rollout/gen_rounds"] == 2 and accounted(m) == 8 and m["rollout/filtered_all_wrong"] == 7


def test_abort_once_full_counts_in_flight_and_queued_groups():
    # 12 prompts in one round; prompts 0, 1 come back at once, the rest block until aborted.
    # 4 calls per engine (64 // (4 * 4)): 2 slow in flight + 8 never dispatched = 10 aborted.
    # slow_once: a slow call whose thread reaches the engine only after the abort (the manager
    # dispatched it first) is aborted too, as one in flight; otherwise it blocked until the
    # manager's abort_timeout_s (60 s), seen in fresh-clone suite runs on a loaded machine.
    engine = ScriptedEngine("e0", slow_prompts=range(2, 12), slow_once=True)
    mgr = RolloutManager(
        [engine],
        Scorer(),
        manager_config(gen_batch_size=12, train_batch_size=2, max_concurrency_per_engine=16),
        Tokenizer(),
    )
    batch = mgr.collect(Dataset([MIXED]), 0)
    assert engine.unaborted_slow == 0  # the tail was aborted, not waited for
    m = batch.metrics
    assert batch.num_groups == 2 and engine.aborts >= 1
    assert m["rollout/aborted"] == 10 and m["rollout/surplus"] == 0 and m["rollout/unused"] == 10
    assert accounted(m) == 12


class ArrivesAfterTheAbort(ScriptedEngine):
    """Its slow calls reach the engine only after the manager's first abort (calls the manager
    dispatched before the batch filled, whose threads ran after it) and then generate until an
    abort made after they arrived: an engine's abort reaches only the requests it holds, as
    SGLang's abort_all and the HF engine's do."""

    arrived = 0  # slow calls the manager has made, whether or not they reached the engine yet
    arrive_after = 1  # aborts before they reach it

    def generate(self, requests, on_result=None):
        if requests[0].prompt_ids[2] in self.slow_prompts:
            self.arrived += 1
            deadline = time.monotonic() + 30
            while self.aborts < self.arrive_after and time.monotonic() < deadline:
                time.sleep(0.01)
        return super().generate(requests, on_result)


def test_a_call_that_reaches_its_engine_after_the_abort_is_aborted_too():
    # prompts 0, 1 answer at once and fill the batch; every slow call arrives after that abort.
    # One abort would leave them generating to their end (here: until abort_timeout_s, 20 s), and
    # the step with them: the manager aborts again while calls of the tail are still out.
    engine = ArrivesAfterTheAbort("e0", slow_prompts=range(2, 12))
    mgr = RolloutManager(
        [engine],
        Scorer(),
        manager_config(
            gen_batch_size=12, train_batch_size=2, max_concurrency_per_engine=16, abort_timeout_s=20.0
        ),
        Tokenizer(),
    )
    start = time.monotonic()
    batch = mgr.collect(Dataset([MIXED]), 0)
    took = time.monotonic() - start
    assert engine.unaborted_slow == 0 and engine.blocked == 0
    assert took < 8, f"the step waited {took:.1f} s for calls that arrived after the abort"
    m = batch.metrics
    assert batch.num_groups == 2 and engine.aborts >= 2
    assert m["rollout/aborted"] == 10 and m["rollout/unused"] == 10 and accounted(m) == 12


def test_a_pause_aborts_the_calls_that_reach_their_engine_after_it_too():
    # rollout.partial's weight sync pauses the rollout and waits until no call is out; calls
    # the manager made before the pause whose requests reach the engine after its abort would
    # hold the sync until they finished generating (here: the pause's 20 s timeout)
    engine = ArrivesAfterTheAbort("e0", slow_prompts=range(4), keep_on_abort=2)
    engine.arrive_after = 2  # pause() aborts the engines, then the loop aborts each call it holds
    mgr = RolloutManager([engine], Scorer(), manager_config(partial=True), Tokenizer())
    batches = []
    collecting = threading.Thread(target=lambda: batches.append(mgr.collect(Dataset([MIXED]), 0)))
    collecting.start()
    deadline = time.monotonic() + 20
    while engine.arrived < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    start = time.monotonic()
    quiet = mgr.pause(20.0)
    took = time.monotonic() - start
    engine.slow_prompts.clear()  # the continuations answer at once
    mgr.resume()
    collecting.join(30)
    assert quiet and took < 8, f"the pause waited {took:.1f} s for calls that arrived after its abort"
    assert engine.unaborted_slow == 0 and engine.aborts >= 2
    assert len(batches) == 1 and batches[0].num_groups == 4


class LateFirstEngine(ScriptedEngine):
    """Answers the first ``late`` prompts only after every other prompt of the round is served:
    completion order is the reverse of draw order (the shared ``served`` set spans engines)."""

    def __init__(self, name, late, others, served, gate, **kw):
        super().__init__(name, **kw)
        self.late, self.others, self.all_served, self.gate = set(late), set(others), served, gate

    def generate(self, requests, on_result=None):
        if requests[0].prompt_ids[2] in self.late:
            self.gate.wait(timeout=20)  # generous: only a broken manager waits this long
        out = super().generate(requests, on_result)
        self.all_served.add(requests[0].prompt_ids[2])
        if self.others <= self.all_served:
            self.gate.set()
        return out


def _deterministic(m):
    return {k: v for k, v in m.items() if k not in TIMING_DEPENDENT_METRICS}


def test_batch_follows_draw_order_not_completion_order_with_one_or_two_engines():
    # 8 mixed/right/wrong prompts in one round, all in flight at once; prompts 0-3 finish last.
    # By draw order the batch is the first 2 mixed prompts (0 and 3), whoever finishes first.
    conf = manager_config(gen_batch_size=8, train_batch_size=2, max_concurrency_per_engine=64)
    reference = RolloutManager([ScriptedEngine("e0")], Scorer(), conf, Tokenizer())
    ref = reference.collect(Dataset([MIXED, RIGHT, WRONG]), 0)
    assert [s.prompt.index for s in ref.samples[::4]] == [0, 3]
    assert ref.metrics["rollout/keep_rate"] == pytest.approx(2 / 4)  # prompts 0-3 decided it
    for names in (["late"], ["late-a", "late-b"]):
        served, gate = set(), threading.Event()
        engines = [LateFirstEngine(n, range(4), range(4, 8), served, gate) for n in names]
        mgr = RolloutManager(engines, Scorer(), conf, Tokenizer())
        batch = mgr.collect(Dataset([MIXED, RIGHT, WRONG]), 0)
        assert [s.prompt.index for s in batch.samples[::4]] == [0, 3], names
        assert _deterministic(batch.metrics) == _deterministic(ref.metrics), names
        assert [s.response_ids for s in batch.samples] == [s.response_ids for s in ref.samples]
        assert accounted(batch.metrics) == 8
        # the keep rate that sizes the next step's rounds is the same too
        assert mgr.state_dict() == reference.state_dict()


def test_engine_death_mid_step_loses_nothing():
    dying = ScriptedEngine("dying", die_at_call=2)
    healthy = ScriptedEngine("healthy")
    mgr = RolloutManager(
        [dying, healthy],
        Scorer(),
        manager_config(gen_batch_size=8, train_batch_size=8, max_concurrency_per_engine=4),
        Tokenizer(),
    )
    batch = mgr.collect(Dataset([MIXED]), 0)
    m = batch.metrics
    assert batch.num_groups == 8 and m["rollout/engines_down"] == 1 and "dying" in mgr.pool.down
    assert sorted(dying.served + healthy.served) == list(range(8))  # every prompt served exactly once
    assert accounted(m) == 8 and m["rollout/aborted"] == 0
    assert [s.prompt.index for s in batch.samples[::4]] == list(range(8))


def test_all_engines_dead_is_a_clear_error():
    engines = [ScriptedEngine("a", die_at_call=1), ScriptedEngine("b", die_at_call=1)]
    mgr = RolloutManager(engines, Scorer(), manager_config(), Tokenizer())
    # a's two calls race: the one that marks it down says "died" or "is gone"
    with pytest.raises(NoEngineAliveError, match=r"all 2 engines are down .*a: a (died|is gone)"):
        mgr.collect(Dataset([MIXED]), 0)


def test_transient_failure_is_retried_on_another_engine_and_bounded():
    flaky, other = ScriptedEngine("flaky", fail_calls={1}), ScriptedEngine("other")
    mgr = RolloutManager([flaky, other], Scorer(), manager_config(max_concurrency_per_engine=4), Tokenizer())
    batch = mgr.collect(Dataset([MIXED]), 0)
    assert batch.num_groups == 4 and batch.metrics["rollout/retries"] == 1
    always = ScriptedEngine("always", fail_calls=set(range(1, 100)))
    mgr = RolloutManager([always], Scorer(), manager_config(max_retries=2), Tokenizer())
    with pytest.raises(EngineError, match=r"failed 3 times \(max_retries=2\).*always"):
        mgr.collect(Dataset([MIXED]), 0)


class WedgedEngine(ScriptedEngine):
    """Its first call hangs until the manager aborts it, then answers anyway (late, like a wedged
    server that recovers); ``hung_group`` is that call's prompt."""

    def __init__(self, name):
        super().__init__(name)
        self.entered, self._aborted = threading.Event(), threading.Event()
        self.hung_group = None

    def generate(self, requests, on_result=None):
        if self.hung_group is None:
            self.hung_group = requests[0].prompt_ids[2]
            self.entered.set()
            assert self._aborted.wait(60), "the manager never aborted the wedged call"
        return super().generate(requests, on_result)

    def abort(self):
        super().abort()
        self._aborted.set()


def test_timed_out_call_is_reissued_elsewhere():
    """request_timeout_s runs on the manager's clock: it stands still while the healthy engine
    serves the other three groups (one call per engine at a time), then passes the timeout with
    only the wedged call in flight. That call is aborted and retried once, on the healthy engine;
    its late answer is dropped."""
    wedged, other, scorer = WedgedEngine("wedged"), ScriptedEngine("other"), Scorer()
    cfg = manager_config(request_timeout_s=30.0, health_probe_interval_s=3600.0, max_concurrency_per_engine=4)
    mgr = RolloutManager([wedged, other], scorer, cfg, Tokenizer())
    mgr.clock = clock = StepClock()
    out = {}
    worker = threading.Thread(target=lambda: out.update(batch=mgr.collect(Dataset([MIXED]), 0)), daemon=True)
    worker.start()
    assert wedged.entered.wait(60)
    deadline = time.monotonic() + 60
    while scorer.items < 3 * 4 and time.monotonic() < deadline:  # three groups of 4
        time.sleep(0.01)
    assert scorer.items == 3 * 4 and wedged.aborts == 0 and mgr.pool.down == {}
    clock.t = 30.5
    worker.join(60)
    assert not worker.is_alive(), "the timed-out call was never re-issued"
    batch, m = out["batch"], out["batch"].metrics
    assert m["rollout/retries"] == 1 and wedged.aborts == 1
    assert sorted(other.served) == list(range(4)) and other.served[-1] == wedged.hung_group  # each once
    assert batch.num_groups == 4 and accounted(m) == m["rollout/prompts_drawn"] == 4
    assert [s.prompt.index for s in batch.samples[::4]] == list(range(4))


def test_request_seeds_depend_on_draw_position_not_engine():
    one = ScriptedEngine("one")
    RolloutManager([one], Scorer(), manager_config(), Tokenizer()).collect(Dataset([MIXED]), 5)
    a, b = ScriptedEngine("a"), ScriptedEngine("b")
    RolloutManager([a, b], Scorer(), manager_config(max_concurrency_per_engine=4), Tokenizer()).collect(
        Dataset([MIXED]), 5
    )
    assert one.seeds == {**a.seeds, **b.seeds}
    assert len(set(one.seeds.values())) == 16  # distinct per sample
    other = ScriptedEngine("other")
    RolloutManager([other], Scorer(), manager_config(), Tokenizer()).collect(Dataset([MIXED]), 6)
    assert set(other.seeds.values()).isdisjoint(one.seeds.values())  # a new weight version re-seeds


def test_over_sampling_sizes_the_next_step_from_the_keep_rate():
    mgr = RolloutManager(
        [ScriptedEngine("e0")],
        Scorer(),
        manager_config(over_sample=True, max_over_sample_factor=3.0),
        Tokenizer(),
    )
    data = Dataset([MIXED, RIGHT, WRONG])
    first = mgr.collect(data, 0).metrics
    assert first["rollout/gen_rounds"] == 3  # no estimate yet: rounds of gen_batch_size=4
    second = mgr.collect(data, 1).metrics
    # keep rate 4/10 (prompts 0-9 decided the batch) -> ceil(1.1 * 4 / 0.4) = 11 prompts: one round
    # fills the batch at the mixed prompts 0, 3, 6, 9 of the round; the 11th is unused
    assert second["rollout/gen_rounds"] == 1 and second["rollout/prompts_drawn"] == 11
    assert second["rollout/unused"] == 1 and accounted(second) == 11


def test_dump_rollouts_writes_one_line_per_sample(tmp_path):
    batch = RolloutManager([ScriptedEngine("e0")], Scorer(), manager_config(), Tokenizer()).collect(
        Dataset([MIXED]), 0
    )
    path = dump_rollouts(batch, tmp_path / "rollouts" / "step_1.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 16
    assert rows[0]["response"] == "right" and rows[0]["reward"] == 1.0 and rows[0]["acc"] is True
    assert rows[1]["length"] == 3 and rows[1]["prompt"] == "prompt 0"


def test_config_validation_names_the_field():
    # the manager's config is built from a loaded config; its ranges are checked at load
    base = ["model.path=/nonexistent"]
    with pytest.raises(ConfigError, match="algorithm.filter_groups.metric"):
        load_config(None, [*base, "algorithm.filter_groups.metric=reward"])
    with pytest.raises(ConfigError, match="algorithm.overlong_buffer.len"):
        load_config(None, [*base, "data.max_response_length=100", "algorithm.overlong_buffer.len=200"])
    cfg = load_config(None, [*base, "rollout.n=3", "trainer.mode=sync"])
    assert RolloutManagerConfig.from_config(cfg).n == 3


def test_manager_with_the_hf_engine_end_to_end(tiny_hf_checkpoint):
    """Real HF engine + real tokenizer: groups of n, rollout log-probs kept, lengths within budget."""
    from transformers import AutoTokenizer

    from megatron_dapo.rollout.hf_engine import HFEngine

    path = tiny_hf_checkpoint(vocab=128, hidden=32, heads=4, kv_heads=2)
    tok = AutoTokenizer.from_pretrained(str(path))
    engine = HFEngine(path, max_batch_size=32)
    conf = manager_config(
        n=4, gen_batch_size=3, train_batch_size=3, filter_groups_enable=False, groups_per_call=3
    )
    batch = RolloutManager([engine], Scorer(), conf, tok).collect(Dataset([MIXED]), 0)
    assert len(batch) == 12 and batch.group_index == [0] * 4 + [1] * 4 + [2] * 4
    for s in batch.samples:
        assert 1 <= s.response_length <= 8 and len(s.rollout_logprobs) == s.response_length
        assert s.response_text == tok.decode(s.response_ids, skip_special_tokens=True)
    assert (
        batch.metrics["rollout/tokens_per_s"] > 0 and 0 < batch.metrics["rollout/engine_busy_fraction"] <= 1
    )


# ---------------------------------------------------------------- scoring as responses complete
def _batch(batch):
    return [(s.prompt.index, s.response_ids, s.score, s.acc, s.final_reward) for s in batch.samples]


class HoldingEngine(ScriptedEngine):
    """Hands every response of a call over, then holds the call open until ``release``."""

    def __init__(self, name, **kw):
        super().__init__(name, **kw)
        self.release, self.holding = threading.Event(), threading.Event()

    def generate(self, requests, on_result=None):
        out = super().generate(requests, on_result)
        self.holding.set()
        assert self.release.wait(60), "the test never released the call"
        return out


def test_a_response_is_scored_while_its_call_is_still_open_and_the_batch_is_unchanged():
    """The rewards of a call's responses run while the call is still open (the engine handed them
    over); the batch equals the one scored only after each call returned (an engine that hands
    nothing over)."""
    conf = manager_config(gen_batch_size=1, train_batch_size=1)
    late = RolloutManager([ScriptedEngine("e0", hand_over=False)], Scorer(), conf, Tokenizer())
    reference = late.collect(Dataset([MIXED]), 0)
    assert reference.metrics["reward/early_fraction"] == 0.0
    engine, scorer = HoldingEngine("e0"), Scorer()
    mgr = RolloutManager([engine], scorer, conf, Tokenizer())
    out = {}
    worker = threading.Thread(target=lambda: out.update(batch=mgr.collect(Dataset([MIXED]), 0)), daemon=True)
    worker.start()
    assert engine.holding.wait(60)
    deadline = time.monotonic() + 60
    while scorer.items < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scorer.items == 4 and worker.is_alive()  # all four scored; the call has not returned
    engine.release.set()
    worker.join(60)
    batch = out["batch"]
    assert _batch(batch) == _batch(reference) and scorer.items == 4  # none scored twice
    assert batch.metrics["reward/early_fraction"] == 1.0


class SwitchingEngine(ScriptedEngine):
    """Hands over another answer (token 9: scored wrong) for every response, then returns the
    scripted one: a reward must be of the response the call returned."""

    def generate(self, requests, on_result=None):
        out = super().generate(requests)
        for r in out:
            on_result(
                GenerationResult(r.request_id, [9] + r.output_ids[1:], r.logprobs, "stop", r.weight_version)
            )
        return out


def test_a_handed_over_response_that_differs_from_the_returned_one_is_scored_again():
    conf = manager_config(gen_batch_size=1, train_batch_size=1)
    reference = RolloutManager([ScriptedEngine("e0")], Scorer(), conf, Tokenizer()).collect(
        Dataset([MIXED]), 0
    )
    scorer = Scorer()
    batch = RolloutManager([SwitchingEngine("e0")], scorer, conf, Tokenizer()).collect(Dataset([MIXED]), 0)
    assert _batch(batch) == _batch(reference) and [s.acc for s in batch.samples] == [True, False, True, False]
    assert batch.metrics["reward/early_fraction"] == 0.0 and scorer.items == 8  # 4 early, 4 again


class FailingAfterHandOver(ScriptedEngine):
    """Call 1 hands its responses over and then fails (a server that died before its reply)."""

    def generate(self, requests, on_result=None):
        out = super().generate(requests, on_result)
        if self.calls == 1:
            raise ConnectionError(f"{self.name}: connection reset after the replies")
        return out


def test_a_call_that_fails_after_handing_over_is_retried_and_each_response_scored_once():
    """The retry returns the same tokens (seeds per request): the rewards started for the failed
    call's hand-overs stand, and none is asked for twice."""
    conf = manager_config(gen_batch_size=1, train_batch_size=1)
    reference = RolloutManager([ScriptedEngine("e0")], Scorer(), conf, Tokenizer()).collect(
        Dataset([MIXED]), 0
    )
    engine, scorer = FailingAfterHandOver("e0"), Scorer()
    batch = RolloutManager([engine], scorer, conf, Tokenizer()).collect(Dataset([MIXED]), 0)
    m = batch.metrics
    assert engine.calls == 2 and m["rollout/retries"] == 1
    assert _batch(batch) == _batch(reference) and len(batch.samples) == 4
    assert scorer.items == 4 and m["reward/early_fraction"] == 1.0
