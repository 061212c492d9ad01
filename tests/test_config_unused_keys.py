"""Every leaf of the config schema is read by some code: a knob nothing reads must not exist (a
user who sets it trains without what they asked for and is never told).

The scan reads the source of ``megatron_dapo/`` (the schema, the validator and the loader left
out: checking or naming a key is not using it). A leaf ``a.b.c`` counts as read in a file that
holds any of:

1. the whole dotted key in quotes: ``knob("a.b.c")``, a lookup by name;
2. its parent and leaf as an attribute chain: ``cfg.a.b.c``, ``alg.b.c`` (``b.c``);
3. its parent and leaf as subscripts: ``["b"]["c"]``;
4. a name bound to the parent section (``x = cfg.a.b`` or ``x = cfg["b"]``, a whole line) then
   read as ``x.c`` or ``x["c"]``;
5. the parent section splatted into a call (``**alg["b"]``) or indexed by a variable
   (``b[name]``): every leaf of it.

A heuristic: a leaf read in a way none of these sees (``getattr`` with a computed name) is
reported, and is then either read plainly or listed in ``READ_OTHERWISE`` with where it is read.
"""

from __future__ import annotations

import re
from pathlib import Path

from megatron_dapo.config.loader import REMOVED_KEYS, all_keys, load_config

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_dapo"
EXCLUDED = {"config/schema.py", "config/validate.py", "config/loader.py"}
# leaf -> where it is read, for reads the scan cannot see
READ_OTHERWISE: dict[str, str] = {}

_ALIAS = re.compile(r"^\s*(\w+)\s*=\s*\S*?(?:\.(\w+)|\[[\"'](\w+)[\"']\])\s*$", re.M)
_SPLAT = re.compile(r"\*\*\S*?(?:\.(\w+)|\[[\"'](\w+)[\"']\])")


def leaf_keys() -> list[str]:
    keys = all_keys()
    sections = {k for k in keys if any(o.startswith(k + ".") for o in keys)}
    return [k for k in keys if k not in sections]


def reads(key: str, text: str) -> bool:
    """Whether ``text`` (a module's source) reads the dotted schema leaf ``key``, by the rules above."""
    if re.search(rf"[\"']{re.escape(key)}[\"']", text):
        return True
    parts = key.split(".")
    if len(parts) < 2:
        return False
    parent, leaf = parts[-2], parts[-1]
    if re.search(rf"\b{parent}\.{leaf}\b", text):
        return True
    if re.search(rf"\[[\"']{parent}[\"']\]\[[\"']{leaf}[\"']\]", text):
        return True
    for m in _ALIAS.finditer(text):
        if parent in (m.group(2), m.group(3)) and re.search(
            rf"\b{m.group(1)}(?:\.{leaf}\b|\[[\"']{leaf}[\"']\])", text
        ):
            return True
    if any(parent in m.groups() for m in _SPLAT.finditer(text)):
        return True
    return bool(re.search(rf"\b{parent}\[(?![\"'])", text))


def unread_keys(package: Path, keys: list[str]) -> list[str]:
    texts = [
        p.read_text()
        for p in sorted(package.rglob("*.py"))
        if p.relative_to(package).as_posix() not in EXCLUDED
    ]
    return [k for k in keys if k not in READ_OTHERWISE and not any(reads(k, t) for t in texts)]


def test_every_schema_leaf_is_read_by_some_code():
    unread = unread_keys(PACKAGE, leaf_keys())
    assert not unread, (
        f"config keys no code reads: {unread}; wire them up or remove them from config/schema.py "
        "(with an entry in config/loader.py's REMOVED_KEYS)"
    )


def test_scan_finds_an_unread_key_and_each_way_of_reading(tmp_path):
    pkg = tmp_path / "megatron_dapo"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "x = knob('optim.lr')\n"
        "y = cfg.algorithm.clip_ratio_low\n"
        "z = cfg['tis']['cap']\n"
        "alg = cfg.algorithm\n"
        "w = alg.loss_agg_mode\n"
        "rc = RolloutCorrection(**alg['rollout_correction'])\n"
        "t = cfg.trainer.call_timeout[limit]\n"
    )
    keys = [
        "optim.lr",
        "algorithm.clip_ratio_low",
        "algorithm.tis.cap",
        "algorithm.loss_agg_mode",
        "algorithm.rollout_correction.mode",
        "trainer.call_timeout.other_s",
        "algorithm.kl_coef",
        "algorithm.tis.enable",
    ]
    assert unread_keys(pkg, keys) == ["algorithm.kl_coef", "algorithm.tis.enable"]


def test_removed_keys_are_refused_with_what_to_do(tmp_path):
    import pytest

    from megatron_dapo.config import ConfigError

    (tmp_path / "old.yaml").write_text("algorithm:\n  kl_coef: 0.0\n")
    for source in ([str(tmp_path / "old.yaml")], [None, ["algorithm.kl_coef=0.01"]]):
        path, overrides = (source[0], []) if len(source) == 1 else source
        with pytest.raises(
            ConfigError,
            match="'algorithm.kl_coef' was removed: a KL to the reference model is actor.use_kl_loss",
        ):
            load_config(path, ["model.path=/x", *overrides])
    with pytest.raises(ConfigError, match="'logging.jsonl' was removed: metrics.jsonl is always written"):
        load_config(None, ["model.path=/x", "logging.jsonl=false"])
    assert not set(REMOVED_KEYS) & set(all_keys())
