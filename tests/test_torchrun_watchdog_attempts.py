"""The call watchdog's store keys belong to one torchrun attempt (issue 16).

With `--max-restarts`, torchrun's next attempt runs on the same agent store (c10d rendezvous shares
its TCP store across rounds). Attempt 0: rank 1 hangs in a call, rank 0's watchdog ends the job and
posts its abort key. Attempt 1: the same call returns after a few of the followers' abort polls;
the run must finish. Before the keys carried the attempt, attempt 1's follower read attempt 0's
abort key, stopped at once, and the job failed.

The ranks are stand-ins (`SPMDRankGroup` over a worker with one method), run by real torchrun.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")


class _Worker:
    def __init__(self, rank: int, attempt: int):
        self.rank, self.attempt = rank, attempt

    def work(self) -> int:
        if self.rank == 1:
            if self.attempt == 0:
                threading.Event().wait()  # hung: the watchdog must end the attempt
            time.sleep(4 * 0.5)  # several abort polls (spmd_watchdog.POLL_S) while the call runs
        return self.rank


def _rank_main() -> None:
    import torch.distributed as dist

    from megatron_dapo.driver.rank_group import SPMDRankGroup

    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    worker = _Worker(rank, attempt)
    if rank != 0:
        SPMDRankGroup.follow(worker)
        return
    ranks = SPMDRankGroup(worker)
    got = ranks.call("work", timeout_s=5 if attempt == 0 else 120, timeout_note="(test)")
    ranks.shutdown()
    print(f"attempt {attempt} finished: {got}", flush=True)


def test_a_restarted_attempt_does_not_read_the_last_attempts_abort(tmp_path):
    from megatron_dapo.actor.spawn import free_port

    cmd = [str(TORCHRUN), "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1",
           "--monitor-interval", "0.5", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           __file__, "rank"]  # fmt: skip
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    out = r.stdout + r.stderr
    # attempt 0 ended by the watchdog, naming the hung rank
    assert "failed: work: ranks [1] did not finish within 5s (test)" in out, out[-3000:]
    assert r.returncode == 0, out[-3000:]
    assert "attempt 1 finished: [0, 1]" in out, out[-3000:]
    assert "[rank 1] stopped" not in out.split("attempt 1")[-1]


if __name__ == "__main__" and sys.argv[1:2] == ["rank"]:
    _rank_main()
