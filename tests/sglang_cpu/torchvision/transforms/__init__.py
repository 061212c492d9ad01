"""Names the SGLang server and transformers import from ``torchvision.transforms``; using any raises."""

import enum

from .._absent import absent
from . import functional  # noqa: F401


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name):
    return absent(__name__, name)
