"""Import-only ``torchvision.transforms.v2`` (transformers' image processors import it)."""

from ..._absent import absent
from . import functional  # noqa: F401


def __getattr__(name):
    return absent(__name__, name)
