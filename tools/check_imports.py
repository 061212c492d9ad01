"""The import contract of megatron_dapo, checked from the source (ast; nothing is imported).

Two rules, both run by `make lint`:
1. Layers. Each top-level part of the package (a subpackage or a module such as `arch.py`) may
   import only the parts `ALLOWED` lists for it, at the top of a file or inside a function
   alike: a lazy import is still a dependency. Some parts also keep away from outside packages
   (`FORBIDDEN`: algo/ from torch.distributed and megatron, plan/ from torch, arch from megatron).
   This is the picture docs/architecture.md draws.
2. No cycles among the package's modules through module-level imports (those run at import
   time; `if TYPE_CHECKING:` blocks do not).

Usage: python tools/check_imports.py [--root DIR] [--count-local]
Exit status 1 with one line per violation; --count-local also prints how many function-local
imports of the package's own modules remain, per file.
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
# ports) and http_errors.py (an HTTP error answer as one line) are leaves anyone may use.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "ports": set(),
    "http_errors": set(),
    "algo": set(),
    "rewards": {"errors"},
    "data": {"errors"},
    "eval": {"rewards", "data", "errors", "http_errors"},
    # the schema and its checks; algo for the rollout-correction settings, actor.gpu_settings'
    # pure rules (below: a module-level exception)
    "config": {"algo", "errors"},
    "plan": {"config"},
    "arch": set(),
    "weights": {"arch", "errors"},
    "actor": {"algo", "arch", "config", "weights", "data", "errors", "ports"},
    "rollout": {"algo", "arch", "config", "data", "rewards", "errors", "http_errors", "ports"},
    # SGLang servers (launch, placement, health) and their HTTP client, an engine of rollout's protocol
    "sglang": {"config", "errors", "http_errors", "ports", "rollout"},
    # the weight transports: HF-named buckets to HF engines, SGLang servers or a checkpoint on disk
    "sync": {"config", "errors", "ports", "rollout", "sglang", "weights"},
    # offline conversion: builds the model on ranks it launches
    "convert": {"actor", "arch", "weights", "errors"},
    "driver": {
        *(
            "actor",
            "algo",
            "arch",
            "config",
            "data",
            "errors",
            "eval",
            "ports",
            "rewards",
            "rollout",
            "sglang",
            "sync",
            "weights",
        ),
    },
    # the CPU demo's assets and the torchrun entry point sit beside the commands, on the driver
    "demo": {"actor", "algo", "arch", "config", "data", "driver", "errors", "rewards", "rollout", "weights"},
    "train": {
        *(
            "actor",
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


def _walk(body: list[ast.stmt], top: bool):
    """(import node, at module level) for every import statement under ``body``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, top
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _walk(node.body, False)
        elif isinstance(node, ast.ClassDef):
            yield from _walk(node.body, top)
        elif isinstance(node, ast.If) and _type_checking(node):
            yield from ((n, False) for n, _ in _walk(node.body, top))
            yield from _walk(node.orelse, top)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list):
                    yield from _walk([n for n in inner if isinstance(n, ast.AST)], top)
            if isinstance(node, ast.ExceptHandler):
                yield from _walk(node.body, top)


def imports_of(path: Path, root: Path, modules: set[str]) -> list[Import]:
    source = module_name(path, root)
    is_package = path.name == "__init__.py"
    out = []
    for node, top in _walk(ast.parse(path.read_text(), str(path)).body, True):
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
        out.extend(Import(source, t, node.lineno, top) for t in dict.fromkeys(targets))
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
    for path in files:
        rel = path.relative_to(root).as_posix()
        for imp in imports_of(path, root, modules):
            layer = part_of(imp.source)
            ours = _ours(imp.target, modules) if imp.target.split(".")[0] == package else None
            if ours is None:
                for banned in FORBIDDEN.get(layer, ()):
                    if imp.target == banned or imp.target.startswith(banned + "."):
                        problems.append(f"{rel}:{imp.line}: {layer}/ must not import {banned} ({imp.target})")
                continue
            lazy_edges[imp.source].add(ours)
            if not imp.top:
                local[rel] += 1
            else:
                edges[imp.source].add(ours)
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
    args = ap.parse_args(argv)
    problems, local, notes = check(args.root, args.package)
    if args.count_local:
        for rel, n in sorted(local.items()):
            print(f"{n:4d} {rel}")
        print(f"{sum(local.values()):4d} function-local imports of {args.package} modules")
    for line in [*notes, *problems]:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
