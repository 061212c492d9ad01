"""Config -> tokenizer, training prompt dataset, validation problems and reward scorer."""

from __future__ import annotations

from omegaconf import DictConfig

from megatron_dapo.config import ConfigError
from megatron_dapo.data.dataset import PromptDataset
from megatron_dapo.data.loading import load_prompt_rows
from megatron_dapo.data.types import DataError
from megatron_dapo.eval.runner import EvalProblem
from megatron_dapo.hf_tokenizer import load_tokenizer as load_tokenizer_at
from megatron_dapo.rewards.scorer import RewardWorkerError, Scorer


def load_tokenizer(cfg: DictConfig):
    path = cfg.model.tokenizer_path or cfg.model.path
    try:
        return load_tokenizer_at(path)
    except OSError as e:
        raise ConfigError(
            f"model.tokenizer_path / model.path: no tokenizer at {path} ({e}); point it at an HF "
            "checkpoint directory that has tokenizer files"
        ) from e


def _rows(files, cfg: DictConfig, what: str) -> tuple[list[dict], dict]:
    if not files:
        raise ConfigError(f"data.{what}_files is empty; give at least one parquet/jsonl file")
    rows: list[dict] = []
    stats: dict = {}
    for f in files:
        try:
            part = load_prompt_rows(
                f,
                format=cfg.data.format,
                prompt_key=cfg.data.prompt_key,
                answer_key=cfg.data.answer_key,
                template=cfg.data.template,
                skip_bad_rows=cfg.data.skip_bad_rows,
                stats=stats,
            )
        except DataError as e:
            raise DataError(f"data.{what}_files: {e}") from None
        # keep row indices unique across files so dumps and logs identify prompts
        offset = len(rows)
        rows.extend({**r, "index": r["index"] + offset} for r in part)
    return rows, stats


def train_dataset(cfg: DictConfig, tokenizer, tools: list[dict] | None = None) -> PromptDataset:
    """The training prompts; ``tools``: the tool schemas their chat template renders (multi-turn)."""
    rows, _ = _rows(cfg.data.train_files, cfg, "train")
    return _dataset(rows, tokenizer, cfg, "train", seed=cfg.data.seed, shuffle=cfg.data.shuffle, tools=tools)


def _dataset(
    rows: list[dict],
    tokenizer,
    cfg: DictConfig,
    what: str,
    seed: int,
    shuffle: bool,
    tools: list[dict] | None = None,
) -> PromptDataset:
    try:
        return PromptDataset(
            rows,
            tokenizer,
            max_prompt_length=cfg.data.max_prompt_length,
            apply_chat_template=cfg.data.apply_chat_template,
            seed=seed,
            shuffle=shuffle,
            tools=tools,
        )
    except DataError as e:
        # every row was read: what is left is about the prompts of these files
        files = ", ".join(map(str, cfg.data[f"{what}_files"]))
        raise DataError(f"data.{what}_files ({files}): {e}") from None


def val_problems(cfg: DictConfig, tokenizer, tools: list[dict] | None = None) -> list[EvalProblem]:
    if not cfg.data.val_files:
        return []
    rows, _ = _rows(cfg.data.val_files, cfg, "val")
    ds = _dataset(rows, tokenizer, cfg, "val", seed=0, shuffle=False, tools=tools)
    problems = [
        EvalProblem(
            problem_id=str(s.index),
            prompt_text=s.prompt_text,
            prompt_ids=s.prompt_ids,
            data_source=s.data_source,
            ground_truth=s.ground_truth,
            extra_info=s.extra_info,
            messages=list(s.messages),  # what a served reward model reads
        )
        for s in ds.samples
    ]
    if cfg.data.val_max_samples:
        problems = problems[: cfg.data.val_max_samples]
    return problems


def make_scorer(cfg: DictConfig) -> Scorer:
    try:
        return Scorer(
            custom_fn=cfg.reward.custom_fn,
            timeout_s=cfg.reward.timeout_s,
            boxed_fallback=cfg.reward.boxed_fallback,
        )
    except RewardWorkerError as e:
        if not cfg.reward.custom_fn:
            raise
        # the worker only fails to start on the user's reward file
        raise ConfigError(f"reward.custom_fn={cfg.reward.custom_fn}: {e}") from e
