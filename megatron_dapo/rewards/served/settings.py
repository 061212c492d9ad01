"""``reward.model`` and ``reward.combine`` as the reward-model clients take them, and the servers a
run starts for ``reward.model.path``.

The rewards package does not import the config package: :func:`settings_from_config` reads the
``reward`` section it is handed (a DictConfig or the schema's dataclass) by attribute.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("classifier", "judge")
BUILTIN_PARSERS = ("yes_no", "boxed_score")


@dataclass(frozen=True)
class ServedRewardSettings:
    """One reward model, served by the run (``path``) or already running (``url``).

    Attributes mirror ``reward.model`` (config/schema.py says what each means); ``combine`` is
    ``reward.combine``. ``prompt_template`` None is the judge's built-in template.
    """

    kind: str
    path: str | None = None
    url: str | None = None
    num_servers: int = 1
    gpus_per_server: int = 1
    placement: str = "own"
    mem_fraction_static: float = 0.15
    timeout_s: float = 60.0
    max_retries: int = 2
    max_in_flight: int = 32
    down_grace_s: float = 300.0
    max_restarts: int = 3
    step_timeout_s: float | None = None
    transform: str | None = None
    prompt_template: str | None = None
    parser: str = "yes_no"
    temperature: float = 0.0
    max_new_tokens: int = 1024
    probe_tolerance: float | None = None
    too_long: str = "cut"
    combine: str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"reward.model.kind={self.kind!r} must be one of {KINDS}")
        if (self.path is None) == (self.url is None):
            raise ValueError(
                "reward.model needs exactly one of path (a checkpoint to serve) and url (a running server)"
            )


def settings_from_config(reward) -> ServedRewardSettings | None:
    """The ``reward`` config section's model settings; None when ``reward.model.kind`` is null."""
    model = reward.model
    if model.kind is None:
        return None
    return ServedRewardSettings(
        kind=str(model.kind),
        path=None if model.path is None else str(model.path),
        url=None if model.url is None else str(model.url),
        num_servers=int(model.num_servers),
        gpus_per_server=int(model.gpus_per_server),
        placement=str(model.placement),
        mem_fraction_static=float(model.mem_fraction_static),
        timeout_s=float(model.timeout_s),
        max_retries=int(model.max_retries),
        max_in_flight=int(model.max_in_flight),
        down_grace_s=float(model.down_grace_s),
        max_restarts=int(model.max_restarts),
        step_timeout_s=None if model.step_timeout_s is None else float(model.step_timeout_s),
        transform=None if model.transform is None else str(model.transform),
        prompt_template=None if model.prompt_template is None else str(model.prompt_template),
        parser=str(model.parser),
        temperature=float(model.temperature),
        max_new_tokens=int(model.max_new_tokens),
        probe_tolerance=None if model.probe_tolerance is None else float(model.probe_tolerance),
        too_long=str(model.too_long),
        combine=None if reward.combine is None else str(reward.combine),
    )


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
