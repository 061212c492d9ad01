"""One reward model (``reward.model``) as the trainer uses it: an async API for code that runs an
event loop (scoring each sample as its response completes), and a blocking one that scores a list
of samples concurrently from a plain thread.

Servers: those the run started for ``reward.model.path`` (their URLs are passed in), or the one
at ``reward.model.url``. A classifier's conversation and a served judge's prompt are tokenised
here, with the model's own tokenizer: ``reward.model.path``'s, or for a classifier given by URL
the ``tokenizer_path`` the server reports (``GET /model_info``), which must be readable here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from megatron_dapo.rewards.served.classifier import ClassifierClient, load_tokenizer
from megatron_dapo.rewards.served.judge import JudgeClient, judge_api
from megatron_dapo.rewards.served.outcome import RewardModelError, RewardSample, ScoreOutcome
from megatron_dapo.rewards.served.settings import ServedRewardSettings
from megatron_dapo.rewards.served.transport import ServerPool


class RewardModel:
    """Async scoring by one reward model; create it with :func:`open_reward_model` inside the
    event loop that will use it."""

    def __init__(self, settings: ServedRewardSettings, scorer: ClassifierClient | JudgeClient):
        self.settings = settings
        self.scorer = scorer
        self.pool: ServerPool = scorer.pool

    async def score(self, sample: RewardSample) -> ScoreOutcome:
        """One sample's outcome. Raises (one line) on an HTTP 4xx, a server down past
        ``down_grace_s``, or a user function that fails; every other failure is an outcome."""
        return await self.scorer.score(sample)

    async def score_many(self, samples: Sequence[RewardSample]) -> list[ScoreOutcome]:
        """All samples at once (each server holds at most ``max_in_flight`` of them), in order.
        The first error raised cancels the rest and is raised."""
        tasks = [asyncio.ensure_future(self.score(s)) for s in samples]
        if not tasks:
            return []
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception()]
        if failed:
            for t in pending:
                t.cancel()
            # gathered, so that no other task's error is reported later as never retrieved
            await asyncio.gather(*pending, return_exceptions=True)
            raise failed[0].exception()
        return [t.result() for t in tasks]

    def check_down(self) -> None:
        """Raise :class:`RewardServerDown` when a server has been down past ``down_grace_s``."""
        self.pool.check_down()

    async def aclose(self) -> None:
        await self.pool.aclose()


def _pool(settings: ServedRewardSettings, urls: Sequence[str], api_key: str | None) -> ServerPool:
    return ServerPool(
        urls,
        timeout_s=settings.timeout_s,
        max_retries=settings.max_retries,
        max_in_flight=settings.max_in_flight,
        down_grace_s=settings.down_grace_s,
        api_key=api_key,
        what=f"reward {settings.kind}",
    )


async def _tokenizer_path(settings: ServedRewardSettings, pool: ServerPool) -> str:
    if settings.path is not None:
        return settings.path
    try:
        info = await pool.get("/model_info")
        reported = info.get("tokenizer_path") or info.get("model_path")
    except Exception as e:  # noqa: BLE001 - any failure here has the same fix
        raise RewardModelError(
            f"reward.model.url={settings.url}: cannot ask the server for its tokenizer (GET /model_info: {e}); "
            "a classifier needs an SGLang server started with --is-embedding"
        ) from e
    if not reported or not Path(str(reported)).is_dir():
        raise RewardModelError(
            f"reward.model.url={settings.url}: the classifier's conversations are rendered here with its chat "
            f"template, and the server's tokenizer_path {reported!r} is not a directory on this machine; "
            "serve the model with reward.model.path instead, or make that path readable here"
        )
    return str(reported)


async def open_reward_model(
    settings: ServedRewardSettings,
    urls: Sequence[str] | None = None,
    *,
    api_key: str | None = None,
) -> RewardModel:
    """The reward model behind ``urls`` (the servers the run started for ``settings.path``), or
    behind ``settings.url`` when ``urls`` is None."""
    if urls is None:
        if settings.url is None:
            raise RewardModelError(
                "reward.model.path is served by the run: pass the URLs of the servers it started"
            )
        urls = [settings.url]
    pool = _pool(settings, urls, api_key)
    try:
        if settings.kind == "classifier":
            tokenizer = load_tokenizer(
                await _tokenizer_path(settings, pool), f"reward.model ({settings.kind})"
            )
            scorer = ClassifierClient(pool, tokenizer, settings.transform)
        else:
            api = judge_api(settings.url)
            tokenizer = load_tokenizer(settings.path, "reward.model (judge)") if api == "sglang" else None
            scorer = JudgeClient(
                pool,
                api=api,
                tokenizer=tokenizer,
                prompt_template=settings.prompt_template,
                parser=settings.parser,
                temperature=settings.temperature,
                max_new_tokens=settings.max_new_tokens,
                too_long=settings.too_long,
            )
            await scorer.resolve_server()
            scorer.check_template_fits()
    except BaseException:
        await pool.aclose()
        raise
    return RewardModel(settings, scorer)


def _resolve(out: concurrent.futures.Future, result=None, error: BaseException | None = None) -> None:
    """Settle ``out`` unless its waiter cancelled it meanwhile."""
    if out.set_running_or_notify_cancel():
        if error is not None:
            out.set_exception(error)
        else:
            out.set_result(result)


def _closed(sample: RewardSample) -> ScoreOutcome:
    return ScoreOutcome(
        sample.sample_id, None, "closed", "the reward model was closed before the answer came"
    )


class BlockingRewardModel:
    """:class:`RewardModel` for plain threads: its own event loop in a daemon thread.

    ``score_many(samples)`` scores them concurrently and returns when all are done; ``score``
    one sample, from as many threads as ``concurrency``. Use as a context manager or call
    :meth:`close`.
    """

    def __init__(self, settings: ServedRewardSettings, urls: Sequence[str] | None = None, *, api_key=None):
        self.kind = settings.kind
        self.step_timeout_s = settings.step_timeout_s  # a rollout step's scoring deadline (the manager's)
        self.restarts = 0  # server restarts supervision began, the run so far (reward/server_restarts)
        # requests the servers take at once: a caller scoring one sample per thread needs this many
        self.concurrency = settings.max_in_flight * (1 if urls is None else len(urls))
        self._lock = threading.Lock()
        self._closed = False
        self._waiting: set[concurrent.futures.Future] = set()  # scoring calls being waited on
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="reward-model-loop", daemon=True)
        self._thread.start()
        try:
            self.model: RewardModel = self._run(open_reward_model(settings, urls, api_key=api_key))
        except BaseException:
            self._stop()
            raise

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _scoring(self, coro, closed):
        """Run ``coro`` on the loop and wait; after :meth:`close` (or when it closes while this
        waits) ``closed()`` (every sample unscored ``closed``) instead of a wait that never ends."""
        with self._lock:
            if self._closed:
                coro.close()
                return closed()
            fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
            self._waiting.add(fut)
        try:
            return fut.result()
        except concurrent.futures.CancelledError:
            if not self._closed:
                raise
            return closed()
        finally:
            with self._lock:
                self._waiting.discard(fut)

    def score_many(self, samples: Sequence[RewardSample]) -> list[ScoreOutcome]:
        samples = list(samples)
        return self._scoring(self.model.score_many(samples), lambda: [_closed(s) for s in samples])

    def score(self, sample: RewardSample) -> ScoreOutcome:
        return self._scoring(self.model.score(sample), lambda: _closed(sample))

    def submit(self, sample: RewardSample, deadline: float | None = None) -> concurrent.futures.Future:
        """Score ``sample`` on the client's loop, a coroutine, and return at once: a future of its
        :class:`ScoreOutcome` (a caller scoring many samples holds no thread per sample). Past
        ``deadline`` (``time.monotonic()``) the sample comes back unscored ``timeout``; a future
        the caller cancels cancels the request; :meth:`close` resolves every one ``closed``."""
        out: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                out.set_result(_closed(sample))
                return out
            inner = asyncio.run_coroutine_threadsafe(self._within(sample, deadline), self._loop)
            self._waiting.add(inner)

        def done(f: concurrent.futures.Future) -> None:
            with self._lock:
                self._waiting.discard(f)
            if out.cancelled():
                return
            if f.cancelled():
                outcome = _closed(sample) if self._closed else None
                if outcome is None:
                    out.cancel()
                    return
                _resolve(out, outcome)
            elif f.exception() is not None:
                _resolve(out, error=f.exception())
            else:
                _resolve(out, f.result())

        inner.add_done_callback(done)
        out.add_done_callback(lambda o: inner.cancel() if o.cancelled() else None)
        return out

    async def _within(self, sample: RewardSample, deadline: float | None) -> ScoreOutcome:
        try:
            if deadline is None:
                return await self.model.score(sample)
            return await asyncio.wait_for(self.model.score(sample), max(deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            return ScoreOutcome(
                sample.sample_id,
                None,
                "timeout",
                "not scored before the step's deadline (reward.model.step_timeout_s)",
            )
        except Exception:
            # The caller's future is the one that reports it; when the caller already cancelled it
            # (the run is stopping on this very error, RewardServerDown), nobody reads the task's,
            # and asyncio printed a traceback per sample on the console at exit (measured: 4 in a
            # crash-looping reward server's last step). Marked as read once the task is done.
            task = asyncio.current_task()
            if task is not None:
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
            raise

    def check_down(self) -> None:
        self.model.check_down()

    # supervision's events (sglang/reward_servers.py ServerEvents), from its thread

    def supervised(self) -> None:
        self._on_loop(self.model.pool.mark_supervised)

    def server_down(self, url: str) -> None:
        self.restarts += 1
        self._on_loop(self.model.pool.mark_down, url, "restarting after it died")

    def server_back(self, url: str) -> None:
        self._on_loop(self.model.pool.mark_restarted, url)

    def server_lost(self, message: str) -> None:
        self._on_loop(self.model.pool.mark_lost, message)

    def _on_loop(self, fn, *args) -> None:
        """Hand a supervision event to the client's loop; once the client is closed (the run is
        ending while a server restarts) there is no one left to tell, and the event is dropped."""
        with contextlib.suppress(RuntimeError):  # the loop is closed
            self._loop.call_soon_threadsafe(fn, *args)

    def peak_in_flight(self) -> dict[str, int]:
        return self.model.pool.peak_in_flight()

    def close(self) -> None:
        """Wake every caller waiting on a score (each sample unscored ``closed``), then close the
        connections and the loop: a scoring thread still waiting (one-step-off prefetch) must
        not keep the process from exiting."""
        with self._lock:
            self._closed = True
            waiting = list(self._waiting)
        for fut in waiting:
            fut.cancel()  # wakes its waiter now
        if self._thread.is_alive():
            self._run(self._shutdown())
        self._stop()

    async def _shutdown(self) -> None:
        """Cancel every request still on the loop and let it unwind, then close the connections."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.model.aclose()

    def _stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
