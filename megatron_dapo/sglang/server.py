"""Launching and supervising one SGLang server process (``python -m sglang.launch_server``).

Nothing here imports sglang: the server is a child process, started with the flags that
``sglang.srt.server_args`` defines (``--model-path``, ``--tp-size``, ``--host``, ``--port``,
``--mem-fraction-static``, ``--dtype``, ``--api-key``, ``--enable-memory-saver``,
``--skip-server-warmup``), and waited on by polling ``GET /health_generate`` (the endpoint
that runs one real decode step) until it answers 200.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megatron_dapo.rollout.engine import EngineError
from megatron_dapo.sglang.health import poll_health
from megatron_dapo.sglang.version import parse_version, unsupported

# SGLang 0.5.23's server flag (ServerArgs.enable_return_routed_experts, arg_groups/fields/exec_.py)
# without which it allocates no RoutedExpertsCapturer and no reply carries meta_info.routed_experts.
ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"


class SGLangStartupError(EngineError):
    """The server exited or did not become healthy in time; the message carries its log tail."""


@dataclass
class SGLangServerConfig:
    """One SGLang server.

    Attributes:
        model_path: HF checkpoint directory to serve.
        tp_size: tensor-parallel GPUs of this server.
        base_gpu_id: first GPU index it uses (``--base-gpu-id``); None leaves SGLang's default.
        enable_memory_saver: needed for ``release/resume_memory_occupation`` (colocation).
        dtype: ``auto``, ``bfloat16``, ``float16`` ...
        extra_args: appended verbatim (e.g. ``["--context-length", "32768"]``).
        startup_timeout_s: how long to wait for ``/health_generate``.
        log_file: where stdout/stderr go (default: ``sglang_<port>.log`` in the cwd).
        env: extra environment variables for the server process.
        python: interpreter that runs the server; None: :func:`default_server_python`.
        deterministic: ``--enable-deterministic-inference``; SGLang applies a request's
            ``sampling_seed`` only with it.
        max_total_tokens: KV pool size in tokens (``--max-total-tokens``); None leaves SGLang to
            size it from the memory free at its start (callers should not).
        sleep_on_idle: ``--sleep-on-idle``: with no request, the scheduler blocks on its sockets
            instead of polling them, which holds a CPU core per server at 100% for as long as the
            trainer updates and syncs. A request still wakes it at once.
    """

    model_path: str
    tp_size: int = 1
    host: str = "127.0.0.1"
    port: int = 30000
    mem_fraction_static: float = 0.7
    api_key: str | None = None
    enable_memory_saver: bool = False
    dtype: str = "auto"
    base_gpu_id: int | None = None
    skip_server_warmup: bool = True
    extra_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 900.0
    log_file: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    python: str | None = None
    max_total_tokens: int | None = None
    # ROUTED_EXPERTS_FLAG: replies can carry each MoE layer's experts per token (routing replay).
    return_routed_experts: bool = False
    deterministic: bool = False
    sleep_on_idle: bool = True

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


# The SGLang venv `make setup-sglang` builds next to the package (a source checkout).
REPO_SGLANG_PYTHON = Path(__file__).resolve().parents[2] / ".venv-sglang" / "bin" / "python"


def default_server_python() -> str:
    """``rollout.sglang.python`` when unset: the repo's ``.venv-sglang`` if built, else this interpreter.

    SGLang's pins clash with the trainer's, so a source checkout runs it from its own venv; an
    image with sglang installed next to the trainer (the Dockerfile) uses the same interpreter.
    """
    return str(REPO_SGLANG_PYTHON) if REPO_SGLANG_PYTHON.exists() else sys.executable


def installed_sglang_version(python: str, timeout_s: float = 120.0) -> tuple[int, ...]:
    """The sglang version installed for ``python`` (from its package metadata; no import of sglang)."""
    probe = "from importlib.metadata import version; print(version('sglang'))"
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SGLangStartupError(
            f"cannot run the SGLang interpreter {python} (rollout.sglang.python): {e}"
        ) from e
    if out.returncode != 0:
        raise SGLangStartupError(
            f"sglang is not installed for {python} (rollout.sglang.python): {out.stderr.strip()[-300:]}"
        )
    return parse_version(out.stdout.strip())


def check_launchable(python: str) -> tuple[int, ...]:
    """Refuse to launch an SGLang release outside the supported range, naming that range."""
    version = installed_sglang_version(python)
    why = unsupported(version)
    if why:
        raise SGLangStartupError(
            f"{python}: {why} (pip install 'megatron-dapo[gpu]', or `make setup-sglang` for the CPU tests)"
        )
    return version


def build_launch_command(cfg: SGLangServerConfig, python: str | None = None) -> list[str]:
    """The ``python -m sglang.launch_server ...`` argv for ``cfg``."""
    cmd = [python or cfg.python or default_server_python(), "-m", "sglang.launch_server"]
    cmd += ["--model-path", str(cfg.model_path), "--tp-size", str(cfg.tp_size)]
    cmd += ["--host", cfg.host, "--port", str(cfg.port)]
    cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static), "--dtype", cfg.dtype]
    if cfg.base_gpu_id is not None:
        cmd += ["--base-gpu-id", str(cfg.base_gpu_id)]
    if cfg.api_key:
        cmd += ["--api-key", cfg.api_key]
    if cfg.enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if cfg.skip_server_warmup:
        cmd.append("--skip-server-warmup")
    if cfg.sleep_on_idle:
        cmd.append("--sleep-on-idle")
    if cfg.deterministic:
        cmd.append("--enable-deterministic-inference")
    if cfg.max_total_tokens is not None:
        cmd += ["--max-total-tokens", str(int(cfg.max_total_tokens))]
    if cfg.return_routed_experts:
        cmd.append(ROUTED_EXPERTS_FLAG)
    return cmd + list(cfg.extra_args)


# What torchrun sets for the trainer's ranks. A server started by a rank must not inherit it:
# SGLang's own torch.distributed init (tcp://) then finds TORCHELASTIC_USE_AGENT_STORE and connects
# to its own store as a client, waiting forever at "Init parallel begin"; the rest names the
# trainer's group, not the server's.
TRAINER_LAUNCH_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


# stop() ends a server with a SIGTERM to its process group: the scheduler dies with the rest, and
# SGLang's main process takes that for a child's crash. Its crash diagnostics then sleep 5 s
# before a py-spy dump, and a CUDA core dump may wait 60 s more: every stop of a run's servers
# paid it (5.9 s against 1.3 s for a CPU server stop, measured). Off unless the user sets them.
QUIET_STOP_ENV = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}


def server_environment(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment without the trainer's launcher variables, plus ``extra``; SGLang's
    crash diagnostics off (``QUIET_STOP_ENV``) unless either sets them."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in TRAINER_LAUNCH_ENV and not k.startswith("TORCHELASTIC_")
    }
    return {**QUIET_STOP_ENV, **env, **extra}


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# log lines a start-up error leaves out (see SGLangServer.log_tail): the argument dump, Python's
# warning lines and the source line it echoes after each
_NOISE = re.compile(r"server_args=|Warning: |^\s*warnings\.warn\(")
_TAIL_LINE_CHARS = 300


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGKILL the child when the thread that started it dies.

    A server runs in its own session (so a signal to the trainer's process group, as Slurm sends,
    reaches only the trainer, which stops the servers after its checkpoint); without this it would
    also outlive a trainer that is SIGKILLed or crashes, holding its GPUs and port. SGLang's own
    scheduler and detokenizer processes die with the server (SGLang arms the same signal in them).
    Linux ties the signal to the starting *thread*: start servers from a thread that lives as long
    as they should (the main thread, or a Ray actor's). None on other systems.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before fork: nothing to load in the child
    parent = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != parent:  # the parent died between fork and prctl: no signal would come
            os._exit(1)

    return arm


class SGLangServer:
    """A supervised server process. ``start()`` launches it, ``wait_healthy()`` blocks until it serves.

    Args:
        cfg: the server's config.
        command: argv to run instead of :func:`build_launch_command` (tests use a stand-in server).
        poll_s: interval between health polls.
    """

    def __init__(self, cfg: SGLangServerConfig, command: list[str] | None = None, poll_s: float = 1.0):
        self.cfg = cfg
        # a stand-in command (tests) is not SGLang: only the real launcher is version-checked
        self.check_version = command is None
        self.command = command or build_launch_command(cfg)
        self.poll_s = poll_s
        self.log_path = Path(cfg.log_file or f"sglang_{cfg.port}.log")
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def name(self) -> str:
        return f"sglang@{self.cfg.host}:{self.cfg.port}"

    def start(self) -> SGLangServer:
        if self.proc is not None and self.proc.poll() is None:
            raise SGLangStartupError(f"{self.name} is already running (pid {self.proc.pid})")
        if self.check_version:
            check_launchable(self.command[0])
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        env = server_environment(self.cfg.env)
        # own session: the process group's SIGTERM reaches only the trainer, and stop() ends the
        # scheduler/detokenizer children with it; killed by the kernel if its starter dies first
        self.proc = subprocess.Popen(
            self.command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        """Poll ``/health_generate`` until 200; raise with the log tail if the server dies or times out."""
        timeout_s = self.cfg.startup_timeout_s if timeout_s is None else timeout_s
        seen = poll_health(
            self.cfg.url,
            timeout_s,
            path="/health_generate",
            api_key=self.cfg.api_key,
            poll_s=self.poll_s,
            alive=self.alive,
        )
        if seen.healthy:
            return
        if seen.exited:
            code = self.proc.returncode if self.proc is not None else None
            raise SGLangStartupError(
                f"{self.name} exited with code {code} during start-up; last log lines of "
                f"{self.log_path}:\n{self.log_tail()}"
            )
        raise SGLangStartupError(
            f"{self.name} not healthy after {timeout_s:g}s (rollout.sglang.startup_timeout_s; last "
            f"/health_generate: {seen.last}); last log lines of {self.log_path}:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 12) -> str:
        """The log's last ``lines`` lines that say something, each cut to ``_TAIL_LINE_CHARS``: an
        error line carries it to the console, where SGLang's start-up dump (one ~15,000-character
        ``server_args=`` line) and its platform warnings would bury the cause; the log has it all."""
        try:
            with self.log_path.open("rb") as f:
                tail = deque(f, maxlen=lines * 8)
        except OSError:
            return "(no log)"
        kept = [
            line
            for line in (raw.decode(errors="replace").rstrip() for raw in tail)
            if line.strip() and not _NOISE.search(line)
        ][-lines:]
        return "\n".join(
            line if len(line) <= _TAIL_LINE_CHARS else line[:_TAIL_LINE_CHARS] + " [...]" for line in kept
        )

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL after ``grace_s``. A server whose own process already
        died (killed, or crashed during start-up) may have left children in its group (SGLang's
        scheduler and detokenizer): they are killed too, never left running."""
        if self.proc is not None and self.proc.poll() is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
                # a stopped (SIGSTOP) group would keep the SIGTERM pending until the SIGKILL
                os.killpg(self.proc.pid, signal.SIGCONT)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def kill(self) -> None:
        """SIGKILL the whole process group at once: a server that is being restarted because it
        died or stopped answering (hung, or SIGSTOPped) gets no grace period, and children that
        outlived their parent go with it."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self) -> int:
        """Kill (see `kill`), start again, wait until healthy; the new pid."""
        self.kill()
        self.start()
        self.wait_healthy()
        return self.proc.pid

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
