"""The call watchdog's store keys belong to one torchrun attempt (issue 16).

With `--max-restarts`, torchrun's next attempt runs on the same agent store (the c10d rendezvous
shares its TCP store across rounds), so attempt 0's abort key and answered marks are still there
when attempt 1 starts. Attempt 1's follower must not read attempt 0's abort (before: it stopped at
once), and attempt 0's answered marks must not hide a rank that hangs in attempt 1.

In process: a real TCPStore, the watchdog's own functions, `_exit_with` recorded instead of
ending the test process; TORCHELASTIC_RESTART_COUNT set as torchrun sets it.
"""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from megatron_dapo.driver import spmd_watchdog as wd


class CountingStore:
    """A real TCPStore whose `check` calls (the watcher's polls) can be waited on."""

    def __init__(self, store):
        self.store, self.polls = store, threading.Semaphore(0)

    def check(self, keys):
        self.polls.release()
        return self.store.check(keys)

    def __getattr__(self, name):
        return getattr(self.store, name)


@pytest.fixture
def store(monkeypatch):
    from megatron_dapo.ports import free_port

    s = CountingStore(dist.TCPStore("127.0.0.1", free_port(), 1, True))
    monkeypatch.setattr(wd, "_store", lambda: s)
    return s


def test_a_restarted_attempt_does_not_read_the_last_attempts_abort(store, monkeypatch):
    exits: list[str] = []
    exited = threading.Event()

    def record(line: str) -> None:
        exits.append(line)
        if line.startswith("[rank "):  # a follower's watcher: it keeps polling until stopped
            exited.set()
            return
        raise SystemExit  # rank 0's watchdog, called here in the test's thread: leaves the call

    monkeypatch.setattr(wd, "_exit_with", record)
    # attempt 0: rank 1 answered call 1, then rank 0's watchdog ended the attempt on call 2
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    wd.mark_answered(store, 1, 1)
    dog = wd.CallWatchdog(2)
    with pytest.raises(SystemExit):
        dog._expired(2, "train_step", 5, "(test)")
    assert exits == ["failed: train_step: ranks [0, 1] did not finish within 5s (test)"]

    # attempt 1: the follower's watcher polls the same store
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    watcher = wd.watch_for_abort(1)
    try:
        for _ in range(3):  # three polls of the store, none of them may end the rank
            assert store.polls.acquire(timeout=60)
        assert len(exits) == 1, exits
        # attempt 1's rank 1 has not answered call 1 of this attempt
        fresh = wd.CallWatchdog(2)
        fresh.mine_done()
        assert fresh.late_ranks(1) == [1]
        # this attempt's own abort does end it (the watcher works)
        with pytest.raises(SystemExit):
            fresh._expired(1, "train_step", 5, "(test)")
        assert exited.wait(60)
        assert (
            exits[-1]
            == "[rank 1] stopped: rank 0 ended the run (train_step: ranks [1] did not finish within 5s (test))"
        )
    finally:
        watcher.stop.set()
        watcher.join(60)


def test_a_peer_that_dies_while_rank_0_stays_blocked_is_named(store, monkeypatch, tmp_path):
    """Rank 0 blocked in a call whose peer died (its sockets held open by an orphan): the peer
    thread names the dead rank and the checkpoint a resume uses in one line, puts the blocked
    main thread's stack in error.log, and posts the abort key for the other followers."""
    import os
    import socket
    import subprocess
    import sys

    from megatron_dapo.errors import set_log_dir

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process
    lines, exited = [], threading.Event()
    monkeypatch.setattr(wd, "_exit_with", lambda line: (lines.append(line), exited.set()))
    set_log_dir(tmp_path)
    peers = [(socket.gethostname(), os.getpid()), (socket.gethostname(), gone.pid)]
    watchdog = wd.CallWatchdog(2, peers=peers, grace_s=0.2)
    try:
        context = "during step 3; trainer.resume=auto continues from /runs/r/checkpoints/step_00000002"
        watchdog.start("train_step", None, "", context)
        assert exited.wait(120), "the dead peer was never reported"
    finally:
        watchdog.close()
        set_log_dir(None)
    line = lines[0]
    assert line.startswith(f"failed: training rank 1 (pid {gone.pid}) died during train_step"), line
    assert line.count("failed:") == 1 and context in line and "\n" not in line, line
    log = (tmp_path / "error.log").read_text()
    assert "Traceback (most recent call last)" in log
    assert "test_a_peer_that_dies_while_rank_0_stays_blocked_is_named" in log  # where the main thread was
    assert store.get(wd.abort_key()).decode() == line
