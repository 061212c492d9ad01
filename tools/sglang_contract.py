"""Regenerate the SGLang contract fixtures (tests/fixtures/sglang/*.json) from an sglang wheel.

    pip download --no-deps sglang==0.5.23 -d /tmp/w
    .venv-sglang/bin/python tools/sglang_contract.py /tmp/w/sglang-0.5.23-*.whl

Reads, from the wheel's own source: the HTTP routes the client uses with their methods and body
types (``srt/entrypoints/http_server.py``, by AST), the fields of those request types
(``srt/managers/io_struct.py``: annotated class attributes, inherited ones included; required =
no default; ``Literal`` annotations become enums), ``SamplingParams.__init__``'s parameters, and
the wheel's ``Requires-Dist`` (the Dockerfile test checks its torch pin). Launch flags come from
``ServerArgs.add_cli_args`` run on the wheel's code, so run it with an interpreter that has the
server's dependencies (``.venv-sglang``); with ``--no-server-args`` that file is left alone.
Top-level entries the tool does not generate (a recorded reply example, notes) are kept. The
tests compare every payload and flag the project sends against these files.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "sglang"

# The routes the project calls (sglang/client.py, sglang/health.py).
ROUTES = [
    "/health",
    "/health_generate",
    "/get_server_info",
    "/server_info",
    "/generate",
    "/flush_cache",
    "/update_weights_from_disk",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/update_weights_from_tensor",
    "/update_weights_from_distributed",
    "/begin_weight_update",
    "/end_weight_update",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/abort_request",
    "/pause_generation",
    "/continue_generation",
]
# Request types whose fields are recorded even without a typed body on their route.
EXTRA_TYPES = ["FlushCacheReqInput"]
# Facts the source states in code paths, not in annotations (checked by hand against the wheel).
HAND = {
    "GenerateReqInput": {"one_of_required": ["text", "input_ids", "input_embeds"]},
    # GPU_MEMORY_TYPE_* constants, validated by the scheduler when tags are given
    "ReleaseMemoryOccupationReqInput": {"enums": {"tags": ["weights", "kv_cache", "cuda_graph"]}},
    "ResumeMemoryOccupationReqInput": {"enums": {"tags": ["weights", "kv_cache", "cuda_graph"]}},
}
# Launch flags the project passes (sglang/server.py, tests/sglang_fixtures.py, configs).
FLAGS = [
    "--model-path",
    "--tp-size",
    "--host",
    "--port",
    "--mem-fraction-static",
    "--dtype",
    "--api-key",
    "--base-gpu-id",
    "--max-total-tokens",
    "--max-running-requests",
    "--device",
    "--attention-backend",
    "--sampling-backend",
    "--grammar-backend",
    "--enable-memory-saver",
    "--skip-server-warmup",
    "--sleep-on-idle",
    "--enable-deterministic-inference",
    "--disable-cuda-graph",
    "--disable-overlap-schedule",
]


def _name(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):  # Annotated[X, Body()] / Optional[X]
        base = _name(node.value)
        inner = node.slice.elts[0] if isinstance(node.slice, ast.Tuple) else node.slice
        return _name(inner) if base in ("Annotated", "Optional") else base
    return None


def routes(source: str) -> dict:
    found: dict[str, dict] = {}
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        body = None
        for arg in fn.args.args:
            t = _name(arg.annotation) if arg.annotation is not None else None
            if t and (t.endswith("ReqInput") or t.endswith("Req")):
                body = t
                break
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)):
                continue
            kind = dec.func.attr
            if kind not in ("get", "post", "put", "api_route") or not dec.args:
                continue
            path = dec.args[0]
            if not (isinstance(path, ast.Constant) and isinstance(path.value, str)):
                continue
            if kind == "api_route":
                methods = next(
                    (ast.literal_eval(k.value) for k in dec.keywords if k.arg == "methods"), ["GET"]
                )
            else:
                methods = [kind.upper()]
            found[path.value] = {"methods": list(methods), "body": body}
    missing = [r for r in ROUTES if r not in found]
    if missing:
        sys.exit(f"routes not in this wheel's http_server.py: {missing}")
    return {r: found[r] for r in ROUTES}


def _literal(ann) -> list | None:
    if isinstance(ann, ast.Subscript) and _name(ann.value) == "Literal":
        elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
        return [ast.literal_eval(e) for e in elts]
    if isinstance(ann, ast.Subscript) and _name(ann.value) == "Optional":
        return _literal(ann.slice)
    return None


def io_struct(source: str, types: list[str]) -> dict:
    classes = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}

    def fields(name: str) -> list[tuple[str, bool, list | None]]:
        cls = classes[name]
        out: list[tuple[str, bool, list | None]] = []
        for base in cls.bases:
            if _name(base) in classes:
                out += fields(_name(base))
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if _name(stmt.annotation) == "ClassVar":
                    continue
                out = [f for f in out if f[0] != stmt.target.id]
                out.append((stmt.target.id, stmt.value is None, _literal(stmt.annotation)))
        return out

    result = {}
    for t in types:
        if t not in classes:
            sys.exit(f"{t} not in this wheel's io_struct.py")
        fs = fields(t)
        spec = {"required": [f for f, req, _ in fs if req], "fields": [f for f, _, _ in fs]}
        enums = {f: lit for f, _, lit in fs if lit}
        enums.update(HAND.get(t, {}).get("enums", {}))
        if enums:
            spec["enums"] = enums
        if "one_of_required" in HAND.get(t, {}):
            spec["one_of_required"] = HAND[t]["one_of_required"]
        result[t] = spec
    return result


def sampling_params(source: str) -> list[str]:
    """The API parameters: ``__init__``'s, or (a msgspec Struct) the annotated fields above the
    ``# --- Internal fields`` comment that separates what callers may set."""
    lines = source.splitlines()
    for cls in ast.parse(source).body:
        if isinstance(cls, ast.ClassDef) and cls.name == "SamplingParams":
            init = [f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"]
            if init:
                return [a.arg for a in init[0].args.args[1:] + init[0].args.kwonlyargs]
            end = cls.end_lineno
            for n in range(cls.lineno, cls.end_lineno):
                if lines[n - 1].strip().startswith("# --- Internal"):
                    end = n
                    break
            return [
                s.target.id
                for s in cls.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.lineno < end
            ]
    sys.exit("SamplingParams not found")


def server_flags(root: Path) -> dict:
    sys.path.insert(0, str(root))
    from sglang.srt.server_args import ServerArgs  # the wheel's copy, first on sys.path

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    actions = {o: a for a in parser._actions for o in a.option_strings}
    missing = [f for f in FLAGS if f not in actions]
    if missing:
        sys.exit(f"launch flags not defined by this wheel's ServerArgs: {missing}")
    switch = [f for f in FLAGS if actions[f].nargs == 0]
    return {"value_flags": [f for f in FLAGS if f not in switch], "switches": switch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("wheel", type=Path)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--no-server-args", action="store_true", help="leave server_args.json alone")
    args = ap.parse_args()
    with zipfile.ZipFile(args.wheel) as z, tempfile.TemporaryDirectory() as tmp:
        meta_name = next(n for n in z.namelist() if re.fullmatch(r"sglang-[^/]+\.dist-info/METADATA", n))
        meta = Parser().parsestr(z.read(meta_name).decode())
        version = meta["Version"]
        src = {
            p: z.read(f"sglang/srt/{p}").decode()
            for p in ("entrypoints/http_server.py", "managers/io_struct.py", "sampling/sampling_params.py")
        }
        source = {"wheel": args.wheel.name, "generated_by": "tools/sglang_contract.py"}
        r = routes(src["entrypoints/http_server.py"])
        types = sorted({v["body"] for v in r.values() if v["body"]} | set(EXTRA_TYPES))
        write = {
            "http_routes.json": {
                "source": {**source, "path": "sglang/srt/entrypoints/http_server.py"},
                "routes": r,
            },
            "io_struct.json": {
                "source": {**source, "path": "sglang/srt/managers/io_struct.py"},
                "requests": io_struct(src["managers/io_struct.py"], types),
                "sampling_params": {
                    "source": {**source, "path": "sglang/srt/sampling/sampling_params.py"},
                    "fields": sampling_params(src["sampling/sampling_params.py"]),
                },
            },
            "wheel.json": {
                "source": source,
                "version": version,
                # unconditional requirements only (markers for other platforms and extras dropped)
                "requires": sorted(
                    r.replace(" ", "") for r in meta.get_all("Requires-Dist") or [] if ";" not in r
                ),
            },
        }
        if not args.no_server_args:
            z.extractall(tmp, [n for n in z.namelist() if n.startswith("sglang/")])
            write["server_args.json"] = {
                "source": {**source, "path": "sglang/srt/server_args.py (ServerArgs.add_cli_args)"},
                **server_flags(Path(tmp)),
            }
        args.out.mkdir(parents=True, exist_ok=True)
        for name, data in write.items():
            target = args.out / name
            # hand-recorded entries (a reply example, notes on log-prob semantics) are kept
            old = json.loads(target.read_text()) if target.exists() else {}
            data = {**data, **{k: v for k, v in old.items() if k not in data}}
            target.write_text(json.dumps(data, indent=1) + "\n")
            print(f"wrote {args.out / name}")


if __name__ == "__main__":
    main()
