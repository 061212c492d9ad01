"""Library notices that are expected on the CPU path: kept in the run's log, off the console.

On CPU, with a local Ray cluster, the libraries under the trainer say things a user can do
nothing about, in every Ray worker and once per run:
- megatron-core at import: Transformer Engine and Apex are absent, so it uses its local
  implementations (on CPU that is the design), and two GPU-only tuning hints;
- megatron-core reading ``.grad`` of a non-leaf tensor (torch's UserWarning, megatron's code);
- torch's FutureWarnings for the collective names megatron-core calls
  (``all_gather_into_tensor``, ``reduce_scatter_tensor``);
- on resume, torch's FutureWarnings for the checkpoint-loading calls megatron-core's
  ``dist_checkpointing`` makes (``load_state_dict``, ``ShardedTensor``);
- Ray's token-authentication notice at ``ray.init`` (and the token it generates on a fresh
  machine).
Each goes to ``RUN/warnings.log`` (``log_path``) instead of the console: a Ray worker routes
them from its start (``worker_runtime_env``: Ray runs the setup hook before the worker imports
megatron-core), the driver routes its own (``route_driver``) and prints ``CPU_NOTE`` once. Every
other warning still shows where it did. On GPUs nothing is routed: a missing Transformer Engine
matters there.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from megatron_dapo.notices import (  # noqa: F401 - the driver's names for them
    KNOWN_CPU_WARNINGS,
    LOG_ENV,
    LOG_NAME,
    _append,
    is_known,
    log_path,
    route_warnings,
    route_worker_warnings,
)

# Ray's loggers whose records are routed, whatever they say: the token notice and the token's path
RAY_NOTICE_LOGGERS = ("ray._private.authentication.authentication_token_setup",)

CPU_NOTE = (
    "megatron-core on CPU: Transformer Engine and Apex are absent, so it uses its local implementations "
    "(optimizer, norms, grad clipping); its notices about that, and other known library notices, go "
    "to {log}"
)


def worker_runtime_env(run_dir: str | os.PathLike) -> dict:
    """The part of a local cluster's ``runtime_env`` that routes every worker's known warnings."""
    return {
        "env_vars": {LOG_ENV: str(log_path(run_dir))},
        "worker_process_setup_hook": f"{__name__}.route_worker_warnings",
    }


class _ToLog(logging.Filter):
    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def filter(self, record: logging.LogRecord) -> bool:
        _append(self.path, f"{record.levelname} {record.name}: {record.getMessage()}")
        return False  # not to the console


def route_driver(run_dir: str | os.PathLike) -> Path:
    """Route the driver's known warnings and Ray's notices to the run's log; returns its path."""
    path = log_path(run_dir)
    route_warnings(path)
    for name in RAY_NOTICE_LOGGERS:
        logger = logging.getLogger(name)
        for f in [f for f in logger.filters if isinstance(f, _ToLog)]:
            logger.removeFilter(f)  # a second run in this process logs to its own directory
        logger.addFilter(_ToLog(path))
    return path
