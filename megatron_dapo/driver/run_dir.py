"""The run directory `runs/NAME/` and the metrics sinks that write into it.

Layout: config.yaml (resolved), metrics.jsonl (one line per step, verl-style namespaced keys),
checkpoints/, hf/ (exports), rollouts/ (optional sample dumps), plots/, tensorboard/, wandb/ and
wandb_id (the W&B run id, reused on resume).
"""

from __future__ import annotations

import json
import logging
import math
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

WANDB_ID = "wandb_id"


@dataclass(frozen=True)
class RunDir:
    root: Path

    @classmethod
    def create(cls, runs_dir: str | Path, name: str) -> RunDir:
        root = Path(runs_dir) / name
        for sub in ("checkpoints", "hf", "rollouts", "plots"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        return cls(root)

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def hf(self) -> Path:
        return self.root / "hf"

    @property
    def rollouts(self) -> Path:
        return self.root / "rollouts"

    @property
    def plots(self) -> Path:
        return self.root / "plots"


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible rather than dropping the key
    return value


def jsonable_record(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metric values as JSON can hold them (tensors and numpy scalars to numbers)."""
    return {k: _jsonable(v) for k, v in metrics.items()}


def _free_name(path: Path) -> Path:
    """metrics.jsonl -> metrics.1.jsonl (or the first number not taken)."""
    n = 1
    while (aside := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    return aside


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All step records of a metrics.jsonl; lines that are not JSON records (a torn last line
    after a crash, a corrupt one) are left out: see `read_metrics_report` for which."""
    return read_metrics_report(path)[0]


def read_metrics_report(path: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """(records, why each skipped line was skipped, as "line N: reason")."""
    path = Path(path)
    if not path.is_file():
        return [], []
    records, skipped = [], []
    for lineno, line in enumerate(path.read_bytes().decode("utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            skipped.append(f"line {lineno}: not JSON ({e.msg})")
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            skipped.append(f"line {lineno}: not a step record (no integer 'step')")
            continue
        records.append(record)
    return records, skipped


def wandb_run_id(run: RunDir, resumed: bool) -> str:
    """The W&B run id of this training run, kept in ``RUN_DIR/wandb_id``: a resume (after a
    SIGTERM, a requeue, a crash) logs to the run it continues; a fresh start, whose metrics history
    starts over, gets a new one."""
    path = run.root / WANDB_ID
    if resumed and path.is_file():
        kept = path.read_text().strip()
        if kept:
            return kept
    new = secrets.token_hex(4)  # W&B ids: short, [a-z0-9]
    path.write_text(new + "\n")
    return new


class MetricsLogger:
    """Writes each step's metrics to metrics.jsonl, and to wandb / TensorBoard when enabled.

    On resume from a checkpoint at step k, records after k (written by the killed run after its
    last checkpoint) are dropped so the file continues exactly as an uninterrupted run's would.
    """

    def __init__(
        self,
        run: RunDir,
        *,
        resume_step: int | None = None,
        wandb_cfg: dict | None = None,
        tensorboard: bool = False,
        config: dict | None = None,
    ):
        self.path = run.metrics
        self._steps: set[int] = set()
        if resume_step is not None:
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
            self._steps = {r["step"] for r in kept}
        elif self.path.exists() and self.path.stat().st_size:
            # a fresh start in a used run directory keeps the earlier history beside the new one
            aside = _free_name(self.path)
            self.path.rename(aside)
            log.warning("starting over: the previous %s is kept as %s", self.path.name, aside.name)
        self._tb = self._tensorboard(run) if tensorboard else None
        self._wandb = None
        if wandb_cfg and wandb_cfg.get("enable"):
            import wandb

            run_id = wandb_run_id(run, resumed=resume_step is not None)
            self._wandb = wandb.init(
                project=wandb_cfg.get("project", "megatron-dapo"),
                entity=wandb_cfg.get("entity"),
                group=wandb_cfg.get("group"),
                tags=list(wandb_cfg.get("tags") or []) or None,
                name=wandb_cfg.get("name"),
                id=run_id,
                dir=str(run.root),
                mode=wandb_cfg.get("mode", "offline"),
                config=config,
                resume="allow",
            )

    @staticmethod
    def _tensorboard(run: RunDir):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.warning(
                "logging.tensorboard=true but the tensorboard package is not installed: metrics go to "
                "metrics.jsonl (and W&B when on) only; pip install tensorboard, or set logging.tensorboard=false"
            )
            return None
        return SummaryWriter(str(run.root / "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **jsonable_record(metrics)}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        self._steps.add(step)
        numeric = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def has_step(self, step: int) -> bool:
        return step in self._steps

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
