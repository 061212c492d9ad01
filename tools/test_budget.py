"""The test suite's time by area, from pytest's ``--durations=0`` report.

    python -m pytest -q -p no:cacheprovider --durations=0 > durations.txt 2>&1
    python tools/test_budget.py durations.txt [--files 15] [--tests tests] [--json out.json] [--workers 2]

(``make test PYTEST_ARGS=--durations=0`` gives the same report from the two-worker run.) The same
lines, written as each test finishes (a run stopped midway still leaves its part):

    python -m pytest -q -p tools.test_budget --budget-log durations.txt

Every
setup, call and teardown line of the report is charged to the test it names; a module or session
fixture's cost lands on the first test that asks for it, which is where it is paid.

Each test gets one area, the first of ``AREAS`` whose marks appear in the code the test runs in
its own file: the test function, the fixtures it names (its file's and conftest.py's), and the
module-level functions, classes and constants (a script run in a subprocess) these use, followed
by name through the file; comments and
docstrings do not count. Marks are what
starts the costly thing: ``require_sglang()`` and the tests' launchers for a real SGLang server
(``start_cpu_server``, ``real_sglang_server``, ``RewardServers.launch``, conftest's server
fixtures), the trainer's entry points for an end-to-end
run (``run_train``, the e2e harness's ``train_*``, the demo command, ``megatron_dapo.train``
under torchrun, ``tools/gpu_check.sh``'s dry run), ``ray.init``/``init_ray``/a Ray cluster for
the Ray driver's tests, ``run_ranks`` for
Megatron rank processes. Anything else is a unit test, in-process. A test that starts several of these
counts in the costliest (the order of ``AREAS``): a run through the real server is "real SGLang".

Printed: seconds and tests per area, their share of the total, and the most expensive files
with the area of each. The total is the sum of the tests' own times; under pytest-xdist it is
about the number of workers times the wall time.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

# (area, marks), costliest first: a test is in the first area one of whose marks its code holds.
AREAS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "real SGLang",
        (
            r"\brequire_sglang\(",
            r"\bstart_cpu_server\(",
            r"\breal_sglang_server\(",
            r"\bRewardServers\.launch\((?!.*\bcommands\b)",  # with `commands`: stand-in servers
            r"\bsglang_cpu_server\b",
            r"\bsglang_server_factory\b",
        ),
    ),
    (
        "end to end",
        (
            r"\brun_train\(",
            r"\btrain_to_end\(",
            r"\bstart_and_wait_for_step\(",
            r"\btrain_cmd\(",
            r"[\[(]\s*'demo'",  # the demo command through cli.main
            r"'megatron_dapo\.train'",  # the trainer under torchrun
            r"tools/gpu_check\.sh",  # its CPU dry run holds a torchrun DAPO run, resume and export
        ),
    ),
    ("Ray driver", (r"\bray\.init\(", r"\binit_ray\(", r"\bCluster\(", r"\bRayRankGroup\b")),
    ("Megatron ranks", (r"\brun_ranks\(",)),
)
UNIT = "unit"
AREA_NAMES = tuple(name for name, _ in AREAS) + (UNIT,)

# "12.34s call     tests/test_x.py::test_y[a b-c]" (pytest's --durations lines; ids may hold spaces)
DURATION = re.compile(r"^\s*(?P<s>\d+(?:\.\d+)?)s\s+(?P<when>setup|call|teardown)\s+(?P<id>\S+::.*?)\s*$")
SUMMARY = re.compile(r"\b(?P<n>\d+) passed\b.* in (?P<s>\d+(?:\.\d+)?)s")


def pytest_addoption(parser):
    """As a pytest plugin (``-p tools.test_budget``): ``--budget-log PATH``."""
    parser.addoption(
        "--budget-log", help="append each test phase's seconds to PATH as it ends (--durations' format)"
    )


def pytest_runtest_logreport(report):
    path = _LOG.get("path")
    if path:
        with open(path, "a") as f:
            f.write(f"{report.duration:.2f}s {report.when:<8} {report.nodeid}\n")


def pytest_configure(config):
    _LOG["path"] = config.getoption("--budget-log", None)


_LOG: dict[str, str | None] = {}  # the plugin's log path, set when pytest configures it


def parse_durations(text: str) -> dict[str, float]:
    """Seconds per test id (setup + call + teardown), from a --durations report."""
    per_test: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        m = DURATION.match(line)
        if m:
            per_test[m["id"]] += float(m["s"])
    return dict(per_test)


def wall_seconds(text: str) -> float | None:
    """The run's wall time from pytest's last summary line ("N passed ... in T s")."""
    found = [float(m["s"]) for m in map(SUMMARY.search, text.splitlines()) if m]
    return found[-1] if found else None


class _Module:
    """A test file's top-level functions, classes and assigned names, and the names each uses."""

    def __init__(self, path: Path):
        self.source = path.read_text() if path.is_file() else ""
        self.defs: dict[str, ast.AST] = {}
        try:
            tree = ast.parse(self.source)
        except SyntaxError:
            tree = ast.Module(body=[], type_ignores=[])
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defs[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):  # e.g. a script run in a subprocess
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        self.defs[target.id] = node

    def text(self, name: str) -> str:
        """A definition's code without comments and docstrings (ast.unparse: strings in single
        quotes), so a mark named in prose does not count."""
        node = self.defs.get(name)
        if node is None:
            return ""
        node = copy.deepcopy(node)
        for inner in ast.walk(node):
            body = getattr(inner, "body", None)
            if (
                isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                inner.body = body[1:] or [ast.Pass()]
        # and the strings as they are (unparse escapes a script's newlines: "\\ninit_ray(")
        strings = [
            c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)
        ]
        return "\n".join([ast.unparse(node), *strings])

    def used_names(self, name: str) -> set[str]:
        """Names a definition refers to, its arguments (fixtures) included."""
        node = self.defs.get(name)
        if node is None:
            return set()
        used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        used |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            used |= {a.arg for a in node.args.args + node.args.kwonlyargs}
        return used


