"""Rollout engines in their own Ray actors, seen from the driver as `RolloutEngine`s.

`EngineHost` is the actor: it owns one in-process engine (the HF engine here; SGLang engines are
server processes with an HTTP client and need no host) and takes weight updates bucket by bucket
from `RayObjectTransport`. It is a threaded actor so that `abort` reaches it while `generate`
runs, which is the engine protocol's concurrency contract. `RemoteEngine` is the driver-side
proxy that the rollout manager calls; given an ``on_result`` it reads `EngineHost.generate_each`,
a Ray streaming generator, so each response reaches the driver (and its scoring) as its row
stops rather than with the whole call.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from megatron_dapo.rollout.engine import EngineError, OnResult
from megatron_dapo.rollout.hf_engine import HFEngine
from megatron_dapo.rollout.types import GenerationRequest, GenerationResult

_DONE = object()


def hf_frame(cfg: Any) -> int:
    """An HF engine's attention frame for a run: the longest prompt plus the longest response
    (training's or validation's budget) it can be sent. A fixed frame keeps the engine's
    responses independent of their batch mates (``HFEngine``), so a seeded run is reproducible."""
    val = cfg.rollout.val.max_response_length
    return int(cfg.data.max_prompt_length) + max(int(cfg.data.max_response_length), int(val or 0))


def hf_slots(cfg: Any) -> int:
    """An HF engine's rows decoded together: every request the rollout manager may have in flight
    on it (``rollout.max_concurrency_per_engine``, SGLang's running requests), so that no turn
    waits in the engine's queue behind full slots. With fewer (256 before), the calculator demo's
    512 first turns filled them and the rest joined as rows left, in groups of 1 to 150 rows,
    each group a prefill forward of its own."""
    return int(cfg.rollout.max_concurrency_per_engine)


class EngineHost:
    def __init__(
        self,
        model_path: str,
        name: str,
        seed: int,
        max_batch_size: int = 64,
        threads: int = 1,
        record_routing: bool = False,
        frame: int | None = None,
    ):
        torch.set_num_threads(threads)
        # the weights' loading bar would reach the driver's console through Ray's log forwarding,
        # once per engine at every start (the checkpoint is local: there is no download to show)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.engine = HFEngine(
            model_path,
            name=name,
            seed=seed,
            max_batch_size=max_batch_size,
            record_routing=record_routing,
            frame=frame,
        )
        self._buckets: list[dict[str, torch.Tensor]] = []
        self._version: int | None = None

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        return self.engine.generate(requests)

    def generate_apart(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Several one-request calls in one message (``HFEngine.generate_apart``)."""
        return self.engine.generate_apart(requests)

    def generate_each(self, requests: Sequence[GenerationRequest]) -> Iterator[tuple[str, Any]]:
        """``generate`` as a Ray streaming generator: ``("some", [results])`` as requests finish
        (the rows that stopped since the last item: rows of one decode step travel together,
        one Ray object for them), then ``("all", results)``; a failure is raised after what was
        already sent."""
        finished: queue.SimpleQueue = queue.SimpleQueue()
        outcome: dict[str, Any] = {}

        def work() -> None:
            try:
                outcome["all"] = self.engine.generate(requests, on_result=finished.put)
            except BaseException as e:  # noqa: BLE001 - raised to the caller below
                outcome["error"] = e
            finished.put(_DONE)

        threading.Thread(target=work, name=f"{self.engine.name}-generate", daemon=True).start()
        done = False
        while not done:
            batch = [finished.get()]
            while not finished.empty():
                batch.append(finished.get())
            done = batch[-1] is _DONE
            if results := [r for r in batch if r is not _DONE]:
                yield ("some", results)
        if "error" in outcome:
            raise outcome["error"]
        yield ("all", outcome["all"])

    def abort(self) -> None:
        self.engine.abort()

    def begin_weight_update(self, version: int) -> None:
        self._buckets, self._version = [], version

    def receive_bucket(self, index: int, bucket: dict[str, torch.Tensor]) -> int:
        # Ray hands the bucket over deserialised: these tensors are this process's own copy.
        self._buckets.append(bucket)
        return index

    def finish_weight_update(self) -> int:
        buckets, self._buckets = self._buckets, []
        self.engine.load_weights(buckets, self._version)
        return self._version

    def load_from_disk(self, path: str, version: int) -> bool:
        return self.engine.load_from_disk(path, version)

    def health(self, check_process: bool = True) -> bool:
        return self.engine.health()

    def stats(self) -> dict[str, Any]:
        return dict(self.engine.stats, weight_version=self.engine.weight_version)

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self) -> None:
        self.engine.resume_memory()


