"""Models by name: a hub id in model.path resolves to its snapshot in the hub cache (revision
pinnable, HF_HUB_OFFLINE honoured), for the pre-check and for train, which hands the ranks the
directory. Offline here: a hub cache the test fills with the tiny checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hub_cache import fill_hub_cache, offline_env

from megatron_dapo.cli import main
from megatron_dapo.driver.launch import load_for_cli

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "configs" / "demo.yaml")
COMMIT = "a" * 40


@pytest.fixture(scope="module")
def hub(tiny_hf_checkpoint, tmp_path_factory):
    """(environment of an offline process, overrides for the demo recipe's data files)."""
    root = tmp_path_factory.mktemp("hub")
    model = tiny_hf_checkpoint()
    files = {p.name: p for p in model.iterdir() if p.is_file()}
    fill_hub_cache(root / "cache", "acme/tiny-qwen", files, commit=COMMIT)
    data = root / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
    env = {**offline_env(root / "cache"), "PYTHONPATH": str(REPO)}
    return env, [
        f"data.train_files=[{data}]",
        f"data.val_files=[{data}]",
        f"trainer.runs_dir={root / 'runs'}",
    ]


def _run(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def offline(hub, monkeypatch):
    """This process reads only the filled cache (the constants huggingface_hub read from the
    environment at import)."""
    from huggingface_hub import constants

    env, data = hub
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", env["HF_HUB_CACHE"])
    return data


def test_the_pre_check_resolves_a_hub_id_from_the_cache(offline, capsys):
    assert main(["config", DEMO, "model.path=acme/tiny-qwen", *offline]) == 0, capsys.readouterr().err
    assert "path: acme/tiny-qwen" in capsys.readouterr().out  # as written; the checks read the snapshot
    assert main(["config", DEMO, "model.path=acme/tiny-qwen", f"model.revision={COMMIT}", *offline]) == 0
    capsys.readouterr()
    # a revision the cache lacks: one line naming the key
    assert main(["config", DEMO, "model.path=acme/tiny-qwen@" + "b" * 40, *offline]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config error: model.path=acme/tiny-qwen@bbbb" in err


def test_train_hands_the_ranks_the_snapshot_directory(offline):
    cfg = load_for_cli(DEMO, ["model.path=acme/tiny-qwen", *offline])
    path = Path(cfg.model.path)
    assert path.parts[-2:] == ("snapshots", COMMIT) and (path / "config.json").is_file()


def test_hf_hub_offline_from_the_environment_is_honoured(hub):
    # a fresh process: HF_HUB_OFFLINE=1 in its environment, a hub id the cache lacks
    env, data = hub
    r = _run(env, "-m", "megatron_dapo.cli", "config", DEMO, "model.path=acme/absent", *data)
    assert r.returncode == 2
    lines = [
        line
        for line in r.stderr.splitlines()
        if line.strip() and "Warning" not in line and not line.startswith(" ")
    ]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("config error: model.path=acme/absent: not in the hub cache")
    assert "HF_HUB_OFFLINE is set" in lines[0]
