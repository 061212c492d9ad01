"""A rank killed mid-checkpoint must not leave its forked children behind.

megatron-core's checkpoint save forks file writers from the rank. A fork shares the rank's open
sockets, so while an orphaned writer lives, the rank's gloo connections stay open: its peers
never see them close and wait in their collective instead of reporting the dead rank (under
torchrun, until the agent SIGKILLs them). `orphan_guard.die_with_forking_parent`, armed in every
rank, ends such children with their parent.

Two real gloo processes: rank 1 forks a child that sleeps (a writer in the middle of its file),
rank 0 waits for rank 1 in a collective; SIGKILL rank 1. Rank 0 must get its connection error
and the child must be gone. Without the guard rank 0 stays blocked (checked by hand: still
blocked 40 s after the kill, when the check gave up) and the child lives on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]

RANK = textwrap.dedent(
    """
    import datetime, multiprocessing as mp, sys, time
    import torch.distributed as dist

    rank, init_file, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group(
        "gloo", init_method="file://" + init_file, rank=rank, world_size=2,
        timeout=datetime.timedelta(hours=1),  # a hang must look like one
    )
    dist.barrier()  # every connection is up
    if rank == 1:
        from megatron_dapo.weights.orphan_guard import die_with_forking_parent

        die_with_forking_parent()  # as ActorWorker.setup does
        child = mp.get_context("fork").Process(target=time.sleep, args=(600,))
        child.start()
        open(out, "w").write(str(child.pid))
        time.sleep(600)
    else:
        try:
            dist.broadcast_object_list([None], src=1)  # rank 1 never sends: blocked on its socket
            open(out, "w").write("returned")
        except Exception as e:
            open(out, "w").write("error: " + type(e).__name__)
    """
)


def _wait_for(path: Path, proc: subprocess.Popen, what: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while not (path.is_file() and path.read_text()):
        assert proc.poll() is None or path.is_file(), f"{what} exited early ({proc.returncode})"
        assert time.monotonic() < deadline, f"{what} never wrote {path.name}"
        time.sleep(0.1)
    return path.read_text()


def test_a_killed_rank_leaves_no_forked_child_holding_its_sockets(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    init = tmp_path / "init"
    outs = [tmp_path / "out0", tmp_path / "out1"]
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), str(init), str(outs[r])], env=env)
        for r in (0, 1)
    ]
    child = None
    try:
        child = psutil.Process(int(_wait_for(outs[1], procs[1], "rank 1")))
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(timeout=60)
        # bounded far above the milliseconds it takes: only a hang reaches it
        procs[0].wait(timeout=120)
        assert outs[0].read_text().startswith("error: "), outs[0].read_text()
        _, alive = psutil.wait_procs([child], timeout=60)
        assert not alive, f"rank 1's forked child {child.pid} outlived it"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        if child is not None and child.is_running():
            child.kill()
