"""``reward.model`` and ``reward.combine`` as the reward-model clients take them, and the servers a
run starts for ``reward.model.path``.

The rewards package does not import the config package: :func:`settings_from_config` keeps the
``reward.model`` section it is handed (a DictConfig or the schema's dataclass) and reads every
knob from it by attribute, so no knob is copied here field by field.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

KINDS = ("classifier", "judge")
BUILTIN_PARSERS = ("yes_no", "boxed_score")


@dataclass(frozen=True)
class ServedRewardSettings:
    """One reward model, served by the run (``path``) or already running (``url``), as the clients
    and servers take it: the ``reward.model`` section itself (the schema's ``RewardModelConfig``,
    or the loaded config's node), so every knob has one source, ``config/schema.py``, which says
    what each means; they read as attributes (``settings.timeout_s``). ``combine`` is
    ``reward.combine``.
    """

    model: Any
    combine: str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"reward.model.kind={self.kind!r} must be one of {KINDS}")
        if (self.path is None) == (self.url is None):
            raise ValueError(
                "reward.model needs exactly one of path (a checkpoint to serve) and url (a running server)"
            )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("model", "combine"):  # not a knob (copying, pickling)
            raise AttributeError(name)
        return getattr(self.model, name)

    def replace(self, **knobs: Any) -> ServedRewardSettings:
        """These settings with some ``reward.model`` knobs changed (the section is copied)."""
        model = copy.deepcopy(self.model)
        if hasattr(model, "_set_flag"):  # a loaded config's node is read-only; this copy is ours
            model._set_flag("readonly", False)
        for key, value in knobs.items():
            setattr(model, key, value)
        return ServedRewardSettings(model, self.combine)


def settings_from_config(reward) -> ServedRewardSettings | None:
    """The ``reward`` config section's model settings; None when ``reward.model.kind`` is null."""
    if reward.model.kind is None:
        return None
    return ServedRewardSettings(reward.model, None if reward.combine is None else str(reward.combine))


@dataclass(frozen=True)
class RewardServerSpec:
    """One reward server the run starts: what to serve and the SGLang flags it needs beyond the
    rollout servers' (the caller adds host, port, GPUs and the CPU flags).

    Attributes:
        index: 0-based, among the reward servers.
        model_path: the directory to serve (a classifier's served copy, see ``checkpoint.py``).
        tp_size: GPUs of this server (``reward.model.gpus_per_server``).
        extra_args: ``--is-embedding`` for a classifier (``/classify`` needs it).
    """

    index: int
    model_path: str
    tp_size: int
    extra_args: tuple[str, ...]


def server_specs(settings: ServedRewardSettings, model_path: str | None = None) -> list[RewardServerSpec]:
    """The ``reward.model.num_servers`` servers to start for ``reward.model.path``; none for a
    ``url``. ``model_path``: what to serve instead of ``path`` (a classifier's served copy)."""
    if settings.path is None:
        return []
    served = str(model_path or settings.path)
    extra = ("--is-embedding",) if settings.kind == "classifier" else ()
    return [RewardServerSpec(i, served, settings.gpus_per_server, extra) for i in range(settings.num_servers)]
