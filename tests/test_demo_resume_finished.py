"""`megatron-dapo demo trainer.resume=auto` after the run had finished trains no step: the demo
reports the accuracy the run's history holds (before: "demo failed: no held-out accuracy after
training", exit 1). The trainer is a stand-in returning what a resumed, finished run returns."""

from __future__ import annotations

import json
from types import SimpleNamespace

from megatron_dapo.cli import main
from megatron_dapo.commands import demo


def test_demo_resumed_after_its_run_finished_reports_the_runs_accuracy(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "runs" / "demo_dapo"
    run_dir.mkdir(parents=True)
    history = [
        {"step": 0, "val/avg@4": 0.414, "val/num_problems": 200},
        {"step": 40, "val/avg@4": 0.989, "val/num_problems": 200, "timing/gen": 1.0},
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    assets = SimpleNamespace(hf_dir=tmp_path / "hf", train_file=tmp_path / "t.parquet",
                             val_file=tmp_path / "v.parquet", reused=True)  # fmt: skip
    monkeypatch.setattr(
        demo, "_prepare", lambda args, console: (assets, demo.demo_config_path(), [], "demo_dapo")
    )
    env = SimpleNamespace(summary=lambda: "stand-in", lock_mismatches=[], write=lambda path: None)
    monkeypatch.setattr(demo.environment, "collect", lambda: env)
    # what DAPOTrainer.fit returns when it resumes at step 40 of 40: no val_before, no last
    finished = {"resumed_from": 40, "step": 40, "run_dir": str(run_dir), "plots": []}
    monkeypatch.setattr(demo, "run_train", lambda cfg: finished)
    code = main(["demo", f"trainer.runs_dir={tmp_path / 'runs'}", "trainer.resume=auto"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 0, err
    assert "41.4% -> 98.9% (+57.5 points) in 40 DAPO steps" in err
    assert "demo failed" not in err
