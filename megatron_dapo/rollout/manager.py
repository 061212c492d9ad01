"""The rollout manager: a dataset cursor in, a full DAPO train batch of mixed groups out.

One ``collect`` call is one rollout step:
1. draw a round of prompts (``gen_batch_size``, or an adaptive size from the observed keep rate
   when ``over_sample`` is on), one group of ``n`` requests per prompt;
2. send groups to the engines, least-outstanding first, within each engine's concurrency limit;
3. as each response completes (the engine hands it over before its call returns), decode and
   score it on a scoring thread (off the engines' critical path); once a call has returned and
   its responses are scored, add the overlong penalty and keep each group whose metric has
   spread (``mixed_group_mask``);
4. refill with new rounds until ``train_batch_size`` groups are kept or ``max_num_gen_batches``
   rounds are spent (verl's ValueError, or a partial batch when allowed);
5. the batch is decided by draw order: it is full once the groups drawn up to some position are
   all scored and hold ``train_batch_size`` kept groups (the *cut*). Only then is the tail
   aborted; every group past the cut is unused (discarded, counted), whether it had finished or
   not, so a later group never displaces an earlier one.

Failures: a call that raises or exceeds ``request_timeout_s`` is retried (up to ``max_retries``
times) on another engine when one exists; an engine whose ``health()`` turns False is marked down
and its work re-issued elsewhere; with no engine left the step fails with a clear error. An engine
that holds calls and returns nothing for ``health_probe_interval_s`` is asked ``health()`` once
(``engine_probe.InFlightProbe``); when that fails it is taken as hung: marked down, its calls
dropped (a late answer is ignored) and re-queued on the others, long before ``request_timeout_s``. Every
prompt drawn ends in exactly one bucket (batch, filtered by reason, surplus, aborted), and the
sum is asserted.

Determinism: each request's seed is a function of (seed, weight_version, the group's draw
position in the step, sample index), and each engine call carries a fixed set of requests (a
unit of ``groups_per_call`` consecutive groups), so a response does not depend on the engine
that ran it, on retries, or on timing. The batch, the filter counts and the keep rate (which
sizes the next rounds) are all computed over the groups up to the cut, so they are the same
whatever order the calls finish in, with one engine or several, idle or loaded. Only the split
of the unused tail into ``surplus`` (finished before the abort) and ``aborted`` depends on
timing (``TIMING_DEPENDENT_METRICS``); the engines' abort (which the HF engine applies to every
call in flight) only ever hits groups past the cut.

This module is the scheduling. The rest lives beside it: the engines and which of them serve in
``engine_pool.py``; the DAPO part (reward, overlong shaping, the group filter) in ``scoring.py``;
the units of work and their seeds in ``units.py``; the accounting in ``ledger.py``; the
``rollout/*`` metrics in ``rollout_metrics.py``; the JSONL dump in ``dump.py``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from megatron_dapo.config.knobs import from_config, knob
from megatron_dapo.rewards.served import Combiner
from megatron_dapo.rollout.engine import EngineError, launched_by_this_run
from megatron_dapo.rollout.engine_pool import EnginePool, healthy
from megatron_dapo.rollout.engine_probe import InFlightProbe
from megatron_dapo.rollout.episodes import EpisodeRunner, SingleTurn, tools_kwargs
from megatron_dapo.rollout.ledger import Ledger
from megatron_dapo.rollout.partial import (
    CarriedGroup,
    PartialSample,
    as_result,
    carry_from_state,
    carry_to_state,
    join,
)
from megatron_dapo.rollout.rollout_metrics import generated_samples, rollout_metrics
from megatron_dapo.rollout.scoring import GroupScoring, ModelScorer, SampleReward
from megatron_dapo.rollout.types import (
    GenerationRequest,
    GenerationResult,
    RolloutBatch,
    RolloutSample,
    SamplingParams,
)
from megatron_dapo.rollout.units import Call, Group, Unit, check_results, request_seed

logger = logging.getLogger(__name__)

_POLL_S = 0.5
# while a decided batch's tail (_stop) or a paused rollout's calls (_paused) are still out, their
# engines are aborted again this often
_REABORT_S = 0.5


class RolloutAbandoned(Exception):
    """The run is stopping (SIGTERM): the step in flight was given up; nothing of it is kept."""


class NoEngineAliveError(EngineError):
    """Every rollout engine is down; the step cannot finish."""


@dataclass
class RolloutManagerConfig:
    """Knobs of one rollout step (verl names where verl has them). Sizes count prompts (groups).

    ``max_concurrency_per_engine`` counts requests; an engine runs up to
    ``max(1, max_concurrency_per_engine // (n * groups_per_call))`` calls at once, each call
    carrying ``groups_per_call`` groups (1 suits SGLang, which batches across calls; the HF
    engine batches within a call, so give it more). ``over_sample``: after the first round of
    a run, a round draws ``ceil(1.1 * needed / keep_rate)`` prompts, clamped to
    ``[needed, max_over_sample_factor * needed]``, instead of ``gen_batch_size``.

    ``partial`` (``rollout.partial``): the groups past the cut are not discarded but carried to
    the next ``collect``, their aborted responses continued there (``rollout/partial.py``).
    ``partial_max_lag``: a carried response whose oldest token is more than this many versions
    behind the next rollout's weights starts over (its tokens are dropped and counted); None
    means no bound (sync mode, where no staleness bound exists), 0 in one_step_off/async, whose
    batches must not hold tokens older than the version they are generated with.
    """

    n: int = knob("rollout.n")
    gen_batch_size: int = knob("rollout.gen_batch_size")
    train_batch_size: int = knob("trainer.train_batch_size")
    max_num_gen_batches: int = knob("algorithm.filter_groups.max_num_gen_batches")
    filter_groups_enable: bool = knob("algorithm.filter_groups.enable")
    filter_metric: str = knob("algorithm.filter_groups.metric")
    allow_partial_batch: bool = knob("algorithm.allow_partial_batch")
    overlong_buffer_enable: bool = knob("algorithm.overlong_buffer.enable")
    overlong_buffer_len: int = knob("algorithm.overlong_buffer.len")
    overlong_penalty_factor: float = knob("algorithm.overlong_buffer.penalty_factor")
    max_response_length: int = knob("data.max_response_length")
    temperature: float = knob("rollout.temperature")
    top_p: float = knob("rollout.top_p")
    top_k: int = knob("rollout.top_k")
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int = knob("trainer.seed")
    over_sample: bool = knob("rollout.over_sample")
    max_over_sample_factor: float = knob("rollout.max_over_sample_factor")
    max_concurrency_per_engine: int = knob("rollout.max_concurrency_per_engine")
    groups_per_call: int = knob("rollout.groups_per_call")
    request_timeout_s: float = knob("rollout.request_timeout_s")
    max_retries: int = knob("rollout.max_retries")
    abort_timeout_s: float = 60.0
    partial: bool = knob("rollout.partial")
    partial_max_lag: int | None = None
    # an engine with calls in flight that returned nothing for this long is asked health() once
    health_probe_interval_s: float = knob("rollout.health_probe_interval_s")

    @classmethod
    def from_config(cls, cfg: Any) -> RolloutManagerConfig:
        """Build from the run's ``DAPOConfig``, validated when it was loaded (``config/validate.py``)."""
        mt = cfg.rollout.multi_turn
        # an aborted episode first finishes the tool calls its last turn made (each bounded by
        # tool_timeout_s), so the abort's wait covers one of them
        abort_s = max(cls.abort_timeout_s, mt.tool_timeout_s + 30.0) if mt.enable else cls.abort_timeout_s
        return from_config(
            cls, cfg, partial_max_lag=None if cfg.trainer.mode == "sync" else 0, abort_timeout_s=abort_s
        )


class RolloutManager:
    """Collects DAPO train batches from a set of engines.

    Args:
        engines: objects following :class:`~megatron_dapo.rollout.engine.RolloutEngine`.
        scorer: a :class:`~megatron_dapo.rewards.scorer.Scorer` (``score_many``).
        cfg: :class:`RolloutManagerConfig`.
        tokenizer: decodes response ids to text for the reward (``decode(ids, skip_special_tokens=True)``).
        episodes: what one engine call runs (``rollout/episodes.py``): ``SingleTurn`` by default,
            ``agent.runner.MultiTurn`` for tool-use episodes.
        reward_model, combiner: ``reward.model``'s client and ``reward.combine`` (scoring.py).
            Each response is scored as soon as its engine hands it over (``on_result``), while
            the rest of its call and the other calls still generate.
    """

    def __init__(
        self,
        engines: list[Any],
        scorer: Any,
        cfg: RolloutManagerConfig,
        tokenizer: Any,
        episodes: EpisodeRunner | None = None,
        reward_model: ModelScorer | None = None,
        combiner: Combiner | None = None,
    ):
        if not engines:
            raise ValueError("RolloutManager needs at least one engine")
        names = [e.name for e in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique, got {names}")
        self.pool = EnginePool(engines)  # the engines and which of them serve
        self.cfg = cfg
        self.episodes = episodes or SingleTurn()
        # reward, overlong shaping, the filter
        self.scoring = GroupScoring(cfg, scorer, tokenizer, reward_model, combiner)
        # the scoring threads: a served model with a loop of its own (submit) takes each response
        # as a coroutine, so threads only decode and run the rule; one that blocks a thread per
        # response gets as many as its servers take at once
        if reward_model is None or hasattr(reward_model, "submit"):
            self._score_workers = 4
        else:
            self._score_workers = max(1, min(int(reward_model.concurrency), 256))
        self._keep_rate: float | None = None  # last observed, drives over-sampling
        self._zombies: dict[Future, Call] = {}  # timed-out calls whose threads have not returned
        # set by the trainer: True once the run must stop; a step in flight is then abandoned
        self.should_stop: Any = None
        # rollout.partial: the groups the last rollout left past its cut, continued by the next
        self._carry: list[CarriedGroup] = []
        # rollout.partial: pause()/resume() around a weight sync while a rollout runs on
        # another thread (one_step_off/async); guarded by _cond
        self._cond = threading.Condition()
        self._pausing = False
        self._quiet = False  # paused with no engine call in flight
        self._pause_aborted_at = 0.0  # when the paused calls' engines were last aborted
        self._collecting = False
        # pauses so far: a call dispatched before the latest one may come back aborted by it
        # before the loop has seen the pause (pause() aborts the engines itself)
        self._pauses = 0
        self.clock = time.monotonic  # of the hang probe and the request timeout; tests step a fake one
        self._probe: InFlightProbe | None = None

    # -- public ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to draw the same round sizes (the over-sampling keep rate)."""
        return {"keep_rate": self._keep_rate}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._keep_rate = state.get("keep_rate")

    def partial_state_dict(self) -> dict[str, Any]:
        """rollout.partial: the carried groups (tokens, log-probs, versions) as JSON-able data; kept
        apart from :meth:`state_dict` so a checkpoint can store it in its own field."""
        return carry_to_state(self._carry)

    def load_partial_state_dict(self, state: dict[str, Any]) -> None:
        self._carry = carry_from_state(state)

    def partial_groups(self) -> list[CarriedGroup]:
        """rollout.partial: the carried groups themselves (a checkpoint stores them in its carried
        file, driver/run_state.py); not copies, so the caller must not change them."""
        return list(self._carry)

    def load_partial_groups(self, groups: list[CarriedGroup]) -> None:
        self._carry = list(groups)

    def pause(self, timeout_s: float) -> bool:
        """rollout.partial, from another thread: stop the rollout in flight for a weight sync.

        Every engine call in flight is aborted and returns what it generated so far, which is
        kept (its requests continue after :meth:`resume`, with whatever weights the engines
        then hold); no call starts until then. Returns once no call is in flight (True), or
        False after ``timeout_s``. Without a rollout in flight it returns at once; one that
        starts while paused waits too."""
        if not self.cfg.partial:
            raise ValueError(
                "RolloutManager.pause needs rollout.partial=true (set it, or wait for the rollout)"
            )
        with self._cond:
            self._pausing = True
            self._pauses += 1
            self._cond.notify_all()
            collecting = self._collecting
        if collecting:
            # abort here rather than wait for the rollout loop's next poll to do it; the loop
            # still aborts any call it dispatched just before it saw the pause
            self._abort_all(self.pool.alive())
        with self._cond:
            return self._cond.wait_for(lambda: self._quiet or not self._collecting, timeout_s)

    def resume(self) -> None:
        """Let the paused rollout continue (after the weight sync)."""
        with self._cond:
            self._pausing = False
            self._quiet = False
            self._cond.notify_all()

    def collect(self, dataset: Any, weight_version: int) -> RolloutBatch:
        """One rollout step: a batch of ``train_batch_size`` mixed groups (see the module doc)."""
        with self._cond:
            self._collecting = True
        try:
            return self._collect(dataset, weight_version)
        finally:
            with self._cond:
                self._collecting = False
                self._cond.notify_all()

    def _collect(self, dataset: Any, weight_version: int) -> RolloutBatch:
        cfg = self.cfg
        ledger = Ledger([e.name for e in self.pool], cfg.train_batch_size)
        self.scoring.begin_step()
        # rollout.partial: the previous rollout's tail goes first in draw order (it was drawn
        # earlier), so it is used before anything new; self._carry changes only on success, so
        # an abandoned or failed rollout leaves it as it was
        resume = self._resumable(weight_version, ledger) if cfg.partial else []
        t0 = time.perf_counter()
        partial_batch = False
        while ledger.cut is None:
            self._check_stop()
            if cfg.max_num_gen_batches and ledger.rounds >= cfg.max_num_gen_batches:
                # every round ran to completion: all drawn groups are scored
                if cfg.allow_partial_batch and ledger.prefix_kept:
                    partial_batch = True
                    logger.warning(
                        "rollout: %d generation rounds spent with %d/%d groups kept; training on a partial batch",
                        ledger.rounds,
                        ledger.prefix_kept,
                        cfg.train_batch_size,
                    )
                    break
                ledger.settle()
                ledger.check(len(ledger.kept))
                # a reward that fails, not the data, when most responses failed in it
                self.scoring.check_step(generated_samples(ledger), ledger.filtered, ledger.unscored)
                raise ValueError(
                    f"num_gen_batches={ledger.rounds} >= max_num_gen_batches={cfg.max_num_gen_batches} with only "
                    f"{len(ledger.kept)}/{cfg.train_batch_size} mixed groups (filtered: {ledger.filtered}). Generated "
                    "too many. Please check if your data are too difficult. You could also try set "
                    "max_num_gen_batches=0 to enable endless trials (or allow_partial_batch=true)."
                )
            size = self._round_size(cfg.train_batch_size - ledger.prefix_kept)
            groups = [Group(ledger.drawn + i, c.prompt, carried=c) for i, c in enumerate(resume)]
            if size > len(resume):
                prompts = dataset.next_batch(size - len(resume))
                groups += [Group(ledger.drawn + len(resume) + i, p) for i, p in enumerate(prompts)]
            ledger.resumed += len(resume)
            resume = []
            ledger.drawn += len(groups)
            ledger.rounds += 1
            self._run_round(groups, weight_version, ledger)
        wall = time.perf_counter() - t0

        if cfg.partial and ledger.cut is not None:
            self._carry_tail(ledger)
        ledger.settle()
        # a batch left partial because the reward model left its groups unscored is the reward
        # model's failure, named as such, not a batch too small to train on; a full batch trains
        self.scoring.check_step(
            generated_samples(ledger), ledger.filtered if partial_batch else {}, ledger.unscored
        )
        if ledger.scored_groups:
            self._keep_rate = max(len(ledger.kept), 1) / ledger.scored_groups
        batch_groups = ledger.kept
        samples = []
        for gid, group in enumerate(batch_groups):
            for s in group.samples:
                s.group_id = gid
                samples.append(s)
        ledger.check(len(batch_groups))
        if cfg.partial:
            self._carry = ledger.carry_out
        metrics = rollout_metrics(cfg, self.pool, samples, ledger, wall, weight_version)
        metrics.update(self.scoring.metrics())
        return RolloutBatch(samples, metrics)

    def _resumable(self, version: int, ledger: Ledger) -> list[CarriedGroup]:
        """The carried groups, each response older than ``partial_max_lag`` started over."""
        lag = self.cfg.partial_max_lag
        out = []
        for group in self._carry:
            samples = []
            for s in group.samples:
                oldest = s.oldest_version()
                if lag is not None and oldest is not None and version - oldest > lag:
                    ledger.restarted_tokens += len(s.output_ids)
                    s = PartialSample()
                samples.append(s)
            out.append(CarriedGroup(group.prompt, samples))
        return out

    # -- rounds -----------------------------------------------------------------------------

    def _round_size(self, needed: int) -> int:
        cfg = self.cfg
        if not cfg.over_sample or self._keep_rate is None:
            return cfg.gen_batch_size
        want = math.ceil(1.1 * needed / max(self._keep_rate, 1e-6))
        return int(min(max(want, needed), math.ceil(cfg.max_over_sample_factor * needed)))

    def _units(self, groups: list[Group], version: int) -> deque[Unit]:
        cfg = self.cfg
        units: deque[Unit] = deque()
        for start in range(0, len(groups), cfg.groups_per_call):
            chunk = groups[start : start + cfg.groups_per_call]
            requests = [
                GenerationRequest(
                    request_id=f"v{version}-g{g.serial}-s{j}",
                    prompt_ids=list(g.prompt.prompt_ids),
                    sampling=SamplingParams(
                        temperature=cfg.temperature,
                        top_p=cfg.top_p,
                        top_k=cfg.top_k,
                        max_new_tokens=cfg.max_response_length,
                        stop_token_ids=list(cfg.stop_token_ids),
                        seed=request_seed(cfg.seed, version, g.serial, j),
                    ),
                    tools_kwargs=tools_kwargs(g.prompt),
                )
                for g in chunk
                for j in range(cfg.n)
            ]
            unit = Unit(chunk, requests)
            if any(g.carried is not None for g in chunk):
                for gi, g in enumerate(chunk):
                    for j, s in enumerate(g.carried.samples if g.carried is not None else []):
                        rid = requests[gi * cfg.n + j].request_id
                        if s.finished:
                            unit.held[rid] = s
                        elif s.output_ids or s.interrupted:
                            unit.prefix[rid] = s
                unit.replan()
            units.append(unit)
        return units

    def _run_round(self, groups: list[Group], version: int, ledger: Ledger) -> None:
        """Generate and score ``groups`` until all are done or the batch is decided."""
        queue = self._units(groups, version)
        calls: dict[Future, Call] = {}
        scoring: dict[Future, Scored] = {}  # each response's reward -> its unit's scoring
        gen_pool = ThreadPoolExecutor(
            max_workers=min(self._slots * len(self.pool), 512), thread_name_prefix="rollout"
        )
        score_pool = ThreadPoolExecutor(max_workers=self._score_workers, thread_name_prefix="reward")
        for unit in queue:
            ledger.units.update((g.serial, unit) for g in unit.groups)
        paused_calls: set[Future] = set()  # calls aborted for a pause (their aborts are kept)
        self._probe = InFlightProbe(self.cfg.health_probe_interval_s, self.clock)
        try:
            for unit in [u for u in queue if not u.send]:  # carried groups already finished
                queue.remove(unit)
                self._to_scoring(unit, [], scoring, score_pool, ledger)
            while queue or calls or scoring:
                if self.should_stop is not None and self.should_stop():
                    self._abort_engines(calls)
                    self._check_stop()
                if ledger.cut is not None:
                    self._stop(queue, calls, scoring, ledger)
                    return
                paused = self.cfg.partial and self._paused(calls, paused_calls)
                if not paused:
                    self._dispatch(queue, calls, gen_pool, score_pool, ledger)
                    if queue and not self.pool.alive():
                        raise NoEngineAliveError(self.pool.down_message())
                pending = list(calls) + list(scoring) + list(self._zombies) + self._probe.futures()
                if paused and not pending:  # nothing to collect: sleep until resumed
                    with self._cond:
                        self._cond.wait_for(lambda: not self._pausing, _POLL_S)
                    continue
                done, _ = wait(pending, timeout=_POLL_S, return_when=FIRST_COMPLETED)
                for fut in done:
                    if fut in scoring:
                        self._scored(scoring.pop(fut), fut, ledger)
                    elif fut in calls:
                        call = calls.pop(fut)
                        self._probe.heard(call.engine.name)
                        self._record_interval(call, ledger)
                        if fut in paused_calls or call.pauses != self._pauses:
                            paused_calls.discard(fut)
                            if self._requeue_paused(call, fut, queue, ledger):
                                continue
                        self._finish_call(call, fut, queue, scoring, score_pool, ledger)
                    elif fut in self._zombies:  # a timed-out call came back late: its result is dropped
                        self._record_interval(self._zombies.pop(fut), ledger)
                self._expire(calls, queue, ledger)
                self._find_hung(calls, queue, ledger)
        finally:
            self._probe.close()
            gen_pool.shutdown(wait=False, cancel_futures=True)
            # rewards started early for responses past the cut are not needed: the queued ones go
            score_pool.shutdown(wait=True, cancel_futures=True)
            if ledger.cut is not None:
                # an engine may have handed a response over while the tail was being stopped:
                # its request is cancelled too (the pool is shut, so none can start after this)
                self._cancel_early(ledger)

    def _paused(self, calls: dict[Future, Call], paused_calls: set[Future]) -> bool:
        """While :meth:`pause` holds: abort each call in flight once, and report quiet once none
        is left. True when the loop must not dispatch now."""
        with self._cond:
            if not self._pausing:
                return False
            if not calls:
                self._quiet = True
                self._cond.notify_all()
        fresh = {f: c for f, c in calls.items() if f not in paused_calls}
        if fresh:
            paused_calls.update(fresh)
            self._abort_engines(fresh)
            self._pause_aborted_at = time.monotonic()
        elif calls and time.monotonic() - self._pause_aborted_at >= _REABORT_S:
            # a call whose request reached its engine after the abort generates on: again
            self._abort_engines(calls)
            self._pause_aborted_at = time.monotonic()
        return True

    def _requeue_paused(self, call: Call, fut: Future, queue: deque[Unit], ledger: Ledger) -> bool:
        """A call a pause aborted: keep what it generated and queue the rest (not a failure, no
        retry counted). False when it finished anyway or failed (the normal path takes it)."""
        if fut.exception() is not None:
            return False
        results = fut.result()
        if not isinstance(results, list) or {getattr(r, "request_id", None) for r in results} != {
            q.request_id for q in call.unit.send
        }:
            return False
        if not any(r.finish_reason == "abort" for r in results):
            return False
        ledger.tokens += call.unit.fold(results)
        queue.appendleft(call.unit)
        return True

    def _check_stop(self) -> None:
        if self.should_stop is not None and self.should_stop():
            raise RolloutAbandoned("the run is stopping: rollout abandoned")

    def _abort_engines(self, calls: dict[Future, Call]) -> None:
        for call in calls.values():
            call.stop.set()
        self._abort_all({c.engine.name: c.engine for c in calls.values()}.values())

    def _abort_all(self, engines) -> None:
        for engine in engines:
            try:
                engine.abort()
            except Exception as e:  # noqa: BLE001 - stopping anyway
                logger.warning("rollout: abort on engine %s failed: %s", engine.name, e)

    @property
    def _slots(self) -> int:
        return max(1, self.cfg.max_concurrency_per_engine // (self.cfg.n * self.cfg.groups_per_call))

    def _dispatch(
        self,
        queue: deque[Unit],
        calls: dict[Future, Call],
        pool: ThreadPoolExecutor,
        score_pool,
        ledger: Ledger,
    ) -> None:
        """Start queued units on engines with free slots, least outstanding calls first; each
        response the engine hands over before the call returns is scored at once."""
        while queue:
            alive = self.pool.alive()
            load = {e.name: 0 for e in alive}
            for c in [*calls.values(), *self._zombies.values()]:  # a stuck call still holds its slot
                if c.engine.name in load:
                    load[c.engine.name] += 1
            free = [e for e in alive if load[e.name] < self._slots]
            if not free:
                return
            unit = queue.popleft()
            # a retried unit avoids the engine that failed it when another one has room
            free.sort(key=lambda e: (e.name == unit.avoid, load[e.name]))
            engine = free[0]
            if self._probe is not None:  # before the call starts: its silence counts from here
                self._probe.busy(engine.name)
            call = Call(unit, engine, time.perf_counter(), self.clock(), threading.Event(), self._pauses)

            def on_result(result: GenerationResult, call: Call = call) -> None:
                self._score_early(call, result, score_pool, ledger)

            calls[pool.submit(self.episodes.run, engine, unit.send, call.stop, on_result)] = call

    def _finish_call(self, call: Call, fut: Future, queue, scoring, score_pool, ledger: Ledger) -> None:
        """Hand a finished call's results to scoring, or retry it."""
        unit, engine = call.unit, call.engine
        error = fut.exception()
        results: list[GenerationResult] = [] if error is not None else fut.result()
        if error is None:
            error = check_results(unit, results)
        if error is None:
            self.pool.mark_heard(engine.name)
            ledger.tokens += sum(len(r.output_ids) for r in results)
            self._to_scoring(unit, results, scoring, score_pool, ledger)
            return
        if self.cfg.partial and isinstance(results, list):
            # an abort that hit this call (another call's timeout on the same engine): the
            # retry continues what it generated instead of starting over
            ledger.tokens += unit.fold([r for r in results if isinstance(r, GenerationResult)])
        self._retry(unit, engine, error, queue, ledger)

    def _score_early(self, call: Call, result: GenerationResult, score_pool, ledger: Ledger) -> None:
        """``on_result``, on the engine's thread: start this response's reward now. It must not
        block (an SGLang engine calls it from its event loop) nor raise into the engine."""
        unit = call.unit
        if call.stop.is_set() or result.request_id not in unit:
            return
        rid = result.request_id
        # rollout.partial: a continuation's answer joined to the tokens before it is the response
        full = join(unit.prefix.get(rid), result) if self.cfg.partial else result
        started = unit.early.get(rid)
        if started is not None and _same_response(started[0], full):
            return  # an earlier call of this unit handed the same response over: it is scoring
        try:
            fut = self._start_reward(unit, rid, full, score_pool, ledger)
        except RuntimeError:  # the round is over (its scoring pool is shut): nobody needs it
            return
        unit.early[rid] = (full, fut)

    def _to_scoring(
        self,
        unit: Unit,
        results: list[GenerationResult],
        scoring: dict[Future, Scored],
        score_pool,
        ledger: Ledger,
    ) -> None:
        """Every response of a finished call to scoring: the reward already started for it when
        an engine handed the same response over early, else a new one."""
        if self.cfg.partial:
            unit.fold(results)  # every answer is complete: all of them are held now
            by_id = {rid: as_result(rid, s) for rid, s in unit.held.items()}
        else:
            by_id = {r.request_id: r for r in results}
        scored = Scored(unit, by_id)
        for rid, res in by_id.items():
            started = unit.early.get(rid)
            if started is not None and _same_response(started[0], res):
                fut = started[1]
                ledger.scored_early += 1
            else:
                fut = self._start_reward(unit, rid, res, score_pool, ledger)
            scored.pending[fut] = rid
            scoring[fut] = scored
        ledger.scored_responses += len(by_id)

    def _scored(self, scored: Scored, fut: Future, ledger: Ledger) -> None:
        """One response's reward is in (a failure raises here and ends the step); once its
        unit's last is, build the groups and judge them."""
        scored.rewards[scored.pending.pop(fut)] = fut.result()
        if not scored.pending:
            unit = scored.unit
            self._classify(unit.groups, self.scoring.samples(unit, scored.by_id, scored.rewards), ledger)

    def _start_reward(
        self, unit: Unit, request_id: str, result: GenerationResult, score_pool, ledger: Ledger
    ):
        """One response's reward, started (``GroupScoring.start``), and when it ran (how much of
        the scoring hid behind generation)."""
        start = time.perf_counter()
        fut = self.scoring.start(unit, request_id, result, ledger.model_outcomes, score_pool)
        fut.add_done_callback(lambda f: ledger.score_intervals.append((start, time.perf_counter())))
        return fut

    def _retry(self, unit: Unit, engine: Any, error: BaseException | str, queue, ledger: Ledger) -> None:
        groups = [g.serial for g in unit.groups]
        if not healthy(engine):
            self.pool.mark_down(engine.name, str(error))
            logger.error("rollout: engine %s is down (%s); re-issuing groups %s", engine.name, error, groups)
        else:
            unit.attempts += 1
            if unit.attempts > self.cfg.max_retries:
                raise EngineError(
                    f"rollout: groups {groups} failed {unit.attempts} times (max_retries={self.cfg.max_retries}); "
                    f"last failure on engine {engine.name}: {error}"
                )
            ledger.retries += 1
            logger.warning("rollout: engine %s failed groups %s (%s); retrying", engine.name, groups, error)
        unit.avoid = engine.name
        queue.appendleft(unit)

    def _expire(self, calls: dict[Future, Call], queue: deque[Unit], ledger: Ledger) -> None:
        now = self.clock()
        for fut, call in list(calls.items()):
            if now - call.since > self.cfg.request_timeout_s:
                del calls[fut]
                self._zombies[fut] = call  # its thread may still return; the result is dropped
                call.stop.set()
                call.engine.abort()
                self._retry(
                    call.unit,
                    call.engine,
                    f"call timed out after {self.cfg.request_timeout_s:g}s (rollout.request_timeout_s)",
                    queue,
                    ledger,
                )

    def _find_hung(self, calls: dict[Future, Call], queue: deque[Unit], ledger: Ledger) -> None:
        """Probe the engines that hold calls and went silent; a failed probe takes one as hung."""
        busy = {c.engine.name: c.engine for c in calls.values()}
        for engine in self.pool:
            if engine.name not in busy:
                self._probe.idle(engine.name)
        for engine, silent_s in self._probe.poll(busy):
            self._drop_hung(engine, silent_s, calls, queue, ledger)

    def _drop_hung(self, engine: Any, silent_s: float, calls, queue: deque[Unit], ledger: Ledger) -> None:
        """Mark a hung engine down and put its calls back in the queue, first in line.

        Its calls become zombies: their threads return when the server is killed (or answers after
        all), and the results are dropped, so no group is counted twice. The engine is not sent an
        abort from here (that would wait on the hung server); a background thread tries."""
        stuck = sorted(
            (f for f, c in calls.items() if c.engine is engine), key=lambda f: calls[f].unit.groups[0].serial
        )
        for fut in reversed(stuck):
            call = calls.pop(fut)
            call.stop.set()
            self._zombies[fut] = call
            call.unit.avoid = engine.name
            queue.appendleft(call.unit)
        client = getattr(engine, "client", None)
        url = getattr(client, "base_url", None)
        timeout = getattr(client, "health_timeout_s", None)
        failed = (
            f"GET {url}/health unanswered within {timeout:g}s"
            if url and timeout
            else "its health check failed"
        )
        what = f"no reply for {silent_s:.0f}s to {len(stuck)} calls in flight and {failed}"
        self.pool.mark_down(engine.name, f"hung ({what})")
        ledger.hung.append(engine.name)
        alive = [e.name for e in self.pool.alive()]
        knobs = "rollout.health_probe_interval_s, rollout.sglang.health_timeout_s"
        restartable = launched_by_this_run(engine)
        if not alive and not restartable:
            where = f"the server at {url} (engine {engine.name})" if url else f"engine {engine.name}"
            given = "it was given by rollout.sglang.urls, so" if url else "it was not started by this run, so"
            raise NoEngineAliveError(
                f"rollout: {where} hung: {what}; {given} this run cannot restart it and no other "
                f"engine is left: restart it and resume the run (a slow server, not a hung one: raise {knobs})"
            )
        later = (
            "it is restarted before the next weight sync"
            if restartable
            else "it was not started by this run, which continues without it"
        )
        groups = [g.serial for f in stuck for g in self._zombies[f].unit.groups]
        logger.error(
            "rollout: engine %s hung: %s; groups %s re-queued on %s; %s (%s)",
            engine.name,
            what,
            groups,
            ", ".join(alive) or "it once restarted",
            later,
            knobs,
        )
        threading.Thread(target=_abort_quietly, args=(engine,), name="abort-hung", daemon=True).start()

    def _stop(self, queue: deque[Unit], calls: dict[Future, Call], scoring, ledger: Ledger) -> None:
        """The batch is decided: abort the tail (all of it past the cut) and let it settle, so no
        call of this step still runs when the weights change; ``settle`` counts it as unused."""
        queue.clear()
        for call in calls.values():
            call.stop.set()
        self._abort_all({c.engine.name: c.engine for c in calls.values()}.values())
        # rewards past the cut are not needed: not waited for, and a served model's requests
        # cancelled (a slow judge would hold the step for its every retry)
        for fut in scoring:
            fut.cancel()
        self._cancel_early(ledger)
        # An engine's abort reaches the requests it holds; a call dispatched before the abort
        # whose request reaches the engine after it would generate to its end (with SGLang and
        # long responses, minutes). So while calls are out, their engines are aborted again.
        deadline = time.monotonic() + self.cfg.abort_timeout_s
        _, not_done = wait(calls, timeout=min(_REABORT_S, self.cfg.abort_timeout_s))
        while not_done and (left := deadline - time.monotonic()) > 0:
            self._abort_engines({f: calls[f] for f in not_done})
            _, not_done = wait(not_done, timeout=min(_REABORT_S, left))
        done = set(calls) - not_done
        for fut, call in list(calls.items()):
            if fut in done:
                self._record_interval(call, ledger)
            complete = (
                fut in done and fut.exception() is None and check_results(call.unit, fut.result()) is None
            )
            if complete:
                ledger.generated.update(g.serial for g in call.unit.groups)
            if fut in done and fut.exception() is None and isinstance(fut.result(), list):
                results = [r for r in fut.result() if isinstance(r, GenerationResult)]
                # generated (and, with rollout.partial, kept for the next rollout, which then
                # counts only what it adds)
                ledger.tokens += (
                    call.unit.fold(results) if self.cfg.partial else sum(len(r.output_ids) for r in results)
                )
        if any(f in not_done for f in calls):
            logger.warning("rollout: %d engine calls did not return within abort_timeout_s", len(not_done))
        calls.clear()
        for scored in scoring.values():
            ledger.generated.update(g.serial for g in scored.unit.groups)
        scoring.clear()

    def _cancel_early(self, ledger: Ledger) -> None:
        """Cancel every reward started early that is still running (past the cut: the groups
        before it are all scored)."""
        for unit in {id(u): u for u in ledger.units.values()}.values():
            for _, fut in list(unit.early.values()):
                fut.cancel()

    def _carry_tail(self, ledger: Ledger) -> None:
        """rollout.partial: every group past the cut, with what it generated (finished responses
        whole, aborted ones up to the abort, unstarted ones empty), for the next rollout. A call
        that did not return in time leaves its groups as they were before it (its late answer is
        never read), so nothing is counted twice."""
        n = self.cfg.n
        for serial in range(ledger.cut, ledger.drawn):
            unit = ledger.units[serial]
            gi = next(i for i, g in enumerate(unit.groups) if g.serial == serial)
            samples = []
            for req in unit.requests[gi * n : (gi + 1) * n]:
                rid = req.request_id
                samples.append(unit.held.get(rid) or unit.prefix.get(rid) or PartialSample())
            ledger.carry_out.append(CarriedGroup(unit.groups[gi].prompt, samples))

    # -- scoring ------------------------------------------------------------------------------

    # -- scoring and bookkeeping ----------------------------------------------------------------

    def _classify(self, groups: list[Group], scored: list[list[RolloutSample]], ledger: Ledger) -> None:
        for g, samples in zip(groups, scored):
            g.samples = samples
            outcome, spread = self.scoring.judge(samples)
            if not spread:
                ledger.zero_spread_serials.add(g.serial)
            ledger.record(g, outcome)

    def _record_interval(self, call: Call, ledger: Ledger) -> None:
        ledger.intervals[call.engine.name].append((call.start, time.perf_counter()))


@dataclass
class Scored:
    """A finished call's scoring: its responses, and their rewards as they come in."""

    unit: Unit
    by_id: dict[str, GenerationResult]
    pending: dict[Future, str] = field(default_factory=dict)  # reward future -> request id
    rewards: dict[str, SampleReward] = field(default_factory=dict)


def _same_response(early: GenerationResult, final: GenerationResult) -> bool:
    """The response scored early is the one the call returned: same tokens, same episode (a
    reward reads nothing else of it), so its reward stands."""
    if early.output_ids != final.output_ids or (early.episode is None) != (final.episode is None):
        return False
    return early.episode is None or early.episode.as_dict() == final.episode.as_dict()


def _abort_quietly(engine: Any) -> None:
    try:
        engine.abort()
    except Exception as e:  # noqa: BLE001 - a hung engine may not answer; it is down anyway
        logger.info("rollout: abort on hung engine %s: %s", engine.name, e)
