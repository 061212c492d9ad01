"""Built-in tools, chosen in the tool YAML with ``builtin: calculator`` or ``builtin: python``.

- ``calculator``: exact arithmetic on integers and decimals (:func:`calculator`).
- ``python``: the code interpreter of ReTool / SimpleTIR (:class:`PythonTool`): each call runs the
  code in a fresh ``python -I`` subprocess, limited in time, memory, CPU and file size, in a scratch
  directory that is removed afterwards, with an empty environment and no network.

This module runs inside the tool worker, which must stay light: the standard library only.
"""

from __future__ import annotations

import ast
import contextlib
import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction

__all__ = [
    "BUILTIN_OPTIONS",
    "BUILTIN_SCHEMAS",
    "PythonLimits",
    "PythonRun",
    "PythonTool",
    "calculator",
    "network_isolation",
    "run_python",
]

CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": (
            "Evaluates an arithmetic expression exactly: integers and decimals, + - * / // % ** and "
            "parentheses. Integer results are exact; a division that does not terminate is given as a "
            "reduced fraction p/q."
        ),
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example (2+3)*4/7"}},
            "required": ["expression"],
        },
    },
}

PYTHON_SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "description": (
            "Runs Python 3 code and returns what it prints (stdout and stderr). Each call starts a fresh "
            "interpreter: no variables, imports or files are kept between calls. There is no network "
            "access and no way to start other programs."
        ),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the Python code to run"}},
            "required": ["code"],
        },
    },
}

BUILTIN_SCHEMAS = {"calculator": CALCULATOR_SCHEMA, "python": PYTHON_SCHEMA}

# The keys each builtin takes under `config:` in the tool YAML, with their types; the loader
# (spec.py) checks them, the worker reads them.
BUILTIN_OPTIONS: dict[str, dict[str, type]] = {
    "calculator": {"max_digits": int},
    "python": {
        "timeout_s": float,
        "memory_mb": int,
        "max_output_chars": int,
        "max_file_mb": int,
        "netns": bool,
    },
}

# ---------------------------------------------------------------------------------------------
# calculator

# Results (and every intermediate value, numerator and denominator alike) are refused past this
# many decimal digits: 10**1000 prints as 1001 characters, already more than a tool answer can
# usefully carry, and the bound keeps a call under a millisecond (2**10**9 would take minutes).
DEFAULT_MAX_DIGITS = 1000
# Python refuses to print ints of more than 4300 digits (sys.int_info.str_digits_check_threshold).
MAX_DIGITS_LIMIT = 4000
_MAX_EXPRESSION_CHARS = 2000
_LOG10_2 = math.log10(2)


class _CalcError(Exception):
    """A user error in the expression; its message is shown after ``Error: ``."""


def calculator(expression: str, *, max_digits: int = DEFAULT_MAX_DIGITS) -> str:
    """Evaluate ``expression`` exactly and return the result as text, or ``"Error: ..."``.

    Accepted: integer and decimal literals (``12``, ``0.1``, ``1e3``, ``1_000``), ``+ - * / // %
    **``, unary ``-`` and ``+``, parentheses; Python's precedence and its floor semantics for ``//``
    and ``%`` (``-5 % 3`` is ``1``). The expression is parsed with :mod:`ast` and walked with a
    whitelist of node types: nothing is ``eval``-ed.

    Arithmetic is on exact fractions. The answer is an integer when the result is one (``347*28``
    -> ``9716``); otherwise a decimal when its expansion terminates (``7/2`` -> ``3.5``, ``0.1+0.2``
    -> ``0.3``), else the reduced fraction ``p/q`` (``1/3`` -> ``1/3``, ``-4/6`` -> ``-2/3``).

    Bounded: any value (numerator or denominator) of more than ``max_digits`` decimal digits is
    refused, estimated before computing a power; exponents must be integers (a fractional power
    has no exact answer).
    """
    if not isinstance(expression, str):
        return f"Error: expression must be a string, got {type(expression).__name__}"
    if len(expression) > _MAX_EXPRESSION_CHARS:
        return f"Error: expression is longer than {_MAX_EXPRESSION_CHARS} characters"
    max_digits = max(1, min(int(max_digits), MAX_DIGITS_LIMIT))
    text = expression.strip()
    if not text:
        return "Error: empty expression"
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        where = f" at column {e.offset}" if e.offset else ""
        return f"Error: cannot parse the expression{where}: {e.msg}"
    except (ValueError, RecursionError, MemoryError) as e:  # huge literals, deep nesting
        return f"Error: cannot parse the expression: {e}"
    try:
        value = _Evaluator(text, max_digits).eval(tree.body)
    except _CalcError as e:
        return f"Error: {e}"
    except ZeroDivisionError:
        return "Error: division by zero"
    except RecursionError:
        return "Error: the expression is nested too deeply"
    return _format(value)


