"""The python tool's kernel boundary (megatron_dapo/agent/tools/sandbox.py), attacked.

Each hostile case runs model-written code in the sandbox and then checks what lies OUTSIDE it: a
victim process alive, files unchanged and none beside them, secrets absent from the answer, a
listener that got no connection, no process left behind, a flood bounded. Then each element of the
boundary is removed alone (``Sandbox(omit=...)``) and at least one case must get through: no element
is decoration. The machine without user namespaces is simulated for real (a user namespace whose
``max_user_namespaces`` is 0) and the tool refuses in one line.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pty
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_dapo.agent.tools.builtin import PythonLimits, run_python
from megatron_dapo.agent.tools.sandbox import ELEMENTS, Sandbox, SandboxLimits, function_in_sandbox

REPO = Path(__file__).resolve().parents[1]
LIMITS = PythonLimits(timeout_s=8, memory_mb=512, max_processes=24, scratch_mb=32, max_file_mb=16)
SECRET = "mdapo-secret-7f3a9c"
SHARED = REPO.parent / "shared" / "data"


def _run(code: str, omit: frozenset[str] = frozenset(), read: tuple[str, ...] = ()) -> str:
    sandbox = Sandbox(LIMITS.sandbox_limits(), packages=LIMITS.packages, read=read, omit=omit)
    return run_python(code, LIMITS, sandbox).output


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else b"<dir>") for p in folder.rglob("*")
    }


def _procs_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _kill_all(marker: str) -> None:
    for pid in _procs_with(marker):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


@dataclass
class Case:
    """A hostile snippet and the check of what happened outside; ``held(omit, tmp)`` is True when
    the boundary held."""

    name: str
    element: str  # the element that stops it (removing it alone lets this case through)
    held: Callable[[frozenset, Path], bool]


# -- processes ------------------------------------------------------------------------------


def _victim_case(how: str) -> Callable[[frozenset, Path], bool]:
    snippets = {
        "kill": "import os, signal\nos.kill({pid}, signal.SIGKILL)",
        "pidfd": "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open({pid}), signal.SIGKILL)",
        "syscall": "import ctypes\nctypes.CDLL(None).syscall(62, {pid}, 9)",  # SYS_kill on x86_64
        # only the victim's own group: a case that gets through must not take the test run along
        "killpg": "import os\nos.killpg({pid}, 9)",
    }

    def held(omit: frozenset, tmp: Path) -> bool:
        # a victim of the trainer's own user, in a group of its own (killpg must reach it by number)
        victim = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
        )
        try:
            _run(snippets[how].format(pid=victim.pid), omit)
            time.sleep(0.1)
            return victim.poll() is None
        finally:
            victim.kill()
            victim.wait()

    return held


def _no_process_left(how: str) -> Callable[[frozenset, Path], bool]:
    def held(omit: frozenset, tmp: Path) -> bool:
        marker = f"mdapo-left-{how}-{os.getpid()}-{time.monotonic_ns()}"
        sleeper = f"import sys, time; time.sleep(30)  # {marker}"
        snippets = {
            # a daemon: double fork, a new session, then exec of another program
            "daemon": (
                "import os, sys\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                f"        os.execv(sys.executable, [sys.executable, '-c', {sleeper!r}])\n    os._exit(0)\n"
                "print('parent done')"
            ),
        }
        try:
            _run(snippets[how], omit)
            time.sleep(0.3)
            return not _procs_with(marker)
        finally:
            _kill_all(marker)

    return held


def _dies_with_its_caller(omit: frozenset, tmp: Path) -> bool:
    """The process that runs the sandbox (a tool worker) is SIGKILLed mid-call: nothing of the call
    may outlive it."""
    marker = f"mdapo-orphan-{os.getpid()}-{time.monotonic_ns()}"
    # the marker reaches the sandboxed process's command line only (the caller reads the code from
    # its environment), so that finding it finds the sandboxed code and nothing else
    code = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(30)', {marker!r}])"
    caller = (
        "import sys\nfrom megatron_dapo.agent.tools.sandbox import Sandbox\n"
        "from megatron_dapo.agent.tools.builtin import run_python, PythonLimits\n"
        f"lim = PythonLimits(timeout_s=30)\nbox = Sandbox(lim.sandbox_limits(), omit=frozenset({sorted(omit)!r}))\n"
        "import os\nrun_python(os.environ['MDAPO_CODE'], lim, box)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "MDAPO_CODE": code}
    proc = subprocess.Popen([sys.executable, "-c", caller], env=env)
    try:
        deadline = time.monotonic() + 20
        while not _procs_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _procs_with(marker), "the sandboxed code never started"
        proc.kill()
        proc.wait()
        time.sleep(0.5)
        return not _procs_with(marker)
    finally:
        proc.kill()
        _kill_all(marker)


def _fork_flood(omit: frozenset, tmp: Path) -> bool:
    code = (
        "import os, time\nn = 0\nfor _ in range(200):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(3)\n        os._exit(0)\n"
        "    n += 1\nprint('forked', n)"
    )
    out = _run(code, omit)
    forked = int(out.split("forked ")[1].split()[0]) if "forked " in out else 0
    return forked < LIMITS.max_processes


# -- files ------------------------------------------------------------------------------------


def _files_outside(omit: frozenset, tmp: Path) -> bool:
    outside = tmp / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "keep.txt").write_text("keep")
    (outside / "sub" / "deep.txt").write_text("deep")
    before = _snapshot(outside)
    d = str(outside)
    attempts = [
        f"open({d + '/keep.txt'!r}, 'w').write('gone')",
        f"open({d + '/new.txt'!r}, 'w').write('new')",
        f"fd = os.open({d!r}, os.O_RDONLY)\nos.close(os.open('made', os.O_CREAT | os.O_WRONLY, dir_fd=fd))",
        f"fd = os.open({d!r}, os.O_RDONLY)\nos.unlink('keep.txt', dir_fd=fd)",
        f"os.rename({d + '/keep.txt'!r}, {d + '/moved.txt'!r})",
        f"import sqlite3\nsqlite3.connect({d + '/db.sqlite'!r}).execute('create table t(x)')",
        f"os.mkfifo({d + '/fifo'!r})",
        f"import shutil\nshutil.rmtree({d!r})",
        f"os.symlink('/etc/passwd', {d + '/link'!r})",
    ]
    for attempt in attempts:
        _run("import os\n" + attempt, omit)
    return _snapshot(outside) == before


def _dev_shm(omit: frozenset, tmp: Path) -> bool:
    name = f"mdapo-canary-{os.getpid()}-{time.monotonic_ns()}"
    host = Path("/dev/shm") / name
    host.write_text("canary")
    try:
        before = set(os.listdir("/dev/shm"))
        _run(
            f"import os\nfor n in os.listdir('/dev/shm'):\n    os.unlink('/dev/shm/' + n)\nopen('/dev/shm/{name}-new', 'w')",
            omit,
        )
        after = set(os.listdir("/dev/shm"))
        return host.read_text() == "canary" and after == before
    finally:
        host.unlink(missing_ok=True)
        Path(f"/dev/shm/{name}-new").unlink(missing_ok=True)


def _reads_outside(omit: frozenset, tmp: Path) -> bool:
    canary = tmp / "canary.txt"
    canary.write_text(SECRET)
    targets = [str(canary), str(Path.home() / ".bash_history"), "/etc/hostname", str(REPO / "pyproject.toml")]
    if SHARED.is_dir():  # the training data's ground truth
        targets += [str(p) for p in SHARED.glob("*.parquet")]
    code = (
        "import os\n"
        f"for p in {targets!r}:\n"
        "    try:\n        print(p, open(p, 'rb').read()[:4000])\n    except OSError as e:\n        print(p, 'denied', e)\n"
    )
    out = _run(code, omit)
    readable = [t for t in targets if f"{t} b'" in out]
    return SECRET not in out and not readable


def _environment(omit: frozenset, tmp: Path) -> bool:
    os.environ["MDAPO_TEST_SECRET"] = SECRET
    try:
        out = _run("import os\nprint(dict(os.environ))", omit)
    finally:
        del os.environ["MDAPO_TEST_SECRET"]
    return SECRET not in out


def _other_processes_environ(omit: frozenset, tmp: Path) -> bool:
    """Another process's /proc entries (its environment, its command line) stay out of reach."""
    victim = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"], env={**os.environ, "MDAPO_TEST_SECRET": SECRET}
    )
    try:
        code = (
            "import os\nfor p in os.listdir('/proc'):\n    if p.isdigit():\n        try: print(open(f'/proc/{p}/environ', 'rb').read())\n"
            "        except OSError: pass"
        )
        return SECRET not in _run(code, omit)
    finally:
        victim.kill()
        victim.wait()


