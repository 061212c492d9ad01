"""Tool specs and the tool YAML (``rollout.multi_turn.tool_config_path``).

The file is a list under ``tools:``; each entry is one of::

    tools:
      - function: tools/search.py:search        # fn(**arguments) -> str, sync or async
        tool_schema: {type: function, function: {name: search, description: ..., parameters: {...}}}
      - class_name: my_pkg.tools.Gsm8kTool        # a verl BaseTool subclass, verl's entry as is
        config: {type: native}
        tool_schema: {...}
      - builtin: python                           # or calculator; tool_schema optional (a default)
        config: {timeout_s: 10, memory_mb: 1024}

verl's tool YAML (``class_name`` + ``config`` + ``tool_schema``) loads unchanged. A relative
``function:`` path is read against the YAML's directory. Loading checks everything it can without
running user code: the file exists and parses, it defines the function, the schema is an OpenAI
function schema; importing the code happens only in the tool processes.
"""

from __future__ import annotations

import ast
import copy
import keyword
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_dapo.agent.tools.builtin import BUILTIN_OPTIONS, BUILTIN_SCHEMAS
from megatron_dapo.config.errors import ConfigError

__all__ = ["KINDS", "ToolConfigError", "ToolSpec", "builtin_spec", "check_schema", "load_tool_config"]

# function: a file.py:fn; verl_class: a dotted verl BaseTool class; builtin: builtin.py's tools
KINDS = ("function", "verl_class", "builtin")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_ENTRY_KEYS = {
    "function": {"function", "tool_schema", "sandbox"},
    "class_name": {"class_name", "config", "tool_schema"},
    "builtin": {"builtin", "config", "tool_schema"},
}


class ToolConfigError(ConfigError):
    """The tool YAML or a tool spec is wrong; the message names the file, the entry, the field and the fix."""


@dataclass
class ToolSpec:
    """One tool: what the model is told (``schema``) and how a tool process runs it.

    ``kind``: ``function`` (``target`` is ``/abs/path/file.py:fn``), ``verl_class`` (``target`` is
    ``pkg.module.Class``, built as ``Class(config=config, tool_schema=...)``) or ``builtin``
    (``target`` is ``python`` or ``calculator``, ``config`` its options).
    ``schema``: the OpenAI function schema, ``{"type": "function", "function": {"name",
    "description", "parameters"}}``, with defaults filled in.
    """

    name: str
    schema: dict[str, Any]
    kind: str
    target: str
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def required(self) -> list[str]:
        """The argument names the schema marks as required."""
        return list(self.schema["function"]["parameters"].get("required", []))


