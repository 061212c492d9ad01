"""Bringing engines that died during a rollout step back before the next one.

The rollout manager marks an engine down when it fails and its `health()` is False, and
finishes the step on the others (`manager.down`). Before the weight sync that follows, every
launched server that is not down is checked: its process (or port) is gone, or it does not
answer `GET /health` within `rollout.sglang.health_timeout_s` (hung: port open, no answers, e.g.
SIGSTOPped), and it is down too. Every down engine whose server this run launched is then
restarted (`engine.server.restart()`: the old process group SIGKILLed, a new one started and
waited for; under torchrun by the node that owns it); the transport then forgets per-server state such as
a weight-update group (`ActorWorker.reset_transport`), the sync brings every engine, the
restarted ones included, to the new weight version, and only then does the manager give them work
again. Under multi-node torchrun, another node's server is restarted by the process that started it
(that node's LOCAL_RANK 0; `sglang_torchrun.PeerServer`). A down engine that this driver cannot
restart (a server given by URL) that does not answer `/health` again is left behind by the trainer
while other engines serve (`DAPOTrainer._drop_lost_engines`: out of the transport, the rollouts
and validation); when it is the last, the rollout has already stopped the run naming it.
Engines that answered a call since the last sync (`manager.heard`) are not asked before it.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from megatron_dapo.rollout.engine import launched_by_this_run

log = logging.getLogger(__name__)


def restart_down_engines(manager: Any) -> list[str]:
    """Restart the down engines that can be restarted (or came back); their names.

    A server that died or hung while no request was on it (during the actor update, or an engine
    the rollout gave no work) is not in `manager.down`; it is checked here so that it is restarted
    too, instead of failing (or hanging) the weight sync that follows. An engine that answered a
    call since the last sync (`manager.heard`) is not asked again: every step would otherwise send
    every server a GET /health, which in SGLang 0.5.x may run a generation. This is the sync, so
    `manager.heard` starts over."""
    heard = getattr(manager, "heard", set())
    unchecked = [
        e
        for e in manager.engines
        if e.name not in manager.down and e.name not in heard and launched_by_this_run(e)
    ]
    heard.clear()
    if unchecked:  # in parallel: a hung server costs health_timeout_s once, not once per engine
        with ThreadPoolExecutor(len(unchecked), thread_name_prefix="engine-check") as pool:
            found = list(pool.map(_why_down, unchecked))
        for engine, why in zip(unchecked, found):
            if why is not None:
                manager.down[engine.name] = why
    revived = []
    for engine in manager.engines:
        why = manager.down.get(engine.name)
        if why is None:
            continue
        if not launched_by_this_run(engine):
            if _healthy(engine):
                log.warning("engine %s, down since '%s', answers again", engine.name, why)
                revived.append(engine.name)
            continue
        log.warning("engine %s is down (%s); restarting it", engine.name, why)
        engine.server.restart()
        revived.append(engine.name)
    return revived


def return_to_service(manager: Any, names: list[str]) -> None:
    """The engines got the current weights: the manager may give them work again."""
    for name in names:
        manager.down.pop(name, None)


def _why_down(engine: Any) -> str | None:
    """Why a launched server that no request failed on is down anyway; None when it serves.

    A server that answers GET /health is not asked whether its process lives
    (`health(check_process=False)`): on the Ray path that question is a call to its node's host
    actor, which every step would pay for nothing."""
    if getattr(engine, "memory_released", False):  # colocated, its memory given to the actor
        return None if _alive(engine.server) else "its server is gone"
    if _healthy(engine, check_process=False):
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


def _healthy(engine: Any, check_process: bool = True) -> bool:
    try:
        try:
            return bool(engine.health(check_process=check_process))
        except TypeError:  # an engine with the protocol's older health(): its own whole check
            return bool(engine.health())
    except Exception:  # noqa: BLE001 - an engine that cannot answer is not healthy
        return False
