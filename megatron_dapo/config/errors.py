"""The config's error type, below both the loader and the validation."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value is missing, unknown, mistyped or inconsistent; the message says the fix."""
