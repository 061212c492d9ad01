"""Known library notices routed to a log file instead of the console (stdlib only, so that any
part of the package, the actor's megatron import included, can route them).

``driver/cpu_warnings.py`` says which notices are known and why, and routes a run's; a command
without a run (``convert``) routes its own. A process whose environment names a log in
``LOG_ENV`` routes from the moment megatron-core is imported (``route_from_environment``), which
reaches processes that the router never runs in, such as the ranks' forkserver.
"""

from __future__ import annotations

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
    # a resumed run's ranks: megatron-core's dist_checkpointing loads through torch APIs that
    # torch deprecates (the checkpoint's own format, nothing the user chose)
    (FutureWarning, "`load_state_dict` is deprecated and will be removed in future versions"),
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor"),
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


def route_from_environment() -> None:
    """Route this process's known warnings to the log ``LOG_ENV`` names, if it names one."""
    route_worker_warnings()
