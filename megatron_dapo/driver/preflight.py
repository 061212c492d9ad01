"""Checks of a run's inputs that the driver can make in a second, before any cluster starts.

Each failure is one line naming the key and the file and the fix; without these the same
mistake surfaces minutes later from inside a Ray actor. They only read headers: the weights
themselves are read by the ranks."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from megatron_dapo.config import ConfigError


def check_model_dir(cfg: DictConfig) -> None:
    """model.path holds a supported architecture with readable safetensors (unless the weights
    come from model.megatron_path, which must exist)."""
    from megatron_dapo.arch import SUPPORTED_ARCHITECTURES

    path = Path(cfg.model.path)
    config = path / "config.json"
    if not config.is_file():
        raise ConfigError(
            f"model.path={path}: no config.json there; point model.path at an HF checkpoint directory"
        )
    try:
        hf = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"model.path: {config} is not readable JSON ({e}); point model.path at an HF checkpoint"
        ) from e
    archs = hf.get("architectures") or []
    if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"model.path: {config} names architecture {archs[0] if archs else None!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (convert or pick a model of those families)"
        )
    if cfg.model.megatron_path:
        if not Path(cfg.model.megatron_path).is_dir():
            raise ConfigError(
                f"model.megatron_path={cfg.model.megatron_path} does not exist; give a Megatron checkpoint "
                "directory (megatron-dapo convert hf-to-megatron) or null"
            )
        return
    from megatron_dapo.weights.hf_io import SafetensorsReader

    reader = SafetensorsReader(path)  # raises CheckpointError naming the file
    for file in sorted(set(reader.weight_map.values())):
        reader._open(file)  # the header and the file length must agree (catches truncation)


def check_resume(cfg: DictConfig, checkpoints: Path) -> None:
    """trainer.resume names something usable (sizes only here; the trainer verifies checksums)."""
    from megatron_dapo.actor.checkpoint import find_resume_checkpoint

    find_resume_checkpoint(checkpoints, cfg.trainer.resume, verify_checksums=False, strict=True)


def preflight(cfg: DictConfig, checkpoints: Path) -> None:
    check_model_dir(cfg)
    check_resume(cfg, checkpoints)
