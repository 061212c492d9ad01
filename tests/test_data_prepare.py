"""`megatron-dapo data prepare NAME --out DIR` writes the verl parquet files the recipes name, from
a local copy or from the hub cache (offline here: a cache filled by the test), with row counts and
checksums checked. The copies in ../shared/data are the inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from built import SHARED_DATA, missing
from hub_cache import fill_hub_cache, offline_env

from megatron_dapo.data.loading import load_prompt_rows
from megatron_dapo.data.prepare import prepare
from megatron_dapo.data.templates import DAPO_TEMPLATE
from megatron_dapo.data.types import DataError

REPO = Path(__file__).resolve().parents[1]
SVS = SHARED_DATA / "dapo_math_17k.SvS.parquet"
AIME = SHARED_DATA / "aime-2024.parquet"


@pytest.fixture(autouse=True)
def _shared_data():
    if not (SVS.is_file() and AIME.is_file()):
        missing(f"the shared data sets ({SHARED_DATA}: aime-2024.parquet, dapo_math_17k.SvS.parquet)")


def test_dapo_math_17k_from_the_deduplicated_copy(tmp_path):
    done = prepare("dapo-math-17k", tmp_path / "data", source=SVS)
    out = tmp_path / "data" / "dapo-math-17k.parquet"
    assert done.path == out and done.rows == 17917 and not done.reused
    source = pq.read_table(SVS).to_pylist()
    rows = pq.read_table(out).to_pylist()
    assert len(rows) == len(source) == 17917
    for i in (0, 5000, 17916):  # bare problems get the DAPO template, the answers stay
        problem = source[i]["prompt"][0]["content"]
        assert rows[i]["prompt"] == [{"role": "user", "content": DAPO_TEMPLATE.replace("{problem}", problem)}]
        assert rows[i]["reward_model"]["ground_truth"] == source[i]["reward_model"]["ground_truth"]
        assert rows[i]["data_source"] == "math_dapo"
    # the trainer's loader reads it with the template applied once, the rule reward by math_dapo
    loaded = load_prompt_rows(str(out))
    assert len(loaded) == 17917 and loaded[0]["messages"][-1]["content"].count("Solve the following") == 1
    manifest = json.loads((tmp_path / "data" / "dapo-math-17k.parquet.json").read_text())
    assert manifest["rows"] == 17917 and manifest["sha256"] == done.sha256
    assert manifest["source_sha256"] == "246ae23df97c9eae8126cb4da780e9a0a31d10110e16eed144bcecbf2132d535"
    # a rerun finds it made and checked; a changed file is made again
    assert prepare("dapo-math-17k", tmp_path / "data", source=SVS).reused
    out.write_bytes(out.read_bytes()[:-10])
    assert not prepare("dapo-math-17k", tmp_path / "data", source=SVS).reused


def test_a_known_copy_with_rows_missing_is_refused(tmp_path):
    # the recorded checksum matches but the row count does not: refused (here by a stand-in
    # record of the copy with one row more than it has)
    from megatron_dapo.data import prepare as module

    spec = module.DATASETS["aime-2024"]
    known = dict(spec.known)
    digest = next(iter(known))
    known[digest] = module.KnownCopy(961, "a stand-in record")
    patched = module.DatasetSpec(spec.file_name, spec.hub_repo, spec.hub_file, known)
    module.DATASETS["aime-2024"] = patched
    try:
        with pytest.raises(DataError, match="960 rows, 961 expected for a stand-in record"):
            prepare("aime-2024", tmp_path, source=AIME)
    finally:
        module.DATASETS["aime-2024"] = spec


def _cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_dapo.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_aime_2024_from_the_hub_cache_offline(tmp_path):
    cache = tmp_path / "hub"
    fill_hub_cache(
        cache, "BytedTsinghua-SIA/AIME-2024", {"data/aime-2024.parquet": AIME}, repo_type="dataset"
    )
    env = {**offline_env(cache), "PYTHONPATH": str(REPO)}
    r = _cli("data", "prepare", "aime-2024", "--out", str(tmp_path / "data"), env=env)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "data" / "aime-2024.parquet"
    assert f"wrote {out}: 960 rows" in r.stdout
    source, rows = pq.read_table(AIME).to_pylist(), pq.read_table(out).to_pylist()
    assert [r["prompt"] for r in rows] == [s["prompt"] for s in source]  # already templated: as it was
    assert [r["reward_model"]["ground_truth"] for r in rows] == [
        s["reward_model"]["ground_truth"] for s in source
    ]
    # not in the cache, offline: one line saying so
    r = _cli("data", "prepare", "dapo-math-17k", "--out", str(tmp_path / "data"), env=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "BytedTsinghua-SIA/DAPO-Math-17k/data/dapo-math-17k.parquet is not in the hub cache" in r.stderr
    assert "HF_HUB_OFFLINE is set" in r.stderr


def test_a_torn_hub_download_is_refused(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    fill_hub_cache(cache, "BytedTsinghua-SIA/AIME-2024", {"data/aime-2024.parquet": AIME}, repo_type="dataset",
                   blob_name="0" * 64)  # fmt: skip
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    with pytest.raises(DataError, match="differs from the hub's 0{64} \\(a torn download\\)"):
        prepare("aime-2024", tmp_path / "data")
    assert not (tmp_path / "data" / "aime-2024.parquet").exists()
