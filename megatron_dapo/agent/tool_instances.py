"""Whose verl tool instances are whose: each run of an episode gets instances of its own.

A verl class tool keeps state per episode (``create`` ... ``release``), under the episode's key
(``EpisodeInfo.key``, the request id at its start). The episode loop releases an episode's
instances when it ends; this wrapper around it (the runner the rollout manager is handed) covers
the runs that do not end that way:

- an episode aborted (the batch is full, a pause) is released when its run returns, unless it
  can be continued (``rollout.partial``: its continuation keeps the instance);
- a run that raised (an engine failed mid-episode; the manager retries the call elsewhere) has
  every episode's instances released: the retry starts them afresh;
- a run's episodes take keys no other run in flight holds: a retry that starts while the call it
  replaces still runs (timed out, or its engine hung: the manager drops it without waiting) gets
  ``request_id~2`` and fresh instances, never the live ones the dropped call still calls;
- an episode that starts afresh (no earlier tokens) first releases what its key holds: a run of it
  that was aborted and never continued (the manager started it over) left its instances there.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

from megatron_dapo.rollout.engine import OnResult
from megatron_dapo.rollout.types import EpisodeInfo, GenerationRequest, GenerationResult


class ToolInstances:
    """The episode runner ``episodes`` (``agent.runner.MultiTurn``) with its tool instances' lives
    kept as above; ``keep_aborted``: aborted episodes may be continued (``rollout.partial``)."""

    def __init__(self, episodes: Any, *, keep_aborted: bool):
        self.episodes = episodes
        self.tools = episodes.tools
        self.keep_aborted = keep_aborted
        self._lock = threading.Lock()
        self._live: set[str] = set()  # the keys the runs in flight hold

    def run(
        self,
        engine: Any,
        requests: Sequence[GenerationRequest],
        stop: threading.Event,
        on_result: OnResult | None = None,
    ) -> list[GenerationResult]:
        keyed, fresh = self._claim(requests)
        keys = [q.episode.key for q in keyed]
        try:
            for key in fresh:
                self.tools.release(key)
            results = self.episodes.run(engine, keyed, stop, on_result)
        except BaseException:
            self._release(keys, keys)
            raise
        ended = [
            key
            for key, r in zip(keys, results)
            if not (self.keep_aborted and r.finish_reason == "abort" and r.episode is not None)
        ]
        self._release(ended, keys)
        return results

    def close(self) -> None:
        self.episodes.close()

    def _claim(self, requests: Sequence[GenerationRequest]) -> tuple[list[GenerationRequest], list[str]]:
        """The requests with their episodes' keys, each one no run in flight holds, and the keys
        of those that start afresh."""
        keyed, fresh = [], []
        with self._lock:
            for q in requests:
                info = q.episode if q.episode is not None else EpisodeInfo()
                base = info.key or q.request_id
                key, n = base, 1
                while key in self._live:
                    n += 1
                    key = f"{base}~{n}"
                self._live.add(key)
                if not info.turns or key != base:  # nothing of this run's may live under it yet
                    fresh.append(key)
                keyed.append(dataclasses.replace(q, episode=dataclasses.replace(info, key=key)))
        return keyed, fresh

    def _release(self, released: list[str], held: list[str]) -> None:
        for key in released:
            self.tools.release(key)
        with self._lock:
            self._live.difference_update(held)
