"""The config reference: every key of the schema with its type, default and the schema's comment.

Read from ``schema.py`` itself (its dataclasses for keys and defaults, its source for the
comments), so the reference cannot say something the schema does not. ``docs/config.md`` is
``megatron-dapo config --reference``'s output; a test fails when it is stale.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from megatron_dapo.config import schema
from megatron_dapo.config.schema import DAPOConfig
from megatron_dapo.config.validate import CHOICES

REGENERATE = "megatron-dapo config --reference > docs/config.md"


@dataclass(frozen=True)
class KeyDoc:
    key: str
    type: str  # as the schema writes it, e.g. Optional[str]
    default: Any
    comment: str
    section: bool = False


def _comments() -> dict[tuple[str, str], tuple[str, str]]:
    """{(class name, field name): (annotation as written, comment)}: the comment lines right
    above the field and the one at the end of its line, joined."""
    source = inspect.getsource(schema)
    lines = source.splitlines()
    out = {}
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for stmt in cls.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above = []
            i = stmt.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#"):
                above.insert(0, lines[i].strip().lstrip("#").strip())
                i -= 1
            trailing = ""
            last = lines[stmt.end_lineno - 1]
            if "#" in last:
                tail = last.split("#", 1)[1].strip()
                # a '#' inside a string default is not a comment
                if last.count('"', 0, last.index("#")) % 2 == 0:
                    trailing = tail
            text = " ".join(part for part in (" ".join(above), trailing) if part)
            out[(cls.name, stmt.target.id)] = (ast.get_source_segment(source, stmt.annotation) or "", text)
    return out


def _own_docstring(cls: type) -> str:
    """The class's docstring's first paragraph; none for the signature dataclass writes in its place."""
    doc = cls.__dict__.get("__doc__") or ""
    if doc.startswith(f"{cls.__name__}("):
        return ""
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


def _with_choices(key: str, comment: str) -> str:
    """The comment, and the values validation accepts when the key has a fixed set."""
    allowed = CHOICES.get(key)
    if not allowed:
        return comment
    values = ", ".join(show_default(v) for v in allowed)
    return f"{comment} One of: {values}." if comment else f"One of: {values}."


def key_docs() -> list[KeyDoc]:
    """Every key of the schema, sections included, in the schema's order."""
    notes = _comments()
    docs: list[KeyDoc] = []

    def walk(node: Any, prefix: str) -> None:
        for f in dataclasses.fields(node):
            key = f"{prefix}{f.name}"
            value = getattr(node, f.name)
            annotation, comment = notes.get((type(node).__name__, f.name), (str(f.type), ""))
            if dataclasses.is_dataclass(value):
                doc = _own_docstring(type(value))
                docs.append(KeyDoc(key, "section", None, comment or doc, section=True))
                walk(value, key + ".")
            else:
                if f.default_factory is schema.usable_cores:  # the machine's, not a fixed value
                    value = MachineDefault("the cores this process may use")
                docs.append(KeyDoc(key, annotation, value, _with_choices(key, comment)))

    walk(DAPOConfig(), "")
    return docs


class MachineDefault(str):
    """A default the machine decides when the config is loaded; shown as its rule."""


def show_default(value: Any) -> str:
    """A default as a user writes it in YAML or an override."""
    if isinstance(value, MachineDefault):
        return f"({value})"
    if value == MISSING:
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"' if value == "" or value != value.strip() else value
    return str(value)


def key_lines() -> list[str]:
    """`config --keys`: each key with its type and default, aligned."""
    docs = key_docs()
    width = max(len(d.key) for d in docs) + 2
    twidth = max(len(d.type) for d in docs) + 2
    return [
        f"{d.key:<{width}}{d.type}"
        if d.section
        else f"{d.key:<{width}}{d.type:<{twidth}}{show_default(d.default)}"
        for d in docs
    ]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def reference_markdown() -> str:
    """docs/config.md."""
    out = [
        "# Config reference",
        "",
        "Every key of the run config: its type, default and meaning, from",
        "`megatron_dapo/config/schema.py`. Generated; do not edit by hand. After a change to the schema:",
        "",
        "```bash",
        REGENERATE,
        "```",
        "",
        "A recipe is a YAML of these sections; `key=value` overrides follow it on the command line",
        "(`megatron-dapo config CONFIG key=value ...` prints the result, after the same checks `train`",
        "makes). Ranges and cross-key rules are checked in `megatron_dapo/config/validate.py`; each",
        "error names the key and the fix.",
        "",
    ]
    table_open = False
    for d in key_docs():
        if d.section:
            out += ["", f"## `{d.key}`", ""]
            if d.comment:
                out += [_cell(d.comment), ""]
            table_open = False
            continue
        if not table_open:
            out += ["| key | type | default | meaning |", "|---|---|---|---|"]
            table_open = True
        out.append(
            f"| `{d.key}` | `{_cell(d.type)}` | `{_cell(show_default(d.default))}` | {_cell(d.comment)} |"
        )
    return "\n".join(out) + "\n"
