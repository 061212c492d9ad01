"""Library notices that are expected on the CPU path: kept in the run's log, off the console.

On CPU, with a local Ray cluster, the libraries under the trainer say things a user can do
nothing about, in every Ray worker and once per run:
- megatron-core at import: Transformer Engine and Apex are absent, so it uses its local
  implementations (on CPU that is the design), and two GPU-only tuning hints;
- megatron-core reading ``.grad`` of a non-leaf tensor (torch's UserWarning, megatron's code);
- torch's FutureWarnings for the collective names megatron-core calls
  (``all_gather_into_tensor``, ``reduce_scatter_tensor``);
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
import re
import time
import warnings
from pathlib import Path

LOG_NAME = "warnings.log"
# the worker's log file; the setup hook reads it (Ray passes the hook a module path, no arguments)
LOG_ENV = "MEGATRON_DAPO_WARNINGS_LOG"

# (category, message prefix as the warnings module's filters match it: start, case-insensitive)
KNOWN_CPU_WARNINGS = (
    (UserWarning, "Transformer Engine and Apex are not installed"),
    (UserWarning, "Apex is not installed"),
    (UserWarning, "full scope is deprecated"),
    (
        UserWarning,
        "When using async grad allreduce it is recommended to set the environment variable "
        "CUDA_DEVICE_MAX_CONNECTIONS",
    ),
    (UserWarning, "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed"),
    (FutureWarning, "`torch.distributed.all_gather_into_tensor` is deprecated"),
    (FutureWarning, "`torch.distributed.reduce_scatter_tensor` is deprecated"),
)
# Ray's loggers whose records are routed, whatever they say: the token notice and the token's path
RAY_NOTICE_LOGGERS = ("ray._private.authentication.authentication_token_setup",)

CPU_NOTE = (
    "megatron-core on CPU: Transformer Engine and Apex are absent, so it uses its local implementations "
    "(optimizer, norms, grad clipping); its notices about that, and other known library notices, go "
    "to {log}"
)


def log_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / LOG_NAME


def is_known(message: str, category: type) -> bool:
    return any(
        issubclass(category, cat) and re.match(re.escape(prefix), message, re.IGNORECASE)
        for cat, prefix in KNOWN_CPU_WARNINGS
    )


def _append(path: Path, text: str) -> None:
    """One write per notice, O_APPEND: the workers of a run share the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: {text.rstrip()}\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode("utf-8", "replace"))
    finally:
        os.close(fd)


def route_warnings(path: str | os.PathLike) -> None:
    """From now on, this process writes the known warnings to ``path`` instead of stderr."""
    path = Path(path)
    shown = warnings.showwarning
    if getattr(shown, "megatron_dapo_log", None) == path:
        return

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if is_known(str(message), category):
            _append(path, warnings.formatwarning(message, category, filename, lineno, line))
        else:
            shown(message, category, filename, lineno, file, line)

    showwarning.megatron_dapo_log = path
    warnings.showwarning = showwarning


def route_worker_warnings() -> None:
    """Ray's ``worker_process_setup_hook``: route this worker's known warnings to the run's log."""
    path = os.environ.get(LOG_ENV)
    if path:
        route_warnings(path)


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
