"""Load prompt rows from verl parquet, jsonl or a plain problem/answer layout, validated."""

from __future__ import annotations

import logging

from megatron_dapo.data.readers import read_records
from megatron_dapo.data.templates import apply_template, check_template
from megatron_dapo.data.types import DataError

logger = logging.getLogger(__name__)

DEFAULT_DATA_SOURCE = "math_dapo"
# Tried in order when answer_key is not given: verl's layout first, then plain layouts.
ANSWER_KEYS = ("reward_model.ground_truth", "answer", "ground_truth")


def load_prompt_rows(
    path_or_name: str,
    *,
    format: str = "auto",
    prompt_key: str = "prompt",
    answer_key: str | None = None,
    template: str = "auto",
    skip_bad_rows: bool = False,
    stats: dict | None = None,
) -> list[dict]:
    """Read and validate prompt rows; each becomes a dict with the keys of a normalised row.

    Sources: a ``.parquet`` file (verl's layout: ``data_source``, ``prompt`` as chat messages,
    ``reward_model.ground_truth``, ``extra_info``), a ``.jsonl`` file (or ``.json`` array) with
    the same fields, the same files in a plain layout (a string prompt, e.g. ``problem`` and
    ``answer`` columns), or a Hugging Face dataset name ``owner/name[:split]`` (needs the
    ``datasets`` package and network).

    Args:
        path_or_name: file path or HF dataset name.
        format: ``auto`` (by extension; HF for a non-file), ``parquet``, ``jsonl`` or ``hf``.
        prompt_key: column with the prompt: a list of ``{"role", "content"}`` messages or a
            string. When the default ``prompt`` is absent from a row, ``problem`` is used.
        answer_key: column with the ground truth (dots reach into dicts, e.g.
            ``reward_model.ground_truth``); None tries ``reward_model.ground_truth``,
            ``answer``, ``ground_truth``. Strings and integers are accepted.
        template: applied to the last user message: ``auto`` (the DAPO template unless the
            text already contains its first sentence), ``dapo`` (always), ``none``, or a
            custom string with ``{problem}``.
        skip_bad_rows: skip malformed rows (logged and counted) instead of raising DataError.
        stats: if given, receives ``rows_read``, ``rows_skipped`` and ``skipped`` (the first
            ten reasons).

    Returns:
        dicts with ``index`` (position in the source), ``data_source`` (default
        ``math_dapo`` when the row has none), ``messages``, ``ground_truth`` (str) and
        ``extra_info`` (dict).

    Raises:
        DataError: naming the file, row/line and field of the first bad row (unless skipped),
        the file/dataset that could not be read, or one that holds no rows (or only bad ones).
    """
    check_template(template)
    records, where = read_records(path_or_name, format)
    if not records:
        raise DataError(
            f"{path_or_name}: no rows (the file is empty); give a file with prompts or leave it out"
        )
    rows, skipped = [], []
    for index, (record, loc) in enumerate(zip(records, where)):
        try:
            rows.append(_normalise(record, index, prompt_key, answer_key, template))
        except DataError as e:
            message = f"{path_or_name}, {loc}: {e}"
            if not skip_bad_rows:
                raise DataError(message + " (set data.skip_bad_rows=true to skip such rows)") from None
            skipped.append(message)
    if skipped and not rows:
        raise DataError(f"{path_or_name}: all {len(records)} rows are malformed; first: {skipped[0]}")
    if skipped:
        logger.warning("skipped %d malformed rows of %s; first: %s", len(skipped), path_or_name, skipped[0])
    if stats is not None:
        stats.update(rows_read=len(records), rows_skipped=len(skipped), skipped=skipped[:10])
    return rows


def _normalise(record, index: int, prompt_key: str, answer_key: str | None, template: str) -> dict:
    if isinstance(record, DataError):
        raise record
    if not isinstance(record, dict):
        raise DataError(f"expected an object with fields, got {type(record).__name__}")
    key = prompt_key if prompt_key in record or prompt_key != "prompt" else "problem"
    messages = _messages(record.get(key), key)
    u = _last_user(messages, key)
    messages[u] = {**messages[u], "content": apply_template(messages[u]["content"], template)}
    return {
        "index": index,
        "data_source": _data_source(record),
        "messages": messages,
        "ground_truth": _ground_truth(record, answer_key),
        "extra_info": _extra_info(record),
    }


def _messages(prompt, key: str) -> list[dict]:
    if prompt is None:
        raise DataError(f"field {key!r} is missing (set data.prompt_key to the prompt column)")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise DataError(f"field {key!r} must be a non-empty list of chat messages or a string")
    messages = []
    for i, m in enumerate(prompt):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise DataError(
                f"field {key!r}[{i}] must be a message {{'role': str, 'content': str}}, got {m!r:.80}"
            )
        messages.append({"role": m["role"], "content": m["content"]})
    if not messages[_last_user(messages, key)]["content"].strip():
        raise DataError(f"field {key!r}: the prompt is empty")
    return messages


def _last_user(messages: list[dict], key: str) -> int:
    """Position of the last user message (the one the template applies to)."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "user":
            return i
    raise DataError(f"field {key!r} has no message with role 'user'")


def _ground_truth(record: dict, answer_key: str | None) -> str:
    keys = (answer_key,) if answer_key else ANSWER_KEYS
    for k in keys:
        value = _lookup(record, k)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise DataError(
                f"field {k!r} (ground truth) must be a string or integer, got {type(value).__name__}"
            )
        value = str(value)
        if not value.strip():
            raise DataError(f"field {k!r} (ground truth) is empty")
        return value
    raise DataError(
        f"no ground truth: none of the fields {', '.join(map(repr, keys))} is present (set data.answer_key)"
    )


def _lookup(record: dict, dotted: str):
    value = record
    for part in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _data_source(record: dict) -> str:
    source = record.get("data_source", DEFAULT_DATA_SOURCE)
    if not isinstance(source, str) or not source:
        raise DataError(f"field 'data_source' must be a non-empty string, got {source!r:.80}")
    return source


def _extra_info(record: dict) -> dict:
    extra = record.get("extra_info")
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise DataError(f"field 'extra_info' must be an object, got {type(extra).__name__}")
    return dict(extra)
