"""Checks of a run's inputs that the driver can make in a second, before any cluster starts.

Each failure is one line naming the key and the file and the fix; without these the same
mistake surfaces minutes later from inside a Ray actor. They only read headers: the weights
themselves are read by the ranks."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from megatron_dapo.actor.checkpoint import find_resume_checkpoint
from megatron_dapo.arch import SUPPORTED_ARCHITECTURES
from megatron_dapo.config import ConfigError
from megatron_dapo.weights.dist_ckpt import is_dist_checkpoint
from megatron_dapo.weights.hf_io import SafetensorsReader

# Any one of these makes a tokenizer transformers can load (fast tokenizer, SentencePiece, BPE
# vocabulary + merges, WordPiece vocabulary).
TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"), ("vocab.txt",))


def check_model_dir(cfg: DictConfig) -> None:
    """model.path holds a supported architecture whose context fits the run's lengths, readable
    safetensors (unless the weights come from model.megatron_path, which must be a Megatron
    checkpoint) and tokenizer files (unless model.tokenizer_path names another directory)."""
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
    check_context(cfg, hf, config)
    if cfg.model.megatron_path:
        if not Path(cfg.model.megatron_path).is_dir():
            raise ConfigError(
                f"model.megatron_path={cfg.model.megatron_path} does not exist; give a Megatron checkpoint "
                "directory (megatron-dapo convert hf-to-megatron) or null"
            )
        if not is_dist_checkpoint(cfg.model.megatron_path):
            raise ConfigError(
                f"model.megatron_path={cfg.model.megatron_path} is not a Megatron distributed checkpoint (no "
                "metadata.json); give the directory megatron-dapo convert hf-to-megatron wrote, or null"
            )
    else:
        reader = SafetensorsReader(path)  # raises CheckpointError naming the file
        for file in sorted(set(reader.weight_map.values())):
            reader._open(file)  # the header and the file length must agree (catches truncation)
    check_tokenizer_files(cfg)


def check_context(cfg: DictConfig, hf: dict, config: Path) -> None:
    """The longest sequence the run makes (a prompt and its response, training and validation)
    fits the model's context (config.json's max_position_embeddings)."""
    context = hf.get("max_position_embeddings")
    if not isinstance(context, int):
        return
    data = cfg.data
    budgets = [("data.max_response_length", data.max_response_length)]
    if cfg.rollout.val.max_response_length is not None:
        budgets.append(("rollout.val.max_response_length", cfg.rollout.val.max_response_length))
    for key, response in budgets:
        total = data.max_prompt_length + response
        if total > context:
            raise ConfigError(
                f"data.max_prompt_length + {key} = {data.max_prompt_length} + {response} = {total} tokens "
                f"exceed the model's context, max_position_embeddings={context} in {config}; lower {key} "
                "or data.max_prompt_length"
            )


def check_tokenizer_files(cfg: DictConfig) -> None:
    """The tokenizer directory (model.tokenizer_path, else model.path) has tokenizer files."""
    key = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path"
    path = Path(cfg.model.tokenizer_path or cfg.model.path)
    if not path.is_dir():
        raise ConfigError(f"{key}={path} is not a directory; point it at the model's tokenizer files")
    if not any(all((path / name).is_file() for name in group) for group in TOKENIZER_FILES):
        wanted = ", ".join(" + ".join(group) for group in TOKENIZER_FILES)
        raise ConfigError(
            f"{key}={path} has no tokenizer files (one of: {wanted}); copy them from the base model "
            "or set model.tokenizer_path to a directory that has them"
        )


def check_resume(cfg: DictConfig, checkpoints: Path) -> None:
    """trainer.resume names something usable (sizes only here; the trainer verifies checksums)."""
    find_resume_checkpoint(checkpoints, cfg.trainer.resume, verify_checksums=False, strict=True)


def preflight(cfg: DictConfig, checkpoints: Path) -> None:
    check_model_dir(cfg)
    check_resume(cfg, checkpoints)