def _privileged_kernel_interfaces(omit: frozenset, tmp: Path) -> bool:
    """No capabilities, not even inside its own namespaces: the kernel refuses it new namespaces
    and mounts, the interfaces behind most user-namespace kernel exploits. (The other layers keep a
    mount it made inside from reaching the host; this case shows the kernel's own refusal.)"""
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None)\n"
        "print('unshare', libc.unshare(0x00020000))\n"  # CLONE_NEWNS
        "print('mount', libc.mount(b'none', b'/work', b'tmpfs', 0, None))"
    )
    out = _run(code, omit)
    return "unshare 0" not in out and "mount 0" not in out


def _remount_read_only_view(omit: frozenset, tmp: Path) -> bool:
    """A folder the sandbox may read: with capabilities in its namespaces, its read-only bind could
    be remounted writable and the host's files changed through it. The caller is an ordinary user
    here (a user namespace mapping uid 1000), as on a cluster: bwrap then builds the mounts inside
    the sandbox's own user namespace, where capabilities would reach them."""
    shared = tmp / "readable"
    shared.mkdir()
    (shared / "data.txt").write_text("data")
    before = _snapshot(shared)
    code = (
        "import ctypes\nlibc = ctypes.CDLL(None)\n"
        f"libc.mount(None, {str(shared).encode()!r}, None, 32 | 4096 | 2 | 4, None)\n"  # REMOUNT|BIND|NOSUID|NODEV
        f"open({str(shared / 'data.txt')!r}, 'w').write('changed')"
    )
    caller = (
        "import os\nfrom megatron_dapo.agent.tools.sandbox import Sandbox\n"
        "from megatron_dapo.agent.tools.builtin import run_python, PythonLimits\n"
        f"lim = PythonLimits(timeout_s=5)\nbox = Sandbox(lim.sandbox_limits(), read=({str(shared)!r},), "
        f"omit=frozenset({sorted(omit)!r}))\nprint(run_python(os.environ['MDAPO_CODE'], lim, box).output)\n"
    )
    subprocess.run(
        ["unshare", "--user", "--map-user=1000", "--map-group=1000", sys.executable, "-c", caller],
        env={**os.environ, "PYTHONPATH": str(REPO), "MDAPO_CODE": code},
        capture_output=True,
        timeout=60,
    )
    return _snapshot(shared) == before


