"""The engine pool: the one owner of the run's rollout engines and of whether each one serves.

Who writes what:
- the rollout manager marks an engine down when a call on it fails and its `health()` is False,
  or when it holds calls and goes silent past the hang probe (`mark_down`), and notes every
  engine that answered a call (`mark_heard`); it finishes the step on the others;
- before the weight sync that follows, the trainer asks the pool to bring the down engines back
  (`restart_down`). Every launched server that is not down and was not heard from since the last
  sync is checked first: its process (or port) is gone, or it does not answer `GET /health`
  within `rollout.sglang.health_timeout_s` (hung: port open, no answers, e.g. SIGSTOPped), and it
  is down too. Every down engine whose server this run launched is then restarted
  (`engine.server.restart()`: the old process group SIGKILLed, a new one started and waited for;
  under torchrun by the node that owns it, `sglang_torchrun.PeerServer`); a down engine given by
  URL that answers `/health` again counts as revived. The transport then forgets per-server
  state (`ActorWorker.reset_transport`), the sync brings every engine, the revived ones
  included, to the new weight version, and only then are they given work again
  (`return_to_service`);
- a down engine this run cannot restart (a server given by URL) that did not come back is left
  behind while others serve (`unrestartable`, then `drop`: out of the transport, the rollouts and
  validation, for good); when it is the last, the rollout has already stopped the run naming it.

Engines that answered a call since the last sync are not asked before it: every step would
otherwise send every server a GET /health, which in SGLang 0.5.x may run a generation.

The pool is also the sequence of serving engines (`len`, indexing, iteration) that validation
spreads its requests over, so an engine dropped here leaves validation too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import MappingProxyType
from typing import Any

from megatron_dapo.rollout.engine import launched_by_this_run

log = logging.getLogger(__name__)


class EnginePool(Sequence):
    """The serving engines (in their given order) and the liveness of each."""

    def __init__(self, engines: Iterable[Any]):
        self._engines: list[Any] = list(engines)
        self._down: dict[str, str] = {}  # engine name -> why it was marked down
        # engines that answered a call since the last weight sync (the check before the sync
        # skips them); `restart_down` clears it
        self._heard: set[str] = set()
        # engines this run goes on without (down, given by URL, dropped at a sync)
        self._lost: set[str] = set()

    # ---------------------------------------------------------------- reading
    def __len__(self) -> int:
        return len(self._engines)

    def __getitem__(self, i):
        return self._engines[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._engines))

    @property
    def down(self) -> Mapping[str, str]:
        """Engine name -> why it is down (read-only)."""
        return MappingProxyType(self._down)

    @property
    def heard(self) -> frozenset[str]:
        return frozenset(self._heard)

    @property
    def lost(self) -> frozenset[str]:
        return frozenset(self._lost)

    def is_down(self, name: str) -> bool:
        return name in self._down

    def alive(self) -> list[Any]:
        """The engines not marked down, in order."""
        return [e for e in self._engines if e.name not in self._down]

    def lost_count(self) -> int:
        """Engines the run goes on without, and the down ones it cannot restart (given by URL)."""
        return len(self._lost) + sum(
            not launched_by_this_run(e) for e in self._engines if e.name in self._down
        )

    def down_message(self) -> str:
        why = "; ".join(f"{name}: {reason}" for name, reason in self._down.items())
        return f"rollout: all {len(self._engines)} engines are down ({why}); restart them or check their logs"

    # ---------------------------------------------------------------- the manager's reports
    def mark_down(self, name: str, why: str) -> None:
        self._down[name] = why

    def mark_heard(self, name: str) -> None:
        self._heard.add(name)

    # ---------------------------------------------------------------- around a weight sync
    def restart_down(self) -> list[str]:
        """Restart the down engines that can be restarted (or came back); their names.

        A server that died or hung while no request was on it (during the actor update, or an
        engine the rollout gave no work) is not down yet; it is checked here so that it is
        restarted too, instead of failing (or hanging) the weight sync that follows. This is the
        sync, so the heard set starts over."""
        unchecked = [
            e
            for e in self._engines
            if e.name not in self._down and e.name not in self._heard and launched_by_this_run(e)
        ]
        self._heard.clear()
        if unchecked:  # in parallel: a hung server costs health_timeout_s once, not once per engine
            with ThreadPoolExecutor(len(unchecked), thread_name_prefix="engine-check") as pool:
                found = list(pool.map(_why_down, unchecked))
            for engine, why in zip(unchecked, found):
                if why is not None:
                    self._down[engine.name] = why
        revived = []
        for engine in self._engines:
            why = self._down.get(engine.name)
            if why is None:
                continue
            if not launched_by_this_run(engine):
                if healthy(engine):
                    log.warning("engine %s, down since '%s', answers again", engine.name, why)
                    revived.append(engine.name)
                continue
            log.warning("engine %s is down (%s); restarting it", engine.name, why)
            engine.server.restart()
            revived.append(engine.name)
        return revived

    def return_to_service(self, names: Iterable[str]) -> None:
        """The engines got the current weights: they may be given work again."""
        for name in names:
            self._down.pop(name, None)

    def unrestartable(self, revived: Iterable[str]) -> list[str]:
        """The down engines this run cannot restart (given by URL) that did not come back
        (``revived``: what `restart_down` just returned); [] when they are all the engines left
        (nothing would serve: the sync's error names them)."""
        revived = set(revived)
        lost = [
            e.name
            for e in self._engines
            if e.name in self._down and e.name not in revived and not launched_by_this_run(e)
        ]
        return [] if len(lost) == len(self._engines) else lost

    def drop(self, names: Iterable[str]) -> None:
        """Leave these engines behind for good: out of the rollouts and validation."""
        names = list(names)
        left = len(self._engines) - len(names)
        for name in names:
            log.error(
                "engine %s is down (%s) and this run cannot restart it: going on with %d engines without it",
                name,
                self._down.pop(name, "down"),
                left,
            )
        self._engines[:] = [e for e in self._engines if e.name not in names]
        self._lost.update(names)


def healthy(engine: Any, check_process: bool = True) -> bool:
    """The engine's own answer to `health()`; an engine that cannot answer is not healthy.
    ``check_process=False``: only its server's answer, not whether a supervised process lives."""
    try:
        try:
            return bool(engine.health(check_process=check_process))
        except TypeError:  # an engine with the protocol's older health(): its own whole check
            return bool(engine.health())
    except Exception:  # noqa: BLE001 - an engine that cannot answer is not healthy
        return False


def _why_down(engine: Any) -> str | None:
    """Why a launched server that no request failed on is down anyway; None when it serves.

    A server that answers GET /health is not asked whether its process lives
    (`health(check_process=False)`): on the Ray path that question is a call to its node's host
    actor, which every step would pay for nothing."""
    if getattr(engine, "memory_released", False):  # colocated, its memory given to the actor
        return None if _alive(engine.server) else "its server is gone"
    if healthy(engine, check_process=False):
        return None
    if not _alive(engine.server):
        return "its server is gone"
    timeout = getattr(getattr(engine, "client", None), "health_timeout_s", None)
    within = f" within {timeout:g}s" if timeout is not None else ""
    return f"its server does not answer GET /health{within} (hung? rollout.sglang.health_timeout_s)"


def _alive(server: Any) -> bool:
    try:
        return bool(server.alive())
    except Exception:  # noqa: BLE001 - a server that cannot say is taken as alive: the sync will tell
        return True
