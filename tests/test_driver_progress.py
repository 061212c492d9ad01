"""Progress when the output is not a terminal, and the known library notices of a CPU run kept in
the run's log (warnings.log) instead of the console."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading

from rich.console import Console

from megatron_dapo.driver.progress import StepProgress, heartbeat


class _Lines(io.StringIO):
    """A non-terminal stream that signals once ``want`` lines were written."""

    def __init__(self, want: int):
        super().__init__()
        self.want, self.enough = want, threading.Event()

    def write(self, s: str) -> int:
        n = super().write(s)
        if self.getvalue().count("\n") >= self.want:
            self.enough.set()
        return n


def test_heartbeat_prints_lines_while_a_phase_runs_when_not_a_terminal():
    out = _Lines(want=2)
    console = Console(file=out, force_terminal=False, width=200)
    with heartbeat(console, lambda s: f"warm start step 7/900, {s:.0f}s", every=0.05):
        assert out.enough.wait(timeout=60), "no progress lines while the phase ran"
    assert out.getvalue().splitlines()[0].startswith("warm start step 7/900, ")


def test_no_heartbeat_on_a_terminal_or_for_short_phases():
    tty = io.StringIO()
    with heartbeat(Console(file=tty, force_terminal=True), lambda s: "beat", every=0.01):
        threading.Event().wait(0.2)  # a terminal shows the spinner instead
    assert "beat" not in tty.getvalue()
    log = io.StringIO()
    with heartbeat(Console(file=log, force_terminal=False), lambda s: "beat", every=60):
        pass
    assert log.getvalue() == ""


def test_step_phase_heartbeats_in_a_log():
    progress = StepProgress(total_steps=80)
    out = _Lines(want=1)
    progress.console = Console(file=out, force_terminal=False, width=200)
    progress.heartbeat_s = 0.05
    with progress.phase(12, "validation"):
        assert out.enough.wait(timeout=60)
    assert out.getvalue().startswith("step 12/80 validation... ")


# The library notices a CPU run's console showed (make demo, fresh clone), made by the real
# code: the ranks are Ray workers of the trainer's own local cluster (init_ray), which import
# megatron-core, read .grad of a non-leaf tensor and call the collectives torch deprecates; the
# driver's ray.init says the token-auth notice. One real warning must still reach the console.
_CLUSTER = """
import sys, time
from pathlib import Path
import ray
from omegaconf import OmegaConf
from megatron_dapo.driver.launch import init_ray, shutdown_local_ray

runs_dir, console = sys.argv[1], Path(sys.argv[2])
init_ray(OmegaConf.create({"trainer": {"ray_address": None, "runs_dir": runs_dir, "run_name": "r"}}),
         "cpu", num_cpus=1)

@ray.remote
def rank():
    import socket, warnings
    import torch, torch.distributed as dist
    import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    (torch.ones(2, requires_grad=True) * 2).grad
    dist.all_gather_into_tensor(torch.empty(2), torch.ones(2))
    dist.reduce_scatter_tensor(torch.empty(1), torch.ones(1))
    dist.destroy_process_group()
    warnings.warn("a real warning stays")

# with an env of its own, as RayRankGroup starts the ranks
ray.get(rank.options(runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}).remote())
deadline = time.time() + 120  # Ray forwards a worker's stderr to the driver's on its own time
while "a real warning stays" not in console.read_text() and time.time() < deadline:
    time.sleep(0.5)
shutdown_local_ray()
"""
NOISE = (
    "Transformer Engine and Apex are not installed",
    "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed",
    "`torch.distributed.all_gather_into_tensor` is deprecated",
    "`torch.distributed.reduce_scatter_tensor` is deprecated",
    "Token authentication is enabled for this Ray cluster",
)


def test_library_notices_go_to_the_run_log_not_the_console(tmp_path):
    console = tmp_path / "console.txt"
    # RAY_AUTH_MODE set would silence Ray's notice; RAY_ADDRESS must not be joined
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "PYTHONWARNINGS")}
    env["RAY_ADDRESS"] = "127.0.0.1:9"
    with console.open("w") as out:
        proc = subprocess.run(
            [sys.executable, "-c", _CLUSTER, str(tmp_path / "runs"), str(console)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=600,
        )
    text = console.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "a real warning stays" in text, text[-3000:]
    shown = [msg for msg in NOISE if msg in text]
    assert not shown, text[-3000:]
    log = tmp_path / "runs" / "r" / "warnings.log"
    assert log.is_file(), text[-3000:]
    kept = log.read_text()
    assert [msg for msg in NOISE if msg not in kept] == [], kept
    assert "a real warning stays" not in kept
    assert str(log) in text  # the console says where they went


def _routed(script: str, log) -> tuple[subprocess.CompletedProcess, str]:
    """``script`` run in a fresh interpreter (no PYTHONWARNINGS of ours): its result and what
    it routed to ``log``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc, log.read_text()


def test_only_the_known_warnings_are_routed(tmp_path):
    log = tmp_path / "warnings.log"
    script = (
        "import warnings; from megatron_dapo.driver import cpu_warnings; "
        f"cpu_warnings.route_warnings({str(log)!r}); "
        "import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs; "
        "warnings.warn('a real warning stays'); "
        "warnings.warn('Apex is not installed, but as a FutureWarning', FutureWarning)"
    )
    proc, kept = _routed(script, log)
    for msg in ("Transformer Engine and Apex are not installed", "Apex is not installed. Falling back"):
        assert msg in kept and msg not in proc.stderr, proc.stderr
    assert "a real warning stays" in proc.stderr and "a real warning stays" not in kept
    # the same words under another category are not megatron-core's notice
    assert "as a FutureWarning" in proc.stderr


def test_a_resumed_runs_checkpoint_loading_notices_go_to_the_log(tmp_path):
    """A resumed run's ranks load megatron-core's checkpoint through torch.distributed.checkpoint,
    whose deprecation notices reached the console (a fresh run never loads one). Made here by the
    real deprecated call and torch's own ShardedTensor message."""
    log = tmp_path / "warnings.log"
    script = (
        "import warnings, torch; import torch.distributed.checkpoint as dcp; "
        "from torch.distributed._shard._utils import DEPRECATE_MSG; "
        "from megatron_dapo.driver import cpu_warnings; "
        f"cpu_warnings.route_warnings({str(log)!r}); "
        f"ckpt = {str(tmp_path / 'ckpt')!r}; "
        "dcp.save({'w': torch.ones(2)}, checkpoint_id=ckpt, no_dist=True); "
        "sd = {'w': torch.zeros(2)}; "
        "dcp.load_state_dict(sd, dcp.FileSystemReader(ckpt), no_dist=True); "
        "assert sd['w'].tolist() == [1.0, 1.0]; "
        "warnings.warn(DEPRECATE_MSG, FutureWarning); "
        "warnings.warn('a real warning stays')"
    )
    proc, kept = _routed(script, log)
    notices = ("`load_state_dict` is deprecated", "we are deprecating ShardedTensor")
    assert [msg for msg in notices if msg in proc.stderr] == [], proc.stderr
    assert [msg for msg in notices if msg not in kept] == [], kept
    assert "a real warning stays" in proc.stderr and "a real warning stays" not in kept
