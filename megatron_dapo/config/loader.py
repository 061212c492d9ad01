"""Load a run config: YAML file(s) + `key=value` overrides merged onto the dataclass schema.

A YAML file may name `base: other.yaml` (relative to itself) to inherit from another recipe;
the chain is merged base first. A relative path a YAML gives for a key of `PATHS_FROM_YAML` is read
against that YAML's directory too when the file is there, so a recipe and the files it names work
from any working directory; otherwise it stays as written (read against the working directory, as
verl's paths are and as an override's always is). Unknown keys and wrong types become
`ConfigError`s that name the key and the nearest valid one, instead of OmegaConf's tracebacks.
"""

from __future__ import annotations

import difflib
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from megatron_dapo.config.errors import ConfigError
from megatron_dapo.config.schema import DAPOConfig
from megatron_dapo.config.validate import validate

__all__ = [
    "ConfigError",
    "all_keys",
    "load_config",
    "merge_overrides",
    "nearest_key",
    "to_container",
    "to_yaml",
]


# Keys the schema no longer has, with what to do instead: a run that sets one must not train
# without the behaviour it asked for and never be told.
REMOVED_KEYS = {
    "algorithm.kl_coef": (
        "a KL to the reference model is actor.use_kl_loss=true actor.kl_loss_coef=C (a loss term) or "
        "algorithm.use_kl_in_reward=true algorithm.kl_ctrl.kl_coef=C (a reward penalty); remove algorithm.kl_coef"
    ),
    "logging.jsonl": "metrics.jsonl is always written (resume and the plots read it); remove the key",
}


# Keys naming a file that a recipe ships beside itself (a tool YAML next to the run YAML).
PATHS_FROM_YAML = ("rollout.multi_turn.tool_config_path",)


def all_keys(cls: type = DAPOConfig, prefix: str = "") -> list[str]:
    """Every dotted leaf and section key of the schema, e.g. 'algorithm.filter_groups.enable'."""
    out = []
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        out.append(key)
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            out.extend(all_keys(type(default), key + "."))
    return out


def nearest_key(key: str) -> str | None:
    """The schema key most like `key` (full path first, then by leaf name anywhere)."""
    keys = all_keys()
    match = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if match:
        return match[0]
    leaf = key.rsplit(".", 1)[-1]
    by_leaf = {k.rsplit(".", 1)[-1]: k for k in keys}
    match = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
    return by_leaf[match[0]] if match else None


def _friendly(e: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(e, "full_key", None) or "?"
    if isinstance(e, ConfigKeyError):
        if key in REMOVED_KEYS:
            return ConfigError(f"{source}: config key '{key}' was removed: {REMOVED_KEYS[key]}")
        hint = nearest_key(key)
        did = f"; did you mean '{hint}'?" if hint else ""
        return ConfigError(f"{source}: unknown config key '{key}'{did} (see `megatron-dapo config --keys`)")
    if isinstance(e, ValidationError):
        msg = str(e).splitlines()[0]
        return ConfigError(f"{source}: bad value for '{key}': {msg}")
    return ConfigError(f"{source}: {str(e).splitlines()[0]} (key '{key}')")


def _read_yaml_chain(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[str, dict]]:
    path = path.resolve()
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path in seen:
        raise ConfigError(f"{path}: 'base' chain loops back to itself")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
    base = data.pop("base", None)
    chain = _read_yaml_chain(path.parent / base, (*seen, path)) if base else []
    _paths_from_yaml(data, path.parent)
    return [*chain, (str(path), data)]


def _paths_from_yaml(data: dict, directory: Path) -> None:
    """Each relative `PATHS_FROM_YAML` path of a YAML's `data` that names a file in `directory`
    becomes that file's absolute path; the others are left as written."""
    for key in PATHS_FROM_YAML:
        *sections, leaf = key.split(".")
        node: Any = data
        for part in sections:
            node = node.get(part) if isinstance(node, dict) else None
        value = node.get(leaf) if isinstance(node, dict) else None
        if not isinstance(value, str) or not value or Path(value).expanduser().is_absolute():
            continue
        beside = directory / value
        if beside.is_file():
            node[leaf] = str(beside)


def _parse_overrides(overrides: list[str]) -> list[str]:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. rollout.n=8)")
    return overrides


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> DictConfig:
    """Schema defaults <- YAML chain <- overrides; returns a validated, read-only DictConfig."""
    cfg = OmegaConf.structured(DAPOConfig)
    layers = _read_yaml_chain(Path(path)) if path else []
    for source, data in layers:
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.create(data))
        except OmegaConfBaseException as e:
            raise _friendly(e, source) from None
    cfg = merge_overrides(cfg, overrides)
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(
            f"required config value(s) not set: {', '.join(missing)}; "
            f"set them in the YAML or as overrides, e.g. {missing[0]}=/path/to/hf_checkpoint"
        )
    validate(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def merge_overrides(cfg: DictConfig, overrides: list[str] | None) -> DictConfig:
    """``cfg`` with ``key=value`` overrides merged in, one at a time, so that an unknown key or a
    wrong type is a ConfigError naming that override. Not validated (``load_config`` validates)."""
    for item in _parse_overrides(list(overrides or [])):
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as e:
            raise _friendly(e, f"override '{item}'") from None
    return cfg


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def to_container(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
