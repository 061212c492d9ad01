"""The rollout engine protocol: what the manager and the weight sync need from an inference engine.

Concurrency contract (why there is no separate async API): the manager calls ``generate`` from
worker threads, several calls per engine in flight up to its concurrency limit, and calls
``abort`` from its own thread once the batch is full. ``abort`` makes every call that is in
flight at that moment return promptly, each unfinished request with ``finish_reason="abort"``
and the tokens it had so far; calls that start after ``abort`` run normally. That is exactly
what SGLang's ``/abort_request {"abort_all": true}`` does to its open ``/generate`` requests,
and what the HF engine does between decode steps, so one blocking method plus one abort cover
both engines without a second (streaming) API to keep in sync.

``on_result`` is how a response is scored while the others of its call still generate: the engine
calls it once with each request's result as soon as that request finishes ("stop" or "length";
never an aborted one), from whichever thread finished it, before ``generate`` returns the list.
It must return at once (the manager only queues the response for scoring), and a call that
leaves it out is still answered in full by the list. SGLang's client calls it as each
``/generate`` reply arrives, the HF engine as each row of its batch stops, and a Ray-hosted
engine streams each result back to the driver as it comes (``driver/engine_host.py``).

Partial rollouts (``rollout.partial``) need nothing more from an engine: the tokens an aborted
request returns are kept by the manager, and their continuation is an ordinary request whose
prompt ends with them and whose ``max_new_tokens`` is the budget left (``rollout/partial.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Protocol, runtime_checkable

import torch

from megatron_dapo.rollout.types import GenerationRequest, GenerationResult

OnResult = Callable[[GenerationResult], None]


class EngineError(RuntimeError):
    """An engine failed a call; the message names the engine and what it was doing."""


@runtime_checkable
class RolloutEngine(Protocol):
    """An inference engine that samples responses and takes new weights.

    Attributes:
        name: short unique name used in logs and errors (e.g. ``"sglang-0@10.0.0.1:30000"``).
    """

    name: str

    def generate(
        self, requests: Sequence[GenerationRequest], on_result: OnResult | None = None
    ) -> list[GenerationResult]:
        """Sample one response per request; results in request order. Thread-safe; see module doc
        (``on_result``: each finished result as soon as it is)."""
        ...

    def abort(self) -> None:
        """Make all in-flight ``generate`` calls return now (unfinished requests as "abort")."""
        ...

    def load_weights(self, buckets: Iterable[dict[str, torch.Tensor]], version: int) -> None:
        """Replace the weights with HF-named tensors streamed as buckets; tag them ``version``."""
        ...

    def release_memory(self) -> None:
        """Give device memory back (colocation: the trainer runs next)."""
        ...

    def resume_memory(self) -> None:
        """Take device memory again after :meth:`release_memory`."""
        ...

    def health(self, check_process: bool = True) -> bool:
        """True when the engine can serve requests. ``check_process=False``: only ask the engine
        itself (its server's answer), not whether a supervised process lives, which may cost a
        call to another node."""
        ...


@runtime_checkable
class SubmitsTurns(Protocol):
    """An engine that takes a one-request call without a thread of the caller's waiting on it:
    ``submit_turn`` returns at once, and the future is answered as ``generate([request])`` would be
    (an abort included). The episode runner sends an episode's later turns this way when an
    engine offers it: hundreds of episodes each waiting on a thread of their own cost the driver
    more in thread switches than their turns (the Ray-hosted HF engine's proxy offers it). The
    method's name is its own: a Protocol is checked by attribute name, and the SGLang engine's
    ``submit`` (a coroutine onto its loop) once passed for this one."""

    def submit_turn(self, request: GenerationRequest) -> Future[GenerationResult]: ...


def launched_by_this_run(engine: object) -> bool:
    """The run started this engine's server (the engine holds it as ``server``), so it can restart
    it; a server given by URL, or an in-process engine, can only be waited for or lost."""
    return getattr(engine, "server", None) is not None