@dataclass
class Classifier:
    """Areas of tests by their code (module docstring); files are read once each."""

    root: Path
    _modules: dict[Path, _Module] = field(default_factory=dict)

    def _module(self, path: Path) -> _Module:
        if path not in self._modules:
            self._modules[path] = _Module(path)
        return self._modules[path]

    def code_of(self, test_id: str) -> str:
        """The source a test runs in its file and conftest.py, followed by name from the test."""
        file, _, rest = test_id.partition("::")
        name = rest.split("::")[-1].split("[")[0]
        path = self.root / file
        modules = [self._module(path), self._module(path.parent / "conftest.py")]
        if "::" in rest:  # a test method: its class holds it
            name = rest.split("::")[0]
        seen: set[tuple[int, str]] = set()
        todo = [(0, name)]
        parts = []
        while todo:
            key = todo.pop()
            if key in seen:
                continue
            seen.add(key)
            index, current = key
            module = modules[index]
            parts.append(module.text(current))
            for used in module.used_names(current):
                for j, other in enumerate(modules):
                    if used in other.defs:
                        todo.append((j, used))
        return "\n".join(parts)

    def area(self, test_id: str) -> str:
        code = self.code_of(test_id)
        for name, marks in AREAS:
            if any(re.search(mark, code) for mark in marks):
                return name
        return UNIT


@dataclass
class Budget:
    """Seconds and test counts by area and by file."""

    seconds: dict[str, float]
    tests: dict[str, int]
    files: dict[str, tuple[float, dict[str, float]]]  # file -> (seconds, seconds by area)

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


def budget(per_test: dict[str, float], classifier: Classifier) -> Budget:
    seconds = dict.fromkeys(AREA_NAMES, 0.0)
    tests = dict.fromkeys(AREA_NAMES, 0)
    files: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for test_id, s in per_test.items():
        area = classifier.area(test_id)
        seconds[area] += s
        tests[area] += 1
        files[test_id.partition("::")[0]][area] += s
    by_file = {f: (sum(a.values()), dict(a)) for f, a in files.items()}
    return Budget(seconds, tests, by_file)


# pytest-xdist's --dist loadfile (make test): a worker runs whole files and is sent the next file in
# the suite's order once at most this many of its tests are left (xdist's LoadScopeScheduling)
XDIST_REFILL_AT = 2


