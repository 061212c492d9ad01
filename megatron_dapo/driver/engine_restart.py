"""Bringing engines that died during a rollout step back before the next one.

The rollout manager marks an engine down when it fails and its `health()` is False, and
finishes the step on the others (`manager.down`). Before the weight sync that follows, every
down engine whose server this driver launched is restarted (`engine.server.restart()`, or
stop/start/wait for a local `SGLangServer`); the transport then forgets per-server state such as
a weight-update group (`ActorWorker.reset_transport`), the sync brings every engine, the
restarted ones included, to the new weight version, and only then does the manager give them work
again. Under multi-node torchrun, another node's server is restarted by the process that started it
(that node's LOCAL_RANK 0; `sglang_torchrun.PeerServer`). A down engine that this driver cannot
restart (a server given by URL) stays down; the sync then fails naming it, unless it came back by
itself and answers `/health`.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def restart_down_engines(manager: Any) -> list[str]:
    """Restart the down engines that can be restarted (or came back); their names.

    A server that died while no request was on it (during the actor update, or an engine the
    rollout gave no work) is not in `manager.down`; its process is checked here so that it is
    restarted too, instead of failing the weight sync that follows."""
    for engine in manager.engines:
        server = getattr(engine, "server", None)
        if engine.name not in manager.down and server is not None and not _alive(server):
            manager.down[engine.name] = "its server is gone"
    revived = []
    for engine in manager.engines:
        why = manager.down.get(engine.name)
        if why is None:
            continue
        server = getattr(engine, "server", None)
        if server is None:
            if _healthy(engine):
                log.warning("engine %s, down since '%s', answers again", engine.name, why)
                revived.append(engine.name)
            continue
        log.warning("engine %s is down (%s); restarting it", engine.name, why)
        if hasattr(server, "restart"):
            server.restart()
        else:  # a server process of this node (SGLangServer)
            server.stop()
            server.start()
            server.wait_healthy()
        revived.append(engine.name)
    return revived


def return_to_service(manager: Any, names: list[str]) -> None:
    """The engines got the current weights: the manager may give them work again."""
    for name in names:
        manager.down.pop(name, None)


def _alive(server: Any) -> bool:
    try:
        return bool(server.alive())
    except Exception:  # noqa: BLE001 - a server that cannot say is taken as alive: the sync will tell
        return True


def _healthy(engine: Any) -> bool:
    try:
        return bool(engine.health())
    except Exception:  # noqa: BLE001 - an engine that cannot answer is not healthy
        return False