_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: Fraction(a // b),
    ast.Mod: lambda a, b: a % b,
}
_REFUSED_OPS = {
    ast.BitXor: "^ is not a power here: write ** (2**10)",
    ast.BitAnd: "& is not supported",
    ast.BitOr: "| is not supported",
    ast.LShift: "<< is not supported",
    ast.RShift: ">> is not supported",
    ast.MatMult: "@ is not supported",
}


class _Evaluator:
    def __init__(self, source: str, max_digits: int):
        self.source = source
        self.max_digits = max_digits

    def eval(self, node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant):
            return self._literal(node)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = self.eval(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp):
            if type(node.op) in _REFUSED_OPS:
                raise _CalcError(_REFUSED_OPS[type(node.op)])
            left, right = self.eval(node.left), self.eval(node.right)
            if isinstance(node.op, ast.Pow):
                return self._check(self._power(left, right))
            op = _BINOPS.get(type(node.op))
            if op is None:
                raise _CalcError(f"operator {type(node.op).__name__} is not supported")
            return self._check(op(left, right))
        if isinstance(node, ast.Name):
            raise _CalcError(
                f"names are not allowed ({node.id!r}): use only numbers, + - * / // % ** and parentheses"
            )
        if isinstance(node, ast.Call):
            raise _CalcError(
                "function calls are not allowed: use only numbers, + - * / // % ** and parentheses"
            )
        raise _CalcError(
            f"unsupported element {ast.get_source_segment(self.source, node) or type(node).__name__!r}: "
            "use only numbers, + - * / // % ** and parentheses"
        )

    def _literal(self, node: ast.Constant) -> Fraction:
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _CalcError(f"unsupported literal {value!r}: only integers and decimals")
        if isinstance(value, int):
            return self._check(Fraction(value))
        # a float literal is read from its text so that 0.1 is exactly 1/10, not the nearest double
        text = (ast.get_source_segment(self.source, node) or repr(value)).replace("_", "")
        try:
            dec = Decimal(text)
        except InvalidOperation:
            raise _CalcError(f"cannot read the number {text!r}") from None
        if not dec.is_finite() or abs(dec.adjusted()) > self.max_digits:
            raise _CalcError(f"the number {text!r} has more than {self.max_digits} digits")
        return self._check(Fraction(dec))

    def _power(self, base: Fraction, exponent: Fraction) -> Fraction:
        if exponent.denominator != 1:
            raise _CalcError(
                "only integer exponents give exact results (use a fraction's numerator and root)"
            )
        e = exponent.numerator
        if base == 0 and e < 0:
            raise ZeroDivisionError
        if base.denominator == 1 and abs(base.numerator) <= 1:
            return base**e  # 0, 1 and -1 stay small whatever the exponent
        # the result has about |e| * log10(max(|num|, den)) digits: refuse before computing it
        size = math.log10(max(abs(base.numerator), base.denominator))
        if abs(e) > 10 * self.max_digits or abs(e) * size > self.max_digits + 1:
            raise _CalcError(f"the result would have more than {self.max_digits} digits")
        return base**e

    def _check(self, value: Fraction) -> Fraction:
        # bit lengths first: they rule out almost every value without printing it
        limit_bits = (self.max_digits + 1) / _LOG10_2
        big = value.numerator.bit_length() > limit_bits or value.denominator.bit_length() > limit_bits
        if big and max(_digits(value.numerator), _digits(value.denominator)) > self.max_digits:
            raise _CalcError(f"the result would have more than {self.max_digits} digits")
        return value