# -- network, IPC, names, terminal --------------------------------------------------------------


def _network(omit: frozenset, tmp: Path) -> bool:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        _run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'x')", omit)
        try:
            listener.accept()[0].close()
            return False
        except BlockingIOError:
            return True


def _sysv_ipc(omit: frozenset, tmp: Path) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    key = 0x4D440000 + os.getpid() % 0xFFFF
    shmid = libc.shmget(key, 4096, 0o1600)  # IPC_CREAT | 0600
    assert shmid >= 0, os.strerror(ctypes.get_errno())
    try:
        code = (
            "import ctypes\nlibc = ctypes.CDLL(None)\n"
            f"i = libc.shmget({key}, 0, 0)\nprint('found', i)\nlibc.shmctl(i, 0, None)"  # IPC_RMID
        )
        _run(code, omit)
        return libc.shmget(key, 0, 0) == shmid
    finally:
        libc.shmctl(shmid, 0, None)


def _host_name(omit: frozenset, tmp: Path) -> bool:
    return f"name={socket.gethostname()}|" not in _run(
        "import socket\nprint(f'name={socket.gethostname()}|')", omit
    )


def _terminal(omit: frozenset, tmp: Path) -> bool:
    """The trainer runs on a terminal: the code must not reach it (write to it, or push input into
    it with TIOCSTI)."""
    master, slave = pty.openpty()
    caller = (
        "import fcntl, termios, sys\nfcntl.ioctl(0, termios.TIOCSCTTY, 0)\n"
        "from megatron_dapo.agent.tools.sandbox import Sandbox\n"
        "from megatron_dapo.agent.tools.builtin import run_python, PythonLimits\n"
        f"lim = PythonLimits(timeout_s=5)\nbox = Sandbox(lim.sandbox_limits(), omit=frozenset({sorted(omit)!r}))\n"
        "code = \"import os\\nfd = os.open('/dev/tty', os.O_RDWR)\\nos.write(fd, b'PWNED-TTY')\"\n"
        "out = run_python(code, lim, box).output\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", caller],
        stdin=slave,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    os.close(slave)
    proc.wait(timeout=60)
    seen = b""
    os.set_blocking(master, False)
    try:
        while True:
            seen += os.read(master, 4096)
    except (BlockingIOError, OSError):
        pass
    os.close(master)
    return b"PWNED-TTY" not in seen


