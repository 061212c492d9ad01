"""The trainer's local Ray cluster is its own, and its workers (the trainer's ranks and engines) run
at the driver's priority, not Ray's default niceness +15, which starves a run on a shared machine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

_SCRIPT = """
import os
import ray
from omegaconf import OmegaConf
from megatron_dapo.driver.launch import init_ray

init_ray(OmegaConf.create({"trainer": {"ray_address": None}}), "cpu", num_cpus=1)
worker = ray.get(ray.remote(lambda: os.nice(0)).remote())
print("NICE", os.nice(0), worker)
ray.shutdown()
"""


def test_own_local_cluster_whose_workers_keep_the_driver_niceness():
    # Another cluster's address in the environment (as any concurrent run leaves in
    # /tmp/ray/ray_current_cluster) must not be joined: nothing listens there.
    env = dict(os.environ, RAY_ADDRESS="127.0.0.1:9")
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("NICE"))
    _, driver, worker = line.split()
    assert worker == driver, f"Ray worker niceness {worker}, driver {driver}"
