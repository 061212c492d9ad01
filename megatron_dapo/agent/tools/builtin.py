"""Built-in tools, chosen in the tool YAML with ``builtin: calculator`` or ``builtin: python``.

- ``calculator``: exact arithmetic on integers and decimals (:func:`calculator`).
- ``python``: the code interpreter of ReTool / SimpleTIR (:class:`PythonTool`): each call runs the
  code in a fresh interpreter behind the kernel boundary of :mod:`.sandbox` (its own namespaces, a
  read-only view, a scratch tmpfs, no network, limits), which fails closed.

This module runs inside the tool worker, which must stay light: the standard library only.
"""

from __future__ import annotations

import ast
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from megatron_dapo.agent.tools.sandbox import (
    PACKAGES,
    Sandbox,
    SandboxLimits,
    SandboxUnavailable,
    collect_output,
    join_output,
    probe,
)

__all__ = [
    "BUILTIN_OPTIONS",
    "BUILTIN_SCHEMAS",
    "PythonLimits",
    "PythonRun",
    "PythonTool",
    "calculator",
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
            "Runs Python 3 code and returns what it prints (stdout and stderr); a last bare expression "
            "shows its value. Each call starts a fresh, isolated interpreter with numpy, sympy and "
            "mpmath: no variables, imports or files are kept between calls, there is no network, and "
            "only its working directory is writable."
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
        "scratch_mb": int,
        "max_processes": int,
        "packages": list,
        "sandbox": str,
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

# What the python tool offers beyond the standard library, when its config names nothing else.
DEFAULT_PACKAGES = ("numpy", "sympy", "mpmath")
SANDBOX_CHOICES = ("bwrap", "none")


@dataclass(frozen=True)
class PythonLimits:
    """Limits of one run of the python tool (the tool YAML's ``config:``).

    ``timeout_s``: wall clock; past it every process of the run is killed and the tool says so
    itself (it is kept below the tool host's timeout, which would kill the whole tool worker). CPU
    time (RLIMIT_CPU) is the wall-clock limit rounded up plus 1 s. ``memory_mb``: address space per
    process. ``max_file_mb``: largest file. ``scratch_mb``: the whole writable scratch.
    ``max_processes``: processes and threads at once. ``max_output_chars``: what is returned, the
    start and the end of longer output (a traceback sits at the end). ``packages``: importable
    beyond the standard library. ``sandbox``: ``bwrap`` (the kernel boundary of :mod:`.sandbox`),
    or ``none``, for trusted code only: a plain limited interpreter that can read, write and signal
    whatever the trainer can (it warns at every start and is written into the run's metrics).
    """

    timeout_s: float = 10.0
    memory_mb: int = 1024
    max_output_chars: int = 16384
    max_file_mb: int = 64
    scratch_mb: int = 128
    max_processes: int = 32
    packages: tuple[str, ...] = DEFAULT_PACKAGES
    sandbox: str = "bwrap"

    def __post_init__(self) -> None:
        object.__setattr__(self, "packages", tuple(self.packages))
        if self.sandbox not in SANDBOX_CHOICES:
            raise ValueError(f"sandbox: {self.sandbox!r} is not one of {', '.join(SANDBOX_CHOICES)}")

    def sandbox_limits(self) -> SandboxLimits:
        return SandboxLimits(
            timeout_s=self.timeout_s,
            cpu_s=int(math.ceil(self.timeout_s)) + 1,
            memory_mb=self.memory_mb,
            max_file_mb=self.max_file_mb,
            scratch_mb=self.scratch_mb,
            max_processes=self.max_processes,
            max_output_chars=self.max_output_chars,
        )


@dataclass
class PythonRun:
    """What one run of the python tool gave: ``output`` (the text shown to the model), the exit
    code (negative: killed by that signal), whether the wall-clock limit stopped it, whether the
    output was cut, and the boundary it ran behind."""

    output: str
    exit_code: int
    timed_out: bool
    truncated: bool
    isolation: str


# Runs first in the sandboxed interpreter, before the model's code (main.py in the scratch
# directory): the kernel limits, which the code cannot raise again, then the code as a notebook
# cell. No Python-level guard: the boundary is the kernel's (sandbox.py).
_BOOTSTRAP = r"""
import json, resource, sys
for _name, (_soft, _hard) in json.loads(sys.argv[1]).items():
    _r = getattr(resource, _name)
    _old = resource.getrlimit(_r)[1]  # a limit can only be lowered
    if _old != resource.RLIM_INFINITY:
        _soft, _hard = min(_soft, _old), min(_hard, _old)
    resource.setrlimit(_r, (_soft, _hard))
sys.path.insert(0, sys.argv[2])
sys.argv = ["main.py"]
import builtins
if not hasattr(builtins, "exit"):  # without site (-S): exit() and quit() as models write them
    builtins.exit = builtins.quit = sys.exit
import ast as _ast, traceback
try:
    with open("main.py", encoding="utf-8") as _f:
        _tree = _ast.parse(_f.read(), "main.py")
    # as a notebook cell (and ReTool's interpreter): a last bare expression shows its value
    _last = _tree.body.pop() if _tree.body and isinstance(_tree.body[-1], _ast.Expr) else None
    _code = compile(_tree, "main.py", "exec")
    _show = None if _last is None else compile(_ast.Expression(_last.value), "main.py", "eval")
    del _f, _name, _soft, _hard, _old, _r, _tree, _last
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

ISOLATION_BWRAP = "bwrap"
ISOLATION_NONE = "none (sandbox: none)"


def run_python(code: str, limits: PythonLimits, sandbox: Sandbox | None = None) -> PythonRun:
    """Run ``code`` behind the boundary (see the module doc); never raises for anything the code
    does. Raises :class:`~.sandbox.SandboxUnavailable` when the boundary cannot be made: the code is
    then not run at all. ``sandbox``: a prepared :class:`~.sandbox.Sandbox` (``limits`` build one)."""
    if limits.sandbox == "none":
        return _run_unsandboxed(code, limits)
    sandbox = sandbox or Sandbox(limits.sandbox_limits(), packages=limits.packages)
    # -S: no site processing of the prefix's own site-packages (the offered packages are on the path
    # by name; site's scan costs more than the rest of the start-up)
    argv = ["python", "-I", "-S", "-B", "-X", "utf8", "-c", _BOOTSTRAP, sandbox.limits_json(), PACKAGES]
    done = sandbox.run(argv, {"main.py": code.encode("utf-8", errors="surrogatepass")})
    return _finish(done.output, done.exit_code, done.timed_out, done.truncated, limits, ISOLATION_BWRAP)


def _run_unsandboxed(code: str, limits: PythonLimits) -> PythonRun:
    """``sandbox: none``: the same interpreter and limits with no namespaces, for trusted code."""
    scratch = tempfile.mkdtemp(prefix="mdapo-python-")
    try:
        with open(os.path.join(scratch, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        lim = limits.sandbox_limits()
        rlimits = {
            "RLIMIT_AS": [lim.memory_mb << 20] * 2,
            "RLIMIT_CPU": [lim.cpu_s, lim.cpu_s + 1],
            "RLIMIT_FSIZE": [lim.max_file_mb << 20] * 2,
            "RLIMIT_CORE": [0, 0],
        }
        argv = [sys.executable, "-I", "-B", "-X", "utf8", "-c", _BOOTSTRAP, json.dumps(rlimits), scratch]
        env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8"}
        try:
            proc = subprocess.Popen(
                argv,
                cwd=scratch,
                env={**env, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as e:
            return PythonRun(f"Error: the interpreter could not start: {e}", -1, False, False, ISOLATION_NONE)
        head, tail, total, timed_out = collect_output(proc, lim)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    output, truncated = join_output(head, tail, total, limits.max_output_chars)
    return _finish(output, proc.returncode, timed_out, truncated, limits, ISOLATION_NONE)


def _finish(
    output: str, code_: int, timed_out: bool, truncated: bool, limits: PythonLimits, isolation: str
) -> PythonRun:
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


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


class PythonTool:
    """The ``python`` builtin with its limits. Its boundary is probed when it is made: where the
    sandbox cannot be made it raises :class:`~.sandbox.SandboxUnavailable` (fail closed)."""

    def __init__(self, limits: PythonLimits):
        self.limits = limits
        self.sandbox: Sandbox | None = None
        if limits.sandbox != "none":
            self.sandbox = Sandbox(limits.sandbox_limits(), packages=limits.packages)
            found = probe(self.sandbox)
            if not found.ok:
                raise SandboxUnavailable(found.detail)

    def __call__(self, code: str) -> tuple[str, dict]:
        """Run ``code`` (a markdown fence around it, as models often write, is removed first)."""
        if not isinstance(code, str):
            return f"Error: code must be a string, got {type(code).__name__}", {"exit_code": -1}
        code = _unfence(code)
        run = run_python(code, self.limits, self.sandbox)
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
