"""The import contract of megatron_dapo, checked from the source (ast; nothing is imported).

Three rules, all run by `make lint`:
1. Layers. Each top-level part of the package (a subpackage or a module such as `arch.py`) may
   import only the parts `ALLOWED` lists for it, at the top of a file or inside a function
   alike: a lazy import is still a dependency. Some parts also keep away from outside packages
   (`FORBIDDEN`: algo/ from torch.distributed and megatron, plan/ from torch, arch from megatron).
   This is the picture docs/architecture.md draws.
2. No cycles among the package's modules through module-level imports (those run at import
   time; `if TYPE_CHECKING:` blocks do not).
3. Imports of our own modules sit at the top of the file. A function-local (lazy) import of one
   of them is allowed only when that module is heavy: it imports ray, sglang, megatron or
   transformer_engine (`HEAVY`) at module level, itself or through our modules it imports at
   module level. Deferring those keeps the command line, the planner and the CPU tests free of
   Ray and Megatron; deferring anything else only hides a dependency. `LAZY_EXCEPTIONS` holds
   what may stay, single imports by name with the reason; an entry that no longer applies fails.

Usage: python tools/check_imports.py [--root DIR] [--count-local] [--heavy]
Exit status 1 with one line per violation; --count-local also prints how many function-local
imports of the package's own modules remain, per file (imports under `if TYPE_CHECKING:` are not
function-local: they never run).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "megatron_dapo"

# What each part may import. errors.py (how a failure reaches the user), ports.py (free TCP
# ports), http_errors.py (an HTTP error answer as one line) and pyfile.py (a user's Python file
# by path) are leaves anyone may use.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "ports": set(),
    "http_errors": set(),
    "pyfile": set(),
    # a checkpoint's tokenizer as it was saved (the trainer's data, eval and the reward models'
    # clients alike)
    "hf_tokenizer": set(),
    # known library notices to a log file (stdlib only)
    "notices": set(),
    "algo": set(),
    # http_errors: the reward-model clients' 4xx lines carry the server's own reason
    "rewards": {"errors", "hf_tokenizer", "http_errors", "pyfile"},
    "data": {"errors"},
    "eval": {"rewards", "data", "errors", "hf_tokenizer", "http_errors"},
    # the schema and its checks; algo for the rollout-correction settings, actor.gpu_settings'
    # pure rules (below: a module-level exception)
    "config": {"algo", "errors"},
    "plan": {"config"},
    "arch": set(),
    "weights": {"arch", "errors"},
    "actor": {"algo", "arch", "config", "weights", "data", "errors", "notices", "ports"},
    "rollout": {"algo", "arch", "config", "data", "rewards", "errors", "http_errors", "ports"},
    # multi-turn episodes: the runner the rollout manager is handed, the chat-template bridge,
    # tool-call parsers, tools in processes of their own
    "agent": {"config", "data", "errors", "pyfile", "rollout"},
    # SGLang servers (launch, placement, health) and their HTTP client, an engine of rollout's protocol
    # (rewards: the served reward model's servers, sglang/reward_servers.py)
    "sglang": {"config", "errors", "http_errors", "ports", "rewards", "rollout"},
    # the weight transports: HF-named buckets to HF engines, SGLang servers or a checkpoint on disk
    "sync": {"config", "errors", "ports", "rollout", "sglang", "weights"},
    # offline conversion: builds the model on ranks it launches
    "convert": {"actor", "arch", "weights", "errors"},
    "driver": {
        *(
            "actor",
            "agent",
            "algo",
            "arch",
            "config",
            "data",
            "errors",
            "eval",
            "hf_tokenizer",
            "notices",
            "ports",
            "rewards",
            "rollout",
            "sglang",
            "sync",
            "weights",
        ),
    },
    # the CPU demo's assets and the torchrun entry point sit beside the commands, on the driver
    "demo": {
        *("actor", "agent", "algo", "arch", "config", "data", "driver", "errors", "rewards", "rollout"),
        "weights",
    },
    "train": {
        *(
            "actor",
            "agent",
            "algo",
            "config",
            "data",
            "driver",
            "errors",
            "eval",
            "rewards",
            "rollout",
            "sglang",
            "sync",
        ),
        "weights",
    },
}
# Everything above the driver: the command line and its subcommands may import anything.
_TOP = {"cli", "commands", "__main__", "__init__"}
# Single modules allowed across a layer line, each with the reason.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("megatron_dapo.config.validate", "megatron_dapo.actor.gpu_settings"): (
        "the overlap refusal of actor/gpu_settings (pure functions, no megatron), checked before any rank starts"
    ),
}
# Outside packages whose import a lazy import of ours may defer (rule 3).
HEAVY = ("ray", "sglang", "megatron", "transformer_engine")
# Function-local imports of light modules allowed by name (importing module, imported module),
# each with the reason. No import cycle is broken this way: cycles are broken by moving code.
LAZY_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("megatron_dapo.driver.actor_worker", "megatron_dapo.actor.mcore_import"): (
        "importing it is importing megatron.core (from a function it runs at import, which this "
        "check does not follow), first in the rank and without wandb"
    ),
    ("megatron_dapo.config.validate", "megatron_dapo.algo.rollout_correction"): (
        "loading a config (`megatron-dapo config`, `plan`, load_config) imports no torch, and algo/ "
        "does through its __init__ (load_config 1.9 s with it, 0.30 s without); RolloutCorrection "
        "is the one place the rollout_correction settings are checked"
    ),
}
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "algo": ("torch.distributed", "megatron"),
    "plan": ("torch",),
    "arch": ("megatron", "torch"),
    "config": ("torch", "megatron"),
    "rewards": ("megatron",),
    "data": ("megatron",),
    "eval": ("megatron",),
}


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported name, resolved to a module where it is one of ours
    line: int
    top: bool  # at module level (runs at import time)
    local: bool = False  # inside a function (runs when it is called); False under TYPE_CHECKING


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


TOP, LOCAL, TYPING = "top", "local", "typing"


def _walk(body: list[ast.stmt], where: str):
    """(import node, where it runs: TOP, LOCAL or TYPING) for every import statement under ``body``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, where
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _walk(node.body, LOCAL if where == TOP else where)
        elif isinstance(node, ast.ClassDef):
            yield from _walk(node.body, where)
        elif isinstance(node, ast.If) and _type_checking(node):
            yield from _walk(node.body, TYPING)
            yield from _walk(node.orelse, where)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list):
                    # an except handler's body comes through its "body" field here
                    yield from _walk([n for n in inner if isinstance(n, ast.AST)], where)


