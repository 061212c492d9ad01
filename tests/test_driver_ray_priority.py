"""The trainer's local Ray cluster: its own, its workers (the trainer's ranks and engines) at the
driver's priority, not Ray's default niceness +15, which starves a run on a shared machine; and
stopped without Ray's graceful wait on daemons that cannot receive its SIGTERM."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

_SCRIPT = """
import json, os, subprocess
import psutil
import ray
from omegaconf import OmegaConf
from megatron_dapo.driver.launch import init_ray, shutdown_local_ray

import tempfile
trainer = {"ray_address": None, "runs_dir": tempfile.mkdtemp(), "run_name": "r"}
init_ray(OmegaConf.create({"trainer": trainer}), "cpu", num_cpus=2)
worker = ray.get(ray.remote(lambda: os.nice(0)).remote())
logs = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")
daemons = [p.pid for p in psutil.Process().children()]
terminated = []
terminate = subprocess.Popen.terminate
def record(self):
    terminated.append(self.pid)
    terminate(self)
subprocess.Popen.terminate = record
shutdown_local_ray()
alive = [pid for pid in daemons if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
# worker-<id>-<job>-<pid>.out; job ffffffff: started before any driver connected (prestarted)
jobs = [f.split("-")[2] for f in os.listdir(logs) if f.startswith("worker-") and f.endswith(".out")]
print("RESULT " + json.dumps({"driver_nice": os.nice(0), "worker_nice": worker, "daemons": daemons,
                               "terminated": terminated, "alive": alive, "worker_jobs": jobs}))
"""


@pytest.fixture(scope="module")
def cluster_run():
    # Another cluster's address in the environment (as any concurrent run leaves in
    # /tmp/ray/ray_current_cluster) must not be joined: nothing listens there.
    env = dict(os.environ, RAY_ADDRESS="127.0.0.1:9")
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_own_local_cluster_whose_workers_keep_the_driver_niceness(cluster_run):
    assert cluster_run["worker_nice"] == cluster_run["driver_nice"], cluster_run


def test_ray_daemons_are_killed_without_a_sigterm_they_cannot_receive(cluster_run):
    """init_ray starts them with SIGTERM blocked (a group signal must reach only the driver);
    Ray's own shutdown sent each one SIGTERM and waited a second for it, 5 s a run."""
    assert len(cluster_run["daemons"]) >= 2, cluster_run  # GCS and raylet at least
    assert cluster_run["terminated"] == [], cluster_run
    assert cluster_run["alive"] == [], cluster_run


def test_ray_prestarts_no_idle_workers(cluster_run):
    """The trainer's processes are actors, each in a worker of its own: the workers Ray otherwise
    prestarts at start-up (one per CPU, before any job) sit idle, each a Python start-up and a
    Ray import taken from the run's CPUs (2 of 5 workers of a 3-actor cluster). Here one task
    ran, in a worker started for the driver's job."""
    jobs = cluster_run["worker_jobs"]
    assert jobs and "ffffffff" not in jobs, jobs
