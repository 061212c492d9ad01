"""Test-only hooks: hold the driver after a given step, so a test can signal or kill the run at a
known point instead of racing a fast machine to it.

Unset (every real run) it costs one environment lookup per step. Set
``MEGATRON_DAPO_TEST_HOLD_AFTER_STEP=N``: once step N is logged (and checkpointed if due), the
driver waits until a stop signal arrives, the file named by ``MEGATRON_DAPO_TEST_HOLD_RELEASE``
exists, or ``HOLD_LIMIT_S`` passes (so a broken test cannot hang a run for ever).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from megatron_dapo.driver.stop import StopFlag

HOLD_ENV = "MEGATRON_DAPO_TEST_HOLD_AFTER_STEP"
RELEASE_ENV = "MEGATRON_DAPO_TEST_HOLD_RELEASE"
HOLD_LIMIT_S = 600.0
# "RANK:N": that training rank blocks in its N-th train_step (1-based) as a hung process would
HANG_ENV = "MEGATRON_DAPO_TEST_HANG_IN_TRAIN_STEP"


def hold_after_step(step: int, stop: StopFlag) -> None:
    want = os.environ.get(HOLD_ENV)
    if want is None or int(want) != step:
        return
    release = os.environ.get(RELEASE_ENV)
    deadline = time.monotonic() + HOLD_LIMIT_S
    while time.monotonic() < deadline:
        if stop.wait(0.1) or (release and Path(release).exists()):
            return


def hang_in_train_step(rank: int, call_number: int) -> None:
    """Block for HOLD_LIMIT_S when HANG_ENV names this rank and call (a rank that hangs, alive)."""
    want = os.environ.get(HANG_ENV)
    if want is None or want != f"{rank}:{call_number}":
        return
    time.sleep(HOLD_LIMIT_S)