def _digits(n: int) -> int:
    return len(str(abs(n)))


def _format(value: Fraction) -> str:
    num, den = value.numerator, value.denominator
    if den == 1:
        return str(num)
    rest, twos, fives = den, 0, 0
    while rest % 2 == 0:
        rest //= 2
        twos += 1
    while rest % 5 == 0:
        rest //= 5
        fives += 1
    if rest != 1:
        return f"{num}/{den}"
    places = max(twos, fives)
    scaled = abs(num) * 10**places // den  # exact: den divides 10**places
    digits = str(scaled).rjust(places + 1, "0")
    sign = "-" if num < 0 else ""
    return f"{sign}{digits[:-places]}.{digits[-places:]}"


# ---------------------------------------------------------------------------------------------
# python


@dataclass(frozen=True)
class PythonLimits:
    """Limits of one run of the python tool.

    ``timeout_s``: wall clock; past it the process group is killed and the tool says so itself
    (it is kept below the tool host's timeout, which would kill the whole tool worker).
    ``memory_mb``: address space (RLIMIT_AS). CPU time (RLIMIT_CPU) is the wall-clock limit
    rounded up plus 1 s, a backstop for code that holds the process when the wall clock is up.
    ``max_file_mb``: largest file the code may write (RLIMIT_FSIZE). ``max_output_chars``: what is
    returned, the start and the end of longer output (a traceback sits at the end).
    ``netns``: run in a network namespace of its own (``unshare``) when the machine allows.
    RLIMIT_NPROC is left alone: it counts every process of the user (a trainer has many) and root
    is exempt from it; the interpreter's audit hook refuses to start processes instead.
    """

    timeout_s: float = 10.0
    memory_mb: int = 1024
    max_output_chars: int = 16384
    max_file_mb: int = 64
    netns: bool = True


@dataclass
class PythonRun:
    """What one run of the python tool gave: ``output`` (the text shown to the model), the exit
    code (negative: killed by that signal), whether the wall-clock limit stopped it, whether the
    output was cut, and the isolation it ran under."""

    output: str
    exit_code: int
    timed_out: bool
    truncated: bool
    isolation: str


