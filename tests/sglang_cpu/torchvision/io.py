"""Import-only ``torchvision.io`` (transformers' image utils import these names)."""

import enum

from ._absent import absent


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


def __getattr__(name):
    return absent(__name__, name)
