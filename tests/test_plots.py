"""Run directory metrics and plots: resume truncation, torn lines, PNGs from the keys present."""

import json

from megatron_dapo.cli import main
from megatron_dapo.driver.run_dir import MetricsLogger, RunDir, read_metrics


def test_metrics_resume_drops_steps_after_the_checkpoint(tmp_path):
    run = RunDir.create(tmp_path, "r")
    log = MetricsLogger(run)
    for step in range(1, 6):
        log.log(step, {"rollout/acc/mean": step / 10, "actor/grad_norm": float("nan") if step == 5 else 1.0})
    log.close()
    with run.metrics.open("a") as f:
        f.write('{"step": 6, "torn')  # a crash mid-write
    assert [r["step"] for r in read_metrics(run.metrics)] == [1, 2, 3, 4, 5]
    assert read_metrics(run.metrics)[-1]["actor/grad_norm"] == "nan"
    MetricsLogger(run, resume_step=3).log(4, {"rollout/acc/mean": 0.9})
    assert [(r["step"], r["rollout/acc/mean"]) for r in read_metrics(run.metrics)] == [
        (1, 0.1),
        (2, 0.2),
        (3, 0.3),
        (4, 0.9),
    ]


def test_plot_command_writes_pngs(tmp_path, capsys):
    run = RunDir.create(tmp_path, "r")
    lines = [
        {
            "step": s,
            "rollout/acc/mean": 0.1 * s,
            "rollout/reward/mean": 0.2 * s - 1,
            "rollout/response_length/mean": 10 + s,
            "actor/entropy": 1.0 / s,
            "val/avg@4": 0.1 * s,
        }
        for s in range(1, 5)
    ]
    run.metrics.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["plot", str(run.root)]) == 0
    names = {p.name for p in run.plots.iterdir()}
    assert {"reward.png", "response_length.png", "entropy.png", "val.png"} <= names
    assert "clipfrac.png" not in names  # no such metrics in this run
    assert (run.plots / "reward.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["plot", str(tmp_path / "missing")]) == 2