# -- floods -------------------------------------------------------------------------------------


def _memory_flood(omit: frozenset, tmp: Path) -> bool:
    # 3 GiB reserved at once (what a flood asks for), 600 MiB of it touched: a case that gets
    # through costs the test machine no more than that
    code = "import mmap\nm = mmap.mmap(-1, 3 << 30)\nfor i in range(0, 600 << 20, 4096):\n    m[i] = 1\nprint('allocated')"
    return "allocated" not in _run(code, omit)


def _disk_flood(omit: frozenset, tmp: Path) -> bool:
    """Writes until refused, in each writable-looking place: the scratch, /tmp, /dev/shm, /."""
    code = (
        "import os\nchunk = b'x' * (1 << 20)\n"
        "for where in ('/work/f', '/tmp/g', '/dev/shm/h', '/root_file'):\n    n = 0\n    try:\n"
        "        with open(where, 'wb') as f:\n            for _ in range(160):\n                f.write(chunk); f.flush(); n += 1\n"
        "    except OSError:\n        pass\n    print(where, n)\n    try: os.unlink(where)\n    except OSError: pass\n"
    )
    out = _run(code, omit)
    written = {line.split()[0]: int(line.split()[1]) for line in out.splitlines() if line.startswith("/")}
    return len(written) == 4 and max(written.values()) <= LIMITS.scratch_mb and written["/root_file"] == 0