def network_isolation(unshare: str | None = None) -> list[str]:
    """The command prefix that gives a process a network namespace of its own, [] if none works here.

    ``unshare -rn`` (a user namespace, works unprivileged where the kernel allows it) is tried
    first, then ``unshare -n`` (needs CAP_SYS_ADMIN, as root in most containers)."""
    unshare = unshare or shutil.which("unshare") or ""
    if not unshare:
        return []
    for flags in ("-rn", "-n"):
        try:
            probe = subprocess.run(
                [unshare, flags, "true"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=10,
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return [unshare, flags]
    return []


# Runs first in the fresh interpreter, before the user's code (main.py in the scratch directory):
# limits, then an audit hook that Python code cannot remove. Process creation and the network
# are refused outright; writes are allowed only in the scratch directory. This guards against a
# model's accidents (rm -rf, a pip install, a web request), not against hostile code written to
# escape: for that, run the tool workers in a container or a gVisor/firecracker sandbox.
_BOOTSTRAP = r"""
import json, os, resource, sys
_p = json.loads(sys.argv[1])
for _r, _soft, _hard in ((resource.RLIMIT_AS, _p["as"], _p["as"]), (resource.RLIMIT_CPU, _p["cpu"], _p["cpu"] + 1),
                         (resource.RLIMIT_FSIZE, _p["fsize"], _p["fsize"]), (resource.RLIMIT_CORE, 0, 0),
                         (resource.RLIMIT_NOFILE, 256, 256)):
    _old = resource.getrlimit(_r)[1]  # a limit can only be lowered: the worker's may be lower already
    if _old != resource.RLIM_INFINITY:
        _soft, _hard = min(_soft, _old), min(_hard, _old)
    resource.setrlimit(_r, (_soft, _hard))
import ctypes
ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: die with the tool worker
if os.getppid() != _p["ppid"]:
    os._exit(137)
del ctypes
for _m in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
    del sys.modules[_m]
import socket, traceback, _posixsubprocess
def _no_process(*a, **k):
    raise PermissionError("starting other programs is not allowed in this interpreter")
_posixsubprocess.fork_exec = _no_process
_SCRATCH = os.path.realpath(_p["dir"])
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_PROCESS = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
            "subprocess.Popen", "os.kill", "os.killpg", "os.startfile"}
_NATIVE = {"ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "resource.setrlimit", "resource.prlimit"}
_PATHS = {"os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.mkdir": (0,), "os.chmod": (0,),
          "os.chown": (0,), "os.link": (1,), "os.symlink": (1,), "os.truncate": (0,), "os.utime": (0,),
          "os.setxattr": (0,), "os.removexattr": (0,), "os.chflags": (0,), "os.lchflags": (0,)}
def _inside(path):
    if isinstance(path, int):
        return True
    real = os.path.realpath(os.fsdecode(path))
    return real == os.devnull or real == _SCRATCH or real.startswith(_SCRATCH + os.sep)
def _hook(event, args):
    if event.startswith("socket."):
        if event == "socket.__new__" and args[1] == socket.AF_UNIX:
            return  # socketpair (asyncio's event loop): no network
        raise PermissionError("network access is disabled in this interpreter (%s)" % event)
    if event in _PROCESS:
        raise PermissionError("starting or signalling other processes is not allowed (%s)" % event)
    if event == "ctypes.dlopen" and args[0] is None:
        return  # `import ctypes` opens the interpreter itself (sympy imports it); symbols stay refused
    if event in _NATIVE:
        raise PermissionError("%s is not allowed in this interpreter" % event)
    if event == "import" and args[0] == "_posixsubprocess":
        raise ImportError("%s is not available in this interpreter" % args[0])
    if event == "open" and args[2] & _WRITE and args[0] is not None and not _inside(args[0]):
        raise PermissionError("writing outside the working directory is not allowed: %r" % (args[0],))
    if event in _PATHS:
        for _i in _PATHS[event]:
            if _i < len(args) and args[_i] is not None and not _inside(args[_i]):
                raise PermissionError("changing files outside the working directory is not allowed: %r" % (args[_i],))
sys.addaudithook(_hook)
sys.argv = ["main.py"]
import ast as _ast
try:
    with open("main.py", encoding="utf-8") as _f:
        _tree = _ast.parse(_f.read(), "main.py")
    # as a notebook cell (and ReTool's interpreter): a last bare expression shows its value
    _last = _tree.body.pop() if _tree.body and isinstance(_tree.body[-1], _ast.Expr) else None
    _code = compile(_tree, "main.py", "exec")
    _show = None if _last is None else compile(_ast.Expression(_last.value), "main.py", "eval")
    del _f, _p, _r, _soft, _hard, _old, _tree, _last
    _globals = {"__name__": "__main__", "__builtins__": __builtins__}
    exec(_code, _globals)
    if _show is not None:
        _value = eval(_show, _globals)
        if _value is not None:
            print(repr(_value))
except SystemExit:
    raise
except BaseException as _e:
    # the model sees its own frames only, not this bootstrap's (its file is "<string>")
    _frames = [f for f in traceback.extract_tb(_e.__traceback__) if f.filename != "<string>"]
    sys.stdout.flush()
    sys.stderr.write("Traceback (most recent call last):\n" if _frames else "")
    sys.stderr.write("".join(traceback.format_list(_frames)))
    sys.stderr.write("".join(traceback.format_exception_only(type(_e), _e)))
    sys.exit(1)
"""

_READ_CHUNK = 1 << 16


def run_python(code: str, limits: PythonLimits, netns_prefix: list[str] | None = None) -> PythonRun:
    """Run ``code`` in a fresh, limited interpreter (see the module doc); never raises for
    anything the code does. ``netns_prefix`` is :func:`network_isolation`'s answer (probe it once)."""
    prefix = list(netns_prefix or []) if limits.netns else []
    isolation = "netns+audit-hook" if prefix else "audit-hook"
    scratch = tempfile.mkdtemp(prefix="mdapo-python-")
    try:
        with open(os.path.join(scratch, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        params = {
            "as": int(limits.memory_mb) << 20,
            "cpu": int(math.ceil(limits.timeout_s)) + 1,
            "fsize": int(limits.max_file_mb) << 20,
            "dir": scratch,
            "ppid": os.getpid(),
        }
        cmd = [*prefix, sys.executable, "-I", "-B", "-X", "utf8", "-c", _BOOTSTRAP, json.dumps(params)]
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": scratch,
            "TMPDIR": scratch,
            "LANG": "C.UTF-8",
            # BLAS thread pools reserve memory per thread: one thread keeps numpy under RLIMIT_AS
            "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        try:
            proc = subprocess.Popen(
                cmd,
                cwd=scratch,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group, killed whole
            )
        except OSError as e:
            return PythonRun(f"Error: the interpreter could not start: {e}", -1, False, False, isolation)
        head, tail, total, timed_out = _collect(proc, limits)
        code_ = proc.returncode
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    output, truncated = _join(head, tail, total, limits.max_output_chars)
    notes = []
    if timed_out:
        notes.append(f"Error: the code ran longer than {limits.timeout_s:g} s and was stopped")
    elif code_ < 0:
        sig = _signal_name(-code_)
        why = {
            "SIGXCPU": " (CPU time limit)",
            "SIGXFSZ": f" (file size limit, {limits.max_file_mb} MB)",
            "SIGKILL": " (out of memory or CPU time)",
        }
        notes.append(f"Error: the interpreter was killed by {sig}{why.get(sig, '')}")
    if notes:
        output = output + ("\n" if output and not output.endswith("\n") else "") + "\n".join(notes)
    return PythonRun(output, code_, timed_out, truncated, isolation)


def _collect(proc: subprocess.Popen, limits: PythonLimits) -> tuple[bytes, bytes, int, bool]:
    """Read the merged output until EOF or the deadline, keeping its start and its end only (a
    loop printing forever must not grow the worker past its own memory limit)."""
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
    # before the wait: the group id cannot be reused while its leader is unreaped
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


def _join(head: bytes, tail: bytes, total: int, max_chars: int) -> tuple[str, bool]:
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


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


class PythonTool:
    """The ``python`` builtin with its limits; probes network isolation once, at first use."""

    def __init__(self, limits: PythonLimits):
        self.limits = limits
        self._prefix: list[str] | None = None

    def __call__(self, code: str) -> tuple[str, dict]:
        """Run ``code`` (a markdown fence around it, as models often write, is removed first)."""
        if not isinstance(code, str):
            return f"Error: code must be a string, got {type(code).__name__}", {"exit_code": -1}
        code = _unfence(code)
        if self._prefix is None:
            self._prefix = network_isolation() if self.limits.netns else []
        run = run_python(code, self.limits, self._prefix)
        return run.output, {
            "exit_code": run.exit_code,
            "timed_out": run.timed_out,
            "output_truncated": run.truncated,
            "isolation": run.isolation,
        }


def _unfence(code: str) -> str:
    lines = code.strip().splitlines()
    if len(lines) >= 2 and lines[0].startswith("```") and lines[-1].strip() == "```":
        return "\n".join(lines[1:-1]) + "\n"
    return code


def make_builtin(name: str, config: dict):
    """The callable of builtin ``name`` with its ``config`` options: ``fn(**arguments) -> (text,
    status, metrics)``. The status is ``error`` for an answer that reports a failure (a calculator
    error, code that raised or was killed) and ``timeout`` for code stopped by its time limit, so
    that the host counts them; the model sees the text either way."""
    if name == "calculator":
        max_digits = int(config.get("max_digits", DEFAULT_MAX_DIGITS))

        def calc(expression: str) -> tuple[str, str, dict]:
            text = calculator(expression, max_digits=max_digits)
            return text, "error" if text.startswith("Error:") else "ok", {}

        return calc
    if name == "python":
        tool = PythonTool(PythonLimits(**{k: BUILTIN_OPTIONS["python"][k](v) for k, v in config.items()}))

        def python(code: str) -> tuple[str, str, dict]:
            text, metrics = tool(code)
            if metrics.get("timed_out"):
                return text, "timeout", metrics
            return text, "ok" if metrics.get("exit_code") == 0 else "error", metrics

        return python
    raise ValueError(f"unknown builtin tool {name!r}; builtins: {', '.join(BUILTIN_SCHEMAS)}")
