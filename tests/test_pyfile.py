"""pyfile.import_file: one module per file and contents, never a stale copy of an edited file."""

import sys

import pytest

from megatron_dapo.pyfile import import_file


def test_same_file_imports_once_and_an_edited_file_anew(tmp_path):
    f = tmp_path / "fn.py"
    f.write_text("calls = []\ndef fn():\n    return 1\n")
    a = import_file(f, "t")
    assert import_file(str(f), "t") is a
    f.write_text("def fn():\n    return 2\n")
    b = import_file(f, "t")
    assert b is not a and (a.fn(), b.fn()) == (1, 2)


def test_a_file_that_fails_at_import_leaves_nothing_behind(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text("raise ValueError('boom')\n")
    before = set(sys.modules)
    with pytest.raises(ValueError, match="boom"):
        import_file(f, "t")
    assert set(sys.modules) == before
    with pytest.raises(FileNotFoundError, match="missing.py does not exist"):
        import_file(tmp_path / "missing.py", "t")