def load_tool_config(path: str | Path) -> list[ToolSpec]:
    """The tools of a tool YAML, checked (see the module doc); ToolConfigError on any problem."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ToolConfigError(
            f"tool config {str(path)!r} does not exist (rollout.multi_turn.tool_config_path); "
            "give the path of a YAML file with a `tools:` list"
        )
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ToolConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tools"), list):
        got = type(doc).__name__ if not isinstance(doc, dict) else f"keys {sorted(doc)}"
        raise ToolConfigError(f"{path}: the file must hold a mapping with a `tools:` list (got {got})")
    specs: list[ToolSpec] = []
    seen: dict[str, int] = {}
    for index, entry in enumerate(doc["tools"]):
        spec = _entry(entry, f"{path}: tools[{index}]", path.resolve().parent)
        if spec.name in seen:
            raise ToolConfigError(
                f"{path}: tools[{index}]: tool_schema.function.name: {spec.name!r} is also the name of "
                f"tools[{seen[spec.name]}]; the model calls tools by name, so give each its own"
            )
        seen[spec.name] = index
        specs.append(spec)
    return specs


def builtin_spec(name: str, config: dict | None = None, schema: dict | None = None) -> ToolSpec:
    """The spec of builtin ``name`` (``python`` or ``calculator``), as ``builtin: name`` in a YAML."""
    return _builtin(name, config, schema, f"builtin {name!r}")


def check_schema(schema: Any, where: str) -> dict[str, Any]:
    """``schema`` checked as an OpenAI function tool schema, with verl's defaults filled in (a copy).

    ``where`` starts each error message (for example ``"tools.yaml: tools[2]"``)."""
    fix = "write {type: function, function: {name: ..., description: ..., parameters: {type: object, properties: {...}, required: [...]}}}"
    if not isinstance(schema, dict):
        raise ToolConfigError(f"{where}: tool_schema: must be a mapping, got {_kind(schema)}; {fix}")
    schema = copy.deepcopy(schema)
    if schema.get("type", "function") != "function":
        raise ToolConfigError(f"{where}: tool_schema.type: must be 'function', got {schema['type']!r}")
    schema["type"] = "function"
    function = schema.get("function")
    if not isinstance(function, dict):
        raise ToolConfigError(f"{where}: tool_schema.function: missing or not a mapping; {fix}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ToolConfigError(
            f"{where}: tool_schema.function.name: missing; every tool needs the name the model calls it by"
        )
    if not _NAME.match(name):
        raise ToolConfigError(
            f"{where}: tool_schema.function.name: {name!r} is not a valid tool name; use 1-64 letters, "
            "digits, '_' or '-'"
        )
    description = function.setdefault("description", "")
    if not isinstance(description, str):
        raise ToolConfigError(
            f"{where}: tool_schema.function.description: must be a string, got {_kind(description)}"
        )
    params = function.setdefault("parameters", {"type": "object", "properties": {}, "required": []})
    if not isinstance(params, dict):
        raise ToolConfigError(
            f"{where}: tool_schema.function.parameters: must be a mapping, got {_kind(params)}"
        )
    if params.setdefault("type", "object") != "object":
        raise ToolConfigError(
            f"{where}: tool_schema.function.parameters.type: must be 'object' (arguments are named), got {params['type']!r}"
        )
    properties = params.setdefault("properties", {})
    if not isinstance(properties, dict) or not all(isinstance(v, dict) for v in properties.values()):
        raise ToolConfigError(
            f"{where}: tool_schema.function.parameters.properties: must map each argument name to its schema "
            "({type: string, description: ...})"
        )
    required = params.setdefault("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ToolConfigError(
            f"{where}: tool_schema.function.parameters.required: must be a list of argument names, got {required!r}"
        )
    unknown = [r for r in required if r not in properties]
    if unknown:
        raise ToolConfigError(
            f"{where}: tool_schema.function.parameters.required: {unknown} are not in properties "
            f"({sorted(properties)}); describe each required argument under properties"
        )
    return schema


def _entry(entry: Any, where: str, base: Path) -> ToolSpec:
    if not isinstance(entry, dict):
        raise ToolConfigError(
            f"{where}: must be a mapping with one of function, class_name, builtin; got {_kind(entry)}"
        )
    kinds = [k for k in _ENTRY_KEYS if k in entry]
    if len(kinds) != 1:
        raise ToolConfigError(
            f"{where}: give exactly one of `function: path.py:fn`, `class_name: pkg.module.Class` or "
            f"`builtin: python|calculator` (found {kinds or 'none'} among keys {sorted(entry)})"
        )
    kind = kinds[0]
    if kind == "class_name" and "mcp" in entry:
        raise ToolConfigError(
            f"{where}: mcp: MCP tools are not supported; list each tool with its class_name and tool_schema"
        )
    extra = sorted(set(entry) - _ENTRY_KEYS[kind])
    if extra:
        raise ToolConfigError(
            f"{where}: unknown key(s) {extra} for a `{kind}` entry; allowed: {sorted(_ENTRY_KEYS[kind])}"
        )
    if kind == "function":
        return _function(entry, where, base)
    if kind == "class_name":
        return _verl_class(entry, where)
    return _builtin(entry["builtin"], entry.get("config"), entry.get("tool_schema"), where)


def _function(entry: dict, where: str, base: Path) -> ToolSpec:
    value = entry["function"]
    file_part, sep, fn = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    if not sep or not file_part or not fn:
        raise ToolConfigError(f"{where}: function: {value!r} must look like 'path/to/file.py:function_name'")
    if not fn.isidentifier() or keyword.iskeyword(fn):
        raise ToolConfigError(f"{where}: function: {fn!r} (after the ':') is not a Python function name")
    file = Path(file_part).expanduser()
    file = (file if file.is_absolute() else base / file).resolve()
    if not file.is_file():
        raise ToolConfigError(
            f"{where}: function: file {str(file)!r} does not exist (a relative path is read against the "
            f"YAML's directory {str(base)!r}); fix the path"
        )
    try:
        tree = ast.parse(file.read_text(encoding="utf-8"), str(file))
    except (SyntaxError, UnicodeDecodeError, ValueError) as e:
        raise ToolConfigError(f"{where}: function: {str(file)!r} is not valid Python: {e}") from None
    defined = _top_level_names(tree)
    if fn not in defined:
        functions = sorted(n for n, is_def in defined.items() if is_def)
        raise ToolConfigError(
            f"{where}: function: {str(file)!r} defines no {fn!r} at its top level; functions there: {functions}"
        )
    if "tool_schema" not in entry:
        raise ToolConfigError(
            f"{where}: tool_schema: missing; a function tool needs the schema the model is shown "
            "({type: function, function: {name, description, parameters}})"
        )
    schema = check_schema(entry["tool_schema"], where)
    config = {}
    if entry.get("sandbox") is not None:
        config["sandbox"] = _function_sandbox(entry["sandbox"], where, base)
    return ToolSpec(schema["function"]["name"], schema, "function", f"{file}:{fn}", config)


def _function_sandbox(value: Any, where: str, base: Path) -> dict[str, Any]:
    """A function tool's ``sandbox:`` entry: ``{read: [paths], packages: [names]}``, both optional
    (``sandbox: {}`` is the boundary with nothing extra to read)."""
    if not isinstance(value, dict) or set(value) - {"read", "packages"}:
        raise ToolConfigError(
            f"{where}: sandbox: must be a mapping with `read: [paths the tool may read]` and/or "
            f"`packages: [importable names]`, got {value!r}"
        )
    read = []
    for item in value.get("read") or []:
        path = Path(str(item)).expanduser()
        path = (path if path.is_absolute() else base / path).resolve()
        if not path.exists():
            raise ToolConfigError(
                f"{where}: sandbox.read: {str(path)!r} does not exist (a relative path is read against the "
                f"YAML's directory); fix or remove it"
            )
        read.append(str(path))
    packages = value.get("packages") or []
    if not all(isinstance(p, str) and p.isidentifier() for p in packages):
        raise ToolConfigError(
            f"{where}: sandbox.packages: must be a list of importable names, got {packages!r}"
        )
    return {"read": read, "packages": list(packages)}


def _verl_class(entry: dict, where: str) -> ToolSpec:
    target = entry["class_name"]
    parts = target.split(".") if isinstance(target, str) else []
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise ToolConfigError(
            f"{where}: class_name: {target!r} must be the dotted path of a class, 'package.module.ClassName'"
        )
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ToolConfigError(
            f"{where}: config: must be a mapping (verl's `config: {{type: native, ...}}`), got {_kind(config)}"
        )
    tool_type = config.get("type", "native")
    if tool_type != "native":
        raise ToolConfigError(
            f"{where}: config.type: {tool_type!r} is not supported; only 'native' tools (MCP tools are not)"
        )
    if entry.get("tool_schema") is None:
        raise ToolConfigError(
            f"{where}: tool_schema: missing; the schema is read from the YAML without importing the class, "
            "so copy the one the class would return (get_openai_tool_schema) here"
        )
    schema = check_schema(entry["tool_schema"], where)
    return ToolSpec(schema["function"]["name"], schema, "verl_class", target, dict(config))


def _builtin(name: Any, config: Any, schema: Any, where: str) -> ToolSpec:
    if name not in BUILTIN_SCHEMAS:
        raise ToolConfigError(
            f"{where}: builtin: {name!r} is not a builtin tool; builtins: {', '.join(BUILTIN_SCHEMAS)}"
        )
    config = {} if config is None else config
    if not isinstance(config, dict):
        raise ToolConfigError(f"{where}: config: must be a mapping of {name}'s options, got {_kind(config)}")
    options = BUILTIN_OPTIONS[name]
    for key, value in config.items():
        if name == "python" and key == "netns":
            raise ToolConfigError(
                f"{where}: config.netns: no longer an option: the python tool always runs without a network, "
                "in the sandbox's own namespaces; remove the key"
            )
        if key not in options:
            raise ToolConfigError(
                f"{where}: config.{key}: not an option of builtin {name}; options: {', '.join(options) or 'none'}"
            )
        want = options[key]
        if want is str or want is list:
            _check_text_option(name, key, value, where)
            continue
        ok = (
            isinstance(value, bool)
            if want is bool
            else isinstance(value, (int, float)) and not isinstance(value, bool)
        )
        if want is int:
            ok = ok and float(value).is_integer()
        if not ok or (want is not bool and value <= 0):
            raise ToolConfigError(
                f"{where}: config.{key}: must be a {'boolean' if want is bool else 'positive number'}, got {value!r}"
            )
    schema = check_schema(BUILTIN_SCHEMAS[name] if schema is None else schema, where)
    argument = BUILTIN_SCHEMAS[name]["function"]["parameters"]["required"][0]
    if argument not in schema["function"]["parameters"]["properties"]:
        raise ToolConfigError(
            f"{where}: tool_schema.function.parameters.properties: builtin {name} takes the argument "
            f"{argument!r}; keep it under that name when renaming or redescribing the tool"
        )
    return ToolSpec(schema["function"]["name"], schema, "builtin", name, dict(config))


def _check_text_option(name: str, key: str, value: Any, where: str) -> None:
    if key == "sandbox" and value not in ("bwrap", "none"):
        raise ToolConfigError(
            f"{where}: config.sandbox: {value!r} is not a choice; `bwrap` (the default: the kernel sandbox) or "
            "`none` (no sandbox, for trusted code only)"
        )
    if key == "packages" and not (
        isinstance(value, list) and all(isinstance(p, str) and p.isidentifier() for p in value)
    ):
        raise ToolConfigError(
            f"{where}: config.packages: must be a list of importable names (e.g. [numpy, sympy]), got {value!r}"
        )


def _top_level_names(tree: ast.Module) -> dict[str, bool]:
    """Names bound at a module's top level, True for those bound by def (a static look: no code runs)."""
    names: dict[str, bool] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = not isinstance(node, ast.ClassDef)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name):
                        names.setdefault(sub.id, False)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names.setdefault((alias.asname or alias.name).split(".")[0], False)
    return names


def _kind(value: Any) -> str:
    return "nothing" if value is None else f"a {type(value).__name__} ({value!r:.60})"
