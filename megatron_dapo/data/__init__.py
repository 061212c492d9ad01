"""Prompt data: loading (verl parquet, jsonl, plain problem/answer, HF names), templates, and a
tokenised dataset with a resumable, seeded cursor."""

from megatron_dapo.data.dataset import PromptDataset
from megatron_dapo.data.loading import load_prompt_rows
from megatron_dapo.data.templates import DAPO_TEMPLATE, apply_template
from megatron_dapo.data.types import DataError, PromptSample

__all__ = [
    "DAPO_TEMPLATE",
    "DataError",
    "PromptDataset",
    "PromptSample",
    "apply_template",
    "load_prompt_rows",
]
