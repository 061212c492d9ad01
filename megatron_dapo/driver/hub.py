"""Models by name: a Hugging Face hub id in ``model.path`` (``model.tokenizer_path``,
``reward.model.path``) becomes the directory of its snapshot in the hub cache.

``huggingface_hub.snapshot_download`` fetches the files a run reads (config, safetensors,
tokenizer; not .bin/.pt duplicates) once into the cache (``HF_HOME`` / ``HF_HUB_CACHE``; put it on
storage every node sees) and answers from it after; ``HF_HUB_OFFLINE=1`` reads only the cache. The
driver resolves before it starts anything and hands the ranks and servers the local directory, so
they never touch the hub. ``model.revision`` pins the policy's commit, tag or branch; any hub id
may also carry one as ``owner/name@revision``.
"""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from megatron_dapo.config import ConfigError

# the files a run reads from a model repository
PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py"]
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
KEYS = ("model.path", "model.tokenizer_path", "reward.model.path")


def is_hub_id(value: str) -> bool:
    """``owner/name[@rev]`` that is not a path on this machine (a local directory always wins)."""
    return bool(HUB_ID.match(value)) and not Path(value).expanduser().exists()


def resolve(key: str, value: str, revision: str | None = None) -> str:
    """The local snapshot directory of hub id ``value`` (named by config ``key`` in errors)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo_id, _, pinned = value.partition("@")
    revision = pinned or revision
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=PATTERNS)
    except LocalEntryNotFoundError as e:
        offline = " and HF_HUB_OFFLINE is set (only the cache is read)" if constants.HF_HUB_OFFLINE else ""
        raise ConfigError(
            f"{key}={value}: not in the hub cache ({constants.HF_HUB_CACHE}){offline}; download it once "
            f"where there is network (`hf download {repo_id}`, with HF_HOME on storage every node sees) "
            "or give a local checkpoint directory"
        ) from e
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ConfigError(f"{key}={value}: the hub did not give it ({' '.join(str(e).split())[:300]})") from e


def resolve_hub_paths(cfg: DictConfig) -> DictConfig:
    """``cfg`` with each hub id of ``KEYS`` replaced by its snapshot directory (a new config)."""
    named = {}
    for key in KEYS:
        value = OmegaConf.select(cfg, key)
        if isinstance(value, str) and is_hub_id(value):
            revision = cfg.model.revision if key == "model.path" else None
            named[key] = resolve(key, value, revision)
    if not named:
        return cfg
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    for key, path in named.items():
        OmegaConf.update(out, key, path)
    return out
