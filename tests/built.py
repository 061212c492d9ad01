"""What `make test` provides that some tests need: the SGLang venv (``.venv-sglang``, built by
``make setup-sglang``), the dev tools of ``.venv`` (hadolint), and the shared data sets under
``../shared/data``. Without one, a test skips and names what to build; in CI (``CI`` set to
anything but empty/0/false; ``.ci/run`` sets it) it fails instead: a check skipped there is a check
missing. Every such skip goes through :func:`missing` or the ``needs_built`` marker (conftest.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing(what: str) -> NoReturn:
    """Skip the running test for lack of ``what`` (a sentence naming it and how to build it);
    in CI, fail it."""
    if in_ci():
        pytest.fail(f"{what} (CI={os.environ['CI']}: CI must provide it, not skip the test)", pytrace=False)
    pytest.skip(what)
