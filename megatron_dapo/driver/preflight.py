"""Checks of a run's inputs that the driver can make in a second, before any cluster starts.

Each failure is one line naming the key and the file and the fix; without these the same
mistake surfaces minutes later from inside a Ray actor. They only read headers: the weights
themselves are read by the ranks. `megatron-dapo config` runs the same :func:`preflight` that
`train` runs, so a launch script's pre-check on the login or batch node catches everything `train`
would, before an allocation's Ray cluster starts."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from omegaconf import DictConfig

from megatron_dapo.actor.checkpoint import find_resume_checkpoint
from megatron_dapo.agent.from_config import call_format, tool_specs
from megatron_dapo.agent.tools.boundary import require_boundaries
from megatron_dapo.arch import SUPPORTED_ARCHITECTURES
from megatron_dapo.config import ConfigError
from megatron_dapo.data.prepare import DATASETS
from megatron_dapo.data.readers import resolve_format
from megatron_dapo.data.types import DataError
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


def check_custom_reward(cfg: DictConfig) -> None:
    """reward.custom_fn's file exists, parses, and defines the function at its top level. The file is
    read, not imported: its code runs only in the reward worker, as in training."""
    spec = cfg.reward.custom_fn
    if not spec:
        return
    where, sep, name = str(spec).rpartition(":")
    if not sep or not where or not name:
        raise ConfigError(f"reward.custom_fn={spec}: write it as path/to/file.py:function")
    path = Path(where).expanduser()
    if not path.is_file():
        raise ConfigError(f"reward.custom_fn={spec}: no file {path}; give the path of your reward's .py file")
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError) as e:
        raise ConfigError(f"reward.custom_fn={spec}: {path} is not valid Python ({e})") from e
    defined = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((a.asname or a.name).split(".")[0] for a in node.names)
    if name not in defined:
        found = ", ".join(sorted(n for n in defined if not n.startswith("_"))) or "none"
        raise ConfigError(f"reward.custom_fn={spec}: {path} defines no {name!r} (top-level names: {found})")


def check_data_files(cfg: DictConfig) -> None:
    """Every data file the run reads is there and (parquet) has a readable footer; HF dataset names
    are left to the loader. A missing file names `megatron-dapo data prepare` when it can make it."""
    import pyarrow.parquet as pq

    for key in ("train_files", "val_files"):
        for item in cfg.data[key] or []:
            try:
                fmt = resolve_format(str(item), cfg.data.format)
            except DataError as e:
                raise ConfigError(f"data.{key}: {e}") from None
            if fmt == "hf":
                continue
            path = Path(str(item)).expanduser()
            if not path.is_file():
                raise ConfigError(
                    f"data.{key}: {item}: no such file (relative to {Path.cwd()}); {_make_hint(path)}"
                )
            if fmt == "parquet":
                try:
                    pq.read_schema(path)
                except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
                    raise ConfigError(f"data.{key}: {item}: not a readable parquet file ({e})") from e


def _make_hint(path: Path) -> str:
    for name, spec in DATASETS.items():
        if path.name == spec.file_name:
            return f"make it with `megatron-dapo data prepare {name} --out {path.parent}`"
    return "give the path of a parquet/jsonl file (see docs/config.md, data.train_files)"


def check_tools(cfg: DictConfig) -> None:
    """With rollout.multi_turn on, its tool YAML is there and describes valid tools, this machine
    can make the sandbox its model-written code needs (fail closed, before Ray), and its call
    format is registered (a MODULE:NAME or file.py:NAME format is imported, as the driver does)."""
    require_boundaries(tool_specs(cfg))
    if cfg.rollout.multi_turn.enable:
        call_format(cfg.rollout.multi_turn.format)


def check_reward_model(cfg: DictConfig) -> None:
    """reward.model.path (a served reward model the run starts) has a config.json."""
    path = cfg.reward.model.path
    if path and not (Path(path) / "config.json").is_file():
        raise ConfigError(
            f"reward.model.path={path}: no config.json there; point it at an HF checkpoint directory "
            "(or a hub id, resolved into the hub cache)"
        )


def preflight(cfg: DictConfig, checkpoints: Path) -> None:
    """Every check of the run's inputs `train` makes before it creates the run directory or Ray."""
    check_model_dir(cfg)
    check_reward_model(cfg)
    check_custom_reward(cfg)
    check_tools(cfg)
    check_data_files(cfg)
    check_resume(cfg, checkpoints)
