"""Import-only: every name is a function that raises."""

from ..._absent import absent


def __getattr__(name):
    return absent(__name__, name)
