"""A real SGLang server on the CPU for the tests, started through the project's own launcher.

``start_cpu_server(model_path, log_dir)`` runs ``sglang.server.SGLangServer`` with the
repo's ``.venv-sglang`` interpreter (``make setup-sglang``), the CPU flags below and the CPU
stand-ins of ``tests/sglang_cpu`` on the server's PYTHONPATH only, on a free port, and waits for
``/health_generate``. ``stop_cpu_server`` ends its process group and the orphaned
``torch_shm_manager`` daemons that tensor updates leave behind. Tests that need the server skip cleanly (naming
``make setup-sglang``) when the venv is not built, and fail in CI (tests/built.py).

The pytest fixtures in conftest.py wrap these: ``sglang_cpu_server`` (one server per test module
on the tiny Qwen2 checkpoint) and ``sglang_server_factory`` (more servers, other flags).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from built import missing

from megatron_dapo.ports import free_port
from megatron_dapo.sglang.engines import CPU_MEM_FRACTION, cpu_server_env
from megatron_dapo.sglang.engines import CPU_SERVER_ARGS as DRIVER_CPU_SERVER_ARGS
from megatron_dapo.sglang.server import REPO_SGLANG_PYTHON, SGLangServer, SGLangServerConfig

# The CPU flags, environment and kernel stand-ins are the product's own (the driver launches CPU
# servers with them): one definition of what differs on a CPU. fp32 (passed per server) keeps
# log-probs within 1e-5 of HF; 8 running requests bound the server's memory here.
CPU_SERVER_ARGS = [*DRIVER_CPU_SERVER_ARGS, "--max-running-requests", "8"]
# Start-up measured at 20-40 s on an idle 2-core machine; the suite shares it with others.
STARTUP_TIMEOUT_S = 600.0


def sglang_python() -> Path | None:
    """The built SGLang venv's interpreter, or None (then the real-server tests skip)."""
    stamp = REPO_SGLANG_PYTHON.parent.parent / ".installed"
    return REPO_SGLANG_PYTHON if REPO_SGLANG_PYTHON.exists() and stamp.exists() else None


def require_sglang() -> Path:
    python = sglang_python()
    if python is None:
        missing(f"real SGLang server needs {REPO_SGLANG_PYTHON.parent.parent}: run `make setup-sglang`")
    return python


@dataclass
class CPUServer:
    """A running server: its launcher object, URL and the checkpoint it serves."""

    server: SGLangServer
    model_path: Path
    shm_managers_before: set[int] = field(default_factory=set)

    @property
    def url(self) -> str:
        return self.server.cfg.url

    @property
    def log_path(self) -> Path:
        return self.server.log_path


def _shm_manager_pids() -> set[int]:
    """The torch_shm_manager daemons whose starting process has exited (re-parented to init).

    Each process that pickles a CPU tensor with the file_system strategy (a weight update's sender)
    starts one, as its child, and keeps using it: killing a live process's manager breaks its next
    shared-memory tensor with "Broken pipe" (make test's other pytest worker, or this one). Only
    managers left behind by exited processes are anyone's to clean up; a process's own manager
    ends with it (conftest's session cleanup for the pytest processes)."""
    import psutil

    pids = set()
    for p in psutil.process_iter(["name", "ppid"]):
        if p.info["name"] == "torch_shm_manager" and p.info["ppid"] == 1:
            pids.add(p.pid)
    return pids


def launched_servers(root: int) -> list:
    """The `sglang.launch_server` processes among the descendants of pid ``root``, as psutil
    processes. A server's own children (scheduler, detokenizer) are forked with its command line
    and rename themselves a moment later; a child caught in that moment is not a server, so a
    match whose parent also matches is left out."""
    import psutil

    found = {}
    for p in psutil.Process(root).children(recursive=True):
        try:
            if "sglang.launch_server" in " ".join(p.cmdline()):
                found[p.pid] = p
        except psutil.NoSuchProcess:
            continue
    servers = []
    for p in found.values():
        try:
            if p.ppid() not in found:
                servers.append(p)
        except psutil.NoSuchProcess:
            continue
    return servers


def start_cpu_server(
    model_path,
    log_dir,
    *,
    extra_args: list[str] | None = None,
    max_total_tokens: int = 4096,
    enable_memory_saver: bool = False,
    env: dict[str, str] | None = None,
) -> CPUServer:
    """Launch a CPU server on ``model_path`` and wait until it serves (stopped again on failure)."""
    python = require_sglang()
    port = free_port()
    cfg = SGLangServerConfig(
        model_path=str(model_path),
        port=port,
        mem_fraction_static=CPU_MEM_FRACTION,
        dtype="float32",
        enable_memory_saver=enable_memory_saver,
        extra_args=CPU_SERVER_ARGS + list(extra_args or []),
        startup_timeout_s=STARTUP_TIMEOUT_S,
        log_file=str(Path(log_dir) / f"sglang_{port}.log"),
        env={**cpu_server_env(), **(env or {})},
        python=str(python),
        max_total_tokens=max_total_tokens,
    )
    handle = CPUServer(SGLangServer(cfg), Path(model_path), _shm_manager_pids())
    handle.server.start()
    try:
        handle.server.wait_healthy()
    except BaseException:
        stop_cpu_server(handle)
        raise
    return handle


def stop_cpu_server(handle: CPUServer) -> None:
    """End the server's process group (continuing it first if a test stopped it) and new shm daemons."""
    proc = handle.server.proc
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGCONT)
    handle.server.stop(grace_s=20.0)
    # torch_shm_manager daemons outlive their clients when file_system sharing was used; only the
    # ones that appeared while this server ran are ours.
    for pid in _shm_manager_pids() - handle.shm_managers_before:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while _shm_manager_pids() - handle.shm_managers_before and time.monotonic() < deadline:
        time.sleep(0.1)


@contextlib.contextmanager
def real_sglang_server(model_path, log_dir, **kwargs):
    """``start_cpu_server`` as a context manager: the server is stopped (and its shm daemons) on exit."""
    handle = start_cpu_server(model_path, log_dir, **kwargs)
    try:
        yield handle
    finally:
        stop_cpu_server(handle)


def fixed_sequence_logprobs(url: str, sequence: list[int], timeout_s: float = 300.0) -> list[float]:
    """The server's log-probs of tokens 1.. of ``sequence`` given the ones before (its prefill)."""
    import httpx

    body = {
        "input_ids": list(sequence),
        "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    reply = httpx.post(f"{url}/generate", json=body, timeout=timeout_s)
    reply.raise_for_status()
    return [float(item[0]) for item in reply.json()["meta_info"]["input_token_logprobs"][1:]]


def hf_sequence_logprobs(model_path, sequence: list[int]):
    """The same log-probs from an HF transformers fp32 forward of the checkpoint at ``model_path``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    ids = torch.tensor([list(sequence)])
    with torch.no_grad():
        logp = model(ids).logits[0].float().log_softmax(-1)
    return logp[:-1].gather(-1, ids[0, 1:, None])[:, 0]