class RemoteEngine:
    """Driver-side `RolloutEngine` over an `EngineHost` actor handle.

    One-request calls (episodes' later turns, sent one by one as their tools answer) cross to the
    actor together: the first waits ``gather_s`` (10 ms, a fraction of one decode batch) for the
    calls made meanwhile, and they go as one message (``HFEngine.generate_apart``: each still a
    call of its own in the engine's batcher), so a step's turns cost a Ray call per 10 ms rather
    than one each. Messages do not wait for each other: the engine's queue gathers them for its
    next batch. An abort answers the ones still waiting here "abort" with no tokens, as the
    engine answers its own queue. ``submit_turn`` (`SubmitsTurns`) queues a turn without a thread of
    the caller's waiting on it: one sender thread gathers the queue, and a thread per message
    (not per turn) waits for the actor's answer."""

    gather_s = 0.01

    def __init__(self, name: str, handle: Any, timeout_s: float):
        self.name = name
        self.handle = handle
        self.timeout_s = timeout_s
        self._cv = threading.Condition()
        self._waiting: list[tuple[GenerationRequest, int, Future]] = []  # (request, abort epoch, answer)
        self._epoch = 0
        self._version: int | None = None  # the weights of the last turn answered (for an abort here)
        self._sender: threading.Thread | None = None
        self._messages = ThreadPoolExecutor(max_workers=1 << 10, thread_name_prefix=f"{name}-message")

    def _get(self, ref, what: str):
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        try:
            return ray.get(ref, timeout=self.timeout_s)
        except GetTimeoutError as e:
            raise EngineError(
                f"engine {self.name}: {what} did not return within {self.timeout_s:.0f}s"
            ) from e
        except RayActorError as e:
            raise EngineError(f"engine {self.name} died during {what}: {e}") from e
        except RayTaskError as e:
            raise EngineError(f"engine {self.name}: {what} failed: {getattr(e, 'cause', e)}") from e

    def generate(
        self, requests: Sequence[GenerationRequest], on_result: OnResult | None = None
    ) -> list[GenerationResult]:
        what = f"generate ({len(requests)} requests)"
        if on_result is None and len(requests) == 1:
            return [self._one(requests[0])]
        if on_result is None:
            return self._get(self.handle.generate.remote(list(requests)), what)
        import ray

        # each result streams back as its row stops, so the driver scores it while the rest decode
        stream = self.handle.generate_each.options(num_returns="streaming").remote(list(requests))
        deadline = time.monotonic() + self.timeout_s
        while True:
            ready, _ = ray.wait([stream], timeout=max(deadline - time.monotonic(), 0.0))
            if not ready:
                raise EngineError(f"engine {self.name}: {what} did not return within {self.timeout_s:.0f}s")
            try:
                ref = next(stream)
            except StopIteration:
                raise EngineError(f"engine {self.name}: {what} ended without its results") from None
            kind, value = self._get(ref, what)
            if kind == "all":
                return value
            for result in value:
                on_result(result)

    def _one(self, request: GenerationRequest) -> GenerationResult:
        return self.submit_turn(request).result()

    def submit_turn(self, request: GenerationRequest) -> Future:
        """A one-request call, answered by the future: it waits in the queue that the sender
        thread sends as one message ``gather_s`` after the first of them came."""
        answer: Future = Future()
        with self._cv:
            self._waiting.append((request, self._epoch, answer))
            if self._sender is None:
                self._sender = threading.Thread(
                    target=self._send_loop, name=f"{self.name}-sender", daemon=True
                )
                self._sender.start()
            self._cv.notify()
        return answer

    def _send_loop(self) -> None:
        while True:
            with self._cv:
                while not self._waiting:
                    self._cv.wait()
            time.sleep(self.gather_s)
            with self._cv:
                batch, self._waiting = self._waiting, []
            self._messages.submit(self._send, batch)

    def _send(self, batch: list[tuple[GenerationRequest, int, Future]]) -> None:
        """One message: the one-request calls gathered (those an abort reached answered here)."""
        with self._cv:
            stale = [(q, f) for q, epoch, f in batch if epoch != self._epoch]
            batch = [(q, f) for q, epoch, f in batch if epoch == self._epoch]
        for q, f in stale:
            f.set_result(GenerationResult(q.request_id, [], [], "abort", self._version))
        if not batch:
            return
        try:
            results = self._get(
                self.handle.generate_apart.remote([q for q, _ in batch]), f"generate ({len(batch)} turns)"
            )
        except BaseException as e:  # noqa: BLE001 - each call of the message raises it
            for _, f in batch:
                f.set_exception(e)
            return
        for (_, f), r in zip(batch, results):
            self._version = r.weight_version
            f.set_result(r)

    def abort(self) -> None:
        with self._cv:
            self._epoch += 1
        self._get(self.handle.abort.remote(), "abort")

    def load_weights(self, buckets: Iterable[dict[str, torch.Tensor]], version: int) -> None:
        self._get(self.handle.begin_weight_update.remote(version), "weight update start")
        for i, b in enumerate(buckets):
            self._get(self.handle.receive_bucket.remote(i, b), f"weight bucket {i}")
        self._get(self.handle.finish_weight_update.remote(), "weight update finish")

    def load_from_disk(self, path: str, version: int) -> bool:
        return self._get(self.handle.load_from_disk.remote(path, version), f"reload from {path}")

    def release_memory(self) -> None:
        self._get(self.handle.release_memory.remote(), "release_memory")

    def resume_memory(self) -> None:
        self._get(self.handle.resume_memory.remote(), "resume_memory")

    def health(self, check_process: bool = True) -> bool:
        """The engine's actor answers and serves (the actor is its process: one question)."""
        try:
            return bool(self._get(self.handle.health.remote(), "health"))
        except EngineError:
            return False

    def stats(self) -> dict[str, Any]:
        return self._get(self.handle.stats.remote(), "stats")
