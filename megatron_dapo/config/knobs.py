"""Runtime configs built from the schema, so that every knob has one default.

A runtime config (the rollout manager's, the actor's, the optimizer's, the planner's) declares
each field that comes from the run config as ``knob("section.key")``: its default is read from
``schema.py`` and :func:`from_config` fills it from a loaded config. Fields that are not config
keys (derived values, things the run learns at start-up) stay ordinary fields and are passed to
:func:`from_config` by name. Range checks are ``validate.py``'s alone: a runtime config built
here holds values that were validated when the config was loaded.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from omegaconf import MISSING

from megatron_dapo.config.schema import DAPOConfig

KEY = "config_key"  # the field metadata that names a field's config key


def schema_default(key: str) -> Any:
    """The schema's default of dotted ``key`` (e.g. ``optim.lr_warmup_steps``)."""
    node: Any = DAPOConfig()
    for part in key.split("."):
        if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
            raise KeyError(f"{key!r} is not a key of the config schema (config/schema.py)")
        node = getattr(node, part)
    return node


def knob(key: str) -> Any:
    """A dataclass field whose value is config ``key`` and whose default is the schema's.

    A key without a default in the schema (``???``) gives a required field."""
    default = schema_default(key)
    metadata = {KEY: key}
    if default == MISSING:
        return dataclasses.field(metadata=metadata)
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def config_keys(cls: type) -> dict[str, str]:
    """{field name: config key} of ``cls``'s knobs."""
    return {f.name: f.metadata[KEY] for f in dataclasses.fields(cls) if KEY in f.metadata}


def lookup(cfg: Any, key: str) -> Any:
    """``cfg``'s value at dotted ``key``; ``cfg`` is a DictConfig or a nested dict."""
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def from_config(cls: type, cfg: Any, **runtime: Any) -> Any:
    """``cls`` with every knob read from ``cfg`` and the other fields from ``runtime``."""
    values = {name: lookup(cfg, key) for name, key in config_keys(cls).items()}
    return cls(**values, **runtime)
