"""Structured configuration: schema (dataclasses), loading with overrides, validation."""

from megatron_dapo.config.errors import ConfigError
from megatron_dapo.config.loader import all_keys, load_config, to_container, to_yaml
from megatron_dapo.config.schema import DAPOConfig

__all__ = ["ConfigError", "DAPOConfig", "all_keys", "load_config", "to_container", "to_yaml"]
