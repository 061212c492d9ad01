"""Import-only stand-in for torchvision (test infrastructure; see tests/sglang_cpu/README.md)."""

from . import io, transforms  # noqa: F401

__version__ = "0.0.0+cpu-stand-in"