CASES = [
    Case("signal a process by pid", "pid", _victim_case("kill")),
    Case("signal a process through a pidfd", "pid", _victim_case("pidfd")),
    Case("signal a process with a raw syscall", "pid", _victim_case("syscall")),
    Case("signal its process group", "pid", _victim_case("killpg")),
    Case("leave a daemon behind (double fork, setsid, exec)", "pid", _no_process_left("daemon")),
    Case("outlive a killed caller", "die_with_parent", _dies_with_its_caller),
    Case("flood forks", "nproc", _fork_flood),
    Case(
        "change files outside (open, dir_fd, rename, sqlite, mkfifo, rmtree, symlink)", "view", _files_outside
    ),
    Case("change the host's /dev/shm", "view", _dev_shm),
    Case("read files outside (a canary, the training data, home)", "view", _reads_outside),
    Case("read the trainer's environment", "env", _environment),
    Case("read another process's environment in /proc", "pid", _other_processes_environ),
    Case("remount a read-only folder writable", "view", _remount_read_only_view),
    Case("make namespaces and mounts (kernel attack surface)", "caps", _privileged_kernel_interfaces),
    Case("connect to a listener on localhost", "net", _network),
    Case("remove the host's System V shared memory", "ipc", _sysv_ipc),
    Case("learn the host's name", "uts", _host_name),
    Case("write to the trainer's terminal", "session", _terminal),
    Case("flood memory", "memory", _memory_flood),
    Case("flood the disk", "disk", _disk_flood),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_boundary_holds(case, tmp_path):
    start = time.monotonic()
    assert case.held(frozenset(), tmp_path), f"escaped: {case.name}"
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("element", ELEMENTS)
def test_each_element_of_the_boundary_is_needed(element, tmp_path):
    """Removing ``element`` alone lets at least one hostile case through."""
    cases = [c for c in CASES if c.element == element]
    assert cases, f"no hostile case needs {element}: add one or remove the element"
    breaches = []
    for i, case in enumerate(cases):
        (tmp_path / str(i)).mkdir()
        if not case.held(frozenset({element}), tmp_path / str(i)):
            breaches.append(case.name)
    assert breaches, f"without {element} every case still held: {[c.name for c in cases]}"


def test_the_battery_covers_every_element():
    assert {c.element for c in CASES} == set(ELEMENTS)


def test_a_function_tool_can_ask_for_the_boundary(tmp_path):
    """A function tool (trusted code that runs model-written code itself) inside the sandbox: it
    reads what its entry names and nothing else, and its answer comes back apart from its prints."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "facts.txt").write_text("the answer is 42")
    (tmp_path / "canary.txt").write_text(SECRET)
    tool = tmp_path / "tool" / "shell_like.py"
    tool.parent.mkdir()
    tool.write_text(
        "import os\n"
        "def run(path):\n"
        "    print('noise')\n"
        "    try:\n        return open(path).read()\n    except OSError as e:\n        return f'denied: {e.strerror}'\n"
    )
    box = Sandbox(SandboxLimits(timeout_s=8), read=(str(allowed),))
    value, printed, _ = function_in_sandbox(box, f"{tool}:run", {"path": str(allowed / "facts.txt")})
    assert (value, printed) == ("the answer is 42", "noise\n")
    value, _, _ = function_in_sandbox(box, f"{tool}:run", {"path": str(tmp_path / "canary.txt")})
    assert value == "denied: No such file or directory"


def test_without_user_namespaces_the_tool_refuses_in_one_line(tmp_path):
    """A machine whose kernel refuses user namespaces (made real: a user namespace with
    max_user_namespaces=0): `tools check` and training's pre-flight refuse, in one line."""
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - builtin: python\n")
    inner = f"echo 0 > /proc/sys/user/max_user_namespaces && exec {sys.executable} -m megatron_dapo.cli tools check {tools}"
    res = subprocess.run(
        ["unshare", "--user", "--map-root-user", "sh", "-c", inner],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: tool python: the tool sandbox cannot be made"), (
        lines
    )
    assert "user namespaces" in lines[0] and "sandbox: none" in lines[0]


def test_tools_call_runs_one_call_as_training_does(tmp_path):
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - builtin: python\n    config: {timeout_s: 5}\n")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_dapo.cli",
            "tools",
            "call",
            str(tools),
            "python",
            json.dumps({"code": "import os\nprint(os.getpid(), sorted(os.environ))"}),
            "tool_timeout_s=10",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    answer = json.loads(res.stdout.strip().splitlines()[-1])
    assert answer["status"] == "ok" and answer["metrics"]["isolation"] == "bwrap"
    assert answer["text"].startswith("2 ['HOME', 'LANG'")  # pid 2 of its own namespace, a minimal environment