def suite_order(root: Path, files) -> list[str]:
    """``files`` in make test's order: tests/conftest.py's ``FILE_ORDER``, then by name."""
    first: list[str] = []
    for node in ast.parse((root / "tests" / "conftest.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "FILE_ORDER" for t in node.targets):
            first = list(ast.literal_eval(node.value))
    rank = {name: i for i, name in enumerate(first)}
    return sorted(files, key=lambda f: (rank.get(Path(f).name, len(rank)), f))


def replay(per_test: dict[str, float], order: list[str], workers: int) -> list[tuple[float, list[str]]]:
    """Each worker's end and files when xdist's loadfile scheduling is replayed on the tests' times:
    an estimate (a file's tests in the report's order; the ones it hides, under 5 ms, left out)."""
    by_file: dict[str, list[float]] = defaultdict(list)
    for test_id, s in per_test.items():
        by_file[test_id.partition("::")[0]].append(s)
    queue = [f for f in order if f in by_file]
    clock, pending = [0.0] * workers, [[] for _ in range(workers)]
    files: list[list[str]] = [[] for _ in range(workers)]

    def refill(w: int) -> None:
        if queue:
            files[w].append(queue[0])
            pending[w].extend(by_file[queue.pop(0)])

    for w in range(workers):
        refill(w)
    for w in range(workers):
        if len(pending[w]) <= XDIST_REFILL_AT:
            refill(w)
    while any(pending):
        w = min((i for i in range(workers) if pending[i]), key=lambda i: clock[i] + pending[i][0])
        clock[w] += pending[w].pop(0)
        if len(pending[w]) <= XDIST_REFILL_AT:
            refill(w)
    return list(zip(clock, files))


def render_replay(ends: list[tuple[float, list[str]]]) -> str:
    last = max(end for end, _ in ends)
    lines = [f"make test's {len(ends)} workers replayed (loadfile, the suite's file order):"]
    for i, (end, files) in enumerate(ends):
        tail = f"; then idle {last - end:.0f} s" if last - end >= 1 else ""
        lines.append(f"  gw{i}: {len(files)} files, ends at {end:.0f} s{tail} (last: {Path(files[-1]).name})")
    return "\n".join(lines)


def render(b: Budget, wall: float | None, top_files: int) -> str:
    lines = [f"{'area':<16}{'seconds':>9}{'share':>8}{'tests':>7}"]
    for name in AREA_NAMES:
        share = 100 * b.seconds[name] / b.total if b.total else 0.0
        lines.append(f"{name:<16}{b.seconds[name]:>9.0f}{share:>7.1f}%{b.tests[name]:>7}")
    lines.append(f"{'total':<16}{b.total:>9.0f}{100.0 if b.total else 0.0:>7.1f}%{sum(b.tests.values()):>7}")
    if wall is not None:
        lines.append(
            f"pytest's wall time: {wall:.0f} s (in one process, what the tests' own time leaves is"
            " start-up and collection; with N workers the tests' time is about N times the wall time)"
        )
    if top_files:
        lines.append("")
        lines.append(f"the {top_files} costliest files:")
        ranked = sorted(b.files.items(), key=lambda kv: -kv[1][0])[:top_files]
        for file, (s, areas) in ranked:
            split = ", ".join(f"{a} {v:.0f}" for a, v in sorted(areas.items(), key=lambda kv: -kv[1]))
            lines.append(f"{s:>7.0f} s  {file}  ({split})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", help="a file holding pytest's --durations=0 output ('-': stdin)")
    p.add_argument("--root", default=".", help="the directory the test ids are relative to (the repository)")
    p.add_argument("--files", type=int, default=15, help="list this many of the costliest files (0: none)")
    p.add_argument("--tests", action="store_true", help="also print every test with its area and seconds")
    p.add_argument("--json", help="write the areas, files and tests as JSON to this path")
    p.add_argument(
        "--workers", type=int, default=0, help="replay make test's scheduling on N workers: when each ends"
    )
    args = p.parse_args(argv)
    text = sys.stdin.read() if args.report == "-" else Path(args.report).read_text()
    per_test = parse_durations(text)
    if not per_test:
        print(f"{args.report}: no --durations lines (run pytest with --durations=0)", file=sys.stderr)
        return 2
    classifier = Classifier(Path(args.root))
    b = budget(per_test, classifier)
    print(render(b, wall_seconds(text), args.files))
    if args.workers:
        files = {test_id.partition("::")[0] for test_id in per_test}
        print()
        print(render_replay(replay(per_test, suite_order(Path(args.root), files), args.workers)))
    if args.tests:
        print()
        for test_id, s in sorted(per_test.items(), key=lambda kv: -kv[1]):
            print(f"{s:>8.2f} s  {classifier.area(test_id):<15} {test_id}")
    if args.json:
        out = {
            "areas": {a: {"seconds": b.seconds[a], "tests": b.tests[a]} for a in AREA_NAMES},
            "files": {f: {"seconds": s, "areas": areas} for f, (s, areas) in b.files.items()},
            "tests": {t: {"seconds": s, "area": classifier.area(t)} for t, s in per_test.items()},
            "wall_s": wall_seconds(text),
        }
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