def imports_of(path: Path, root: Path, modules: set[str]) -> list[Import]:
    source = module_name(path, root)
    is_package = path.name == "__init__.py"
    out = []
    for node, where in _walk(ast.parse(path.read_text(), str(path)).body, TOP):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = source.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import mod` imports the module pkg.mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        out.extend(
            Import(source, t, node.lineno, where == TOP, where == LOCAL) for t in dict.fromkeys(targets)
        )
    return out


def part_of(module: str) -> str:
    """The layer of one of our modules: its first component below the package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _ours(target: str, modules: set[str]) -> str | None:
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0

    def visit(start: str) -> None:
        nonlocal counter
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                if len(comp) > 1 or node in edges.get(node, ()):
                    found.append(sorted(comp))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def _parents(module: str, modules: set[str]) -> list[str]:
    """The packages whose ``__init__`` runs before ``module``: a.b.c -> a, a.b (those that are ours)."""
    parts = module.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in modules]


def heavy_modules(imports: list[Import], modules: set[str], heavy: tuple[str, ...] = HEAVY) -> dict[str, str]:
    """Our modules whose import loads one of ``heavy``, each with the chain that does it
    ("a.b -> a.c -> megatron"): a module-level import of a heavy package, of a heavy module of
    ours, or a heavy package ``__init__`` above the module."""
    why: dict[str, str] = {}
    needs: dict[str, set[str]] = defaultdict(set)
    for imp in imports:
        if not imp.top:
            continue
        root = imp.target.split(".")[0]
        if root in heavy:
            why.setdefault(imp.source, f"{imp.source} -> {root}")
        ours = _ours(imp.target, modules)
        if ours is not None and ours != imp.source:
            needs[imp.source].update([ours, *_parents(ours, modules)])
    for module in modules:
        needs[module].update(_parents(module, modules))
    changed = True
    while changed:  # a fixpoint: the graph is small
        changed = False
        for module in sorted(modules):
            if module in why:
                continue
            for dep in sorted(needs[module]):
                if dep in why:
                    why[module] = f"{module} -> {why[dep]}"
                    changed = True
                    break
    return why


def check(root: Path, package: str = PACKAGE) -> tuple[list[str], dict[str, int], list[str]]:
    """(violations, function-local imports of our modules per file, notes) of the package under
    ``root``. A note names modules that import each other only through function-local imports:
    not a failure (nothing runs at import time), but a layering to straighten."""
    files = sorted((root / package).rglob("*.py"))
    modules = {module_name(p, root) for p in files}
    problems: list[str] = []
    local: dict[str, int] = defaultdict(int)
    edges: dict[str, set[str]] = defaultdict(set)
    lazy_edges: dict[str, set[str]] = defaultdict(set)
    found = {path: imports_of(path, root, modules) for path in files}
    heavy = heavy_modules([imp for imps in found.values() for imp in imps], modules)
    excused: set[tuple[str, str]] = set()  # LAZY_EXCEPTIONS still in use
    for path, imps in found.items():
        rel = path.relative_to(root).as_posix()
        for imp in imps:
            layer = part_of(imp.source)
            ours = _ours(imp.target, modules) if imp.target.split(".")[0] == package else None
            if ours is None:
                for banned in FORBIDDEN.get(layer, ()):
                    if imp.target == banned or imp.target.startswith(banned + "."):
                        problems.append(f"{rel}:{imp.line}: {layer}/ must not import {banned} ({imp.target})")
                continue
            lazy_edges[imp.source].add(ours)
            if imp.top:
                edges[imp.source].add(ours)
            if imp.local:
                local[rel] += 1
            if imp.local and ours not in heavy:
                if (imp.source, ours) in LAZY_EXCEPTIONS:
                    excused.add((imp.source, ours))
                else:
                    problems.append(
                        f"{rel}:{imp.line}: function-local import of {ours}, which imports none of "
                        f"{', '.join(HEAVY)}: move it to the top of the file"
                    )
            to = part_of(ours)
            if to == layer or ours == package or layer in _TOP:
                continue
            if to not in ALLOWED.get(layer, set()) and (imp.source, ours) not in EXCEPTIONS:
                problems.append(
                    f"{rel}:{imp.line}: {layer} must not import {to} ({ours}); "
                    f"{layer} may import: {', '.join(sorted(ALLOWED.get(layer, ()))) or 'nothing of ours'}"
                )
    for comp in cycles(edges):
        problems.append(f"import cycle among {', '.join(comp)} (module-level imports)")
    # the list names only what is still there, so that it shrinks as the code is fixed (a tree
    # without the module, such as a test's, has nothing to say about the entry)
    for source, target in sorted(set(LAZY_EXCEPTIONS) - excused):
        if source in modules:
            problems.append(
                f"{source} no longer imports {target} in a function: remove it from LAZY_EXCEPTIONS"
            )
    notes = [
        f"note: modules that import each other only lazily (in functions or for type checkers): {', '.join(comp)}"
        for comp in cycles(lazy_edges)
        if comp not in cycles(edges)
    ]
    return problems, dict(local), notes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--package", default=PACKAGE)
    ap.add_argument("--count-local", action="store_true")
    ap.add_argument(
        "--heavy",
        action="store_true",
        help="print each module rule 3 takes as heavy, and the imports that make it so",
    )
    args = ap.parse_args(argv)
    problems, local, notes = check(args.root, args.package)
    if args.heavy:
        files = sorted((args.root / args.package).rglob("*.py"))
        modules = {module_name(p, args.root) for p in files}
        found = [imp for p in files for imp in imports_of(p, args.root, modules)]
        for chain in sorted(heavy_modules(found, modules).values()):
            print(chain)
    if args.count_local:
        for rel, n in sorted(local.items()):
            print(f"{n:4d} {rel}")
        print(f"{sum(local.values()):4d} function-local imports of {args.package} modules")
    for line in [*notes, *problems]:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
