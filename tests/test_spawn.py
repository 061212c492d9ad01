"""run_ranks' start method: ranks fork from a forkserver that already imported megatron.core
(on CPU), and each rank still sees the caller's environment at the time of the call."""

from __future__ import annotations

import os
import sys

from megatron_dapo.actor.spawn import run_ranks


def _report(rank: int, world_size: int) -> dict:
    return {
        "preloaded": "megatron.core" in sys.modules,
        "probe": os.environ.get("MEGATRON_DAPO_SPAWN_PROBE"),
        "gone": os.environ.get("MEGATRON_DAPO_SPAWN_GONE"),
        "rank": os.environ["RANK"],
    }


def test_ranks_start_with_megatron_imported_and_the_callers_current_environment(monkeypatch):
    # The first call starts this process's forkserver (if no earlier test did) with GONE set.
    monkeypatch.setenv("MEGATRON_DAPO_SPAWN_GONE", "at-server-start")
    first = run_ranks(_report, 2)
    assert [r["gone"] for r in first] == ["at-server-start"] * 2
    # Later changes to the caller's environment reach the ranks; removals too.
    monkeypatch.delenv("MEGATRON_DAPO_SPAWN_GONE")
    monkeypatch.setenv("MEGATRON_DAPO_SPAWN_PROBE", "after-start")
    second = run_ranks(_report, 2)
    assert [r["probe"] for r in second] == ["after-start"] * 2
    assert [r["gone"] for r in second] == [None, None]
    assert [r["rank"] for r in second] == ["0", "1"]
    # No rank imported megatron itself: the forkserver did, once.
    assert all(r["preloaded"] for r in first + second)
