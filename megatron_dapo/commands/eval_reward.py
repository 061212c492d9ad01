"""`megatron-dapo eval` with a served reward model: the ``reward`` section (from ``--run`` and
``reward.*=...`` overrides), and the reward servers eval starts itself for ``reward.model.path``.

Order of work, so that a mistake costs seconds and the GPUs are never shared: everything that
can be checked without a server (the section, the checkpoint's architecture, the served copy,
the tokenizer, ``reward.combine``, a ``reward.model.url``'s reachability) before the policy
samples; the reward servers after the policy's generation has ended (its server stopped), so each
gets GPUs of its own: server i on GPUs ``i*gpus_per_server ...`` of this machine, or this CPU.
They start, are probed and stop through the same code as training's
(``sglang/reward_servers.py`` ``RewardServers``).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

import httpx
from omegaconf import OmegaConf

from megatron_dapo.config import ConfigError
from megatron_dapo.config.loader import merge_overrides
from megatron_dapo.config.schema import DAPOConfig
from megatron_dapo.config.validate import CHOICES, POSITIVE_INTS, check_reward
from megatron_dapo.eval.served import ServedScorer
from megatron_dapo.rewards.registry import load_custom_fn
from megatron_dapo.rewards.served import (
    BlockingRewardModel,
    RewardModelError,
    ServedRewardSettings,
    prepare_served_checkpoint,
    settings_from_config,
)
from megatron_dapo.rewards.served.checkpoint import architecture
from megatron_dapo.rewards.served.classifier import load_tokenizer
from megatron_dapo.rewards.served.judge import load_parser
from megatron_dapo.sglang.reward_servers import RewardServers


class RewardInputError(ValueError):
    """A reward-model setting eval cannot use; printed by eval as one line, exit status 2."""


def reward_overrides(items: list[str]) -> list[str]:
    """The ``reward.*=value`` overrides; any other key is refused, naming eval's flag for it."""
    for item in items:
        key = item.split("=", 1)[0]
        if "=" not in item or not key.startswith("reward."):
            raise RewardInputError(
                f"{item!r}: eval takes key=value overrides of the reward section only (e.g. "
                "reward.model.kind=judge reward.model.url=http://host:30000); the prompt settings have "
                "flags (--template, --max-tokens, ...) and the rest comes from --run"
            )
    return items


def reward_section(run_cfg, overrides: list[str]):
    """The ``reward`` section: the run's (already loaded with ``overrides``), else the schema's
    defaults with ``overrides``, checked as training checks it."""
    if run_cfg is not None:
        return run_cfg.reward
    try:
        cfg = merge_overrides(OmegaConf.structured(DAPOConfig), overrides)
        _check_reward_values(cfg)
        check_reward(cfg)
    except ConfigError as e:
        raise RewardInputError(str(e)) from e
    return cfg.reward


def _check_reward_values(cfg) -> None:
    """The reward keys' share of ``validate``'s table checks (its other checks need a whole run)."""
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if key.startswith("reward.") and value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, allowed))}")
    for key in POSITIVE_INTS:
        value = OmegaConf.select(cfg, key)
        if key.startswith("reward.") and value < 1:
            raise ConfigError(f"{key}={value} must be >= 1")


def _reachable(url: str) -> None:
    """Any HTTP answer will do (a judge server may list no models); no answer stops eval here,
    before the policy samples for minutes."""
    try:
        httpx.get(f"{url.rstrip('/')}/v1/models", timeout=10.0)
    except httpx.HTTPError as e:
        raise RewardInputError(
            f"reward.model.url={url} does not answer ({type(e).__name__}: {e}); start the reward server, "
            "or fix reward.model.url"
        ) from e


class EvalRewardModel:
    """The reward model of one evaluation: the model at ``reward.model.url``, or servers this
    process starts for ``reward.model.path`` (and stops in :meth:`close`).

    Args:
        settings: the ``reward`` section's model settings.
        run_cfg: the run's config (its ``rollout.sglang`` python and start-up timeout), or None.
        context_tokens: the longest request a judge or classifier gets (prompt + response, the
            judge's template and verdict), which sizes a CPU server's KV pool.
        check_tolerance: the classifier start-up check's tolerance; None: ``reward.model.probe_tolerance``,
            else by the server's precision (``rewards.served.startup_check.probe_tolerance``).
    """

    def __init__(
        self,
        settings: ServedRewardSettings,
        run_cfg=None,
        context_tokens: int = 32768,
        check_tolerance: float | None = None,
    ):
        self.settings = settings
        self.run_cfg = run_cfg
        self.context_tokens = int(context_tokens)
        self.check_tolerance = check_tolerance
        self.workdir = Path(tempfile.mkdtemp(prefix="megatron-dapo-eval-reward-"))
        self.servers: RewardServers | None = None
        self.model: BlockingRewardModel | None = None
        self.served_path: str | None = None
        try:
            self._prepare()
        except BaseException:
            self.close()
            raise

    def _prepare(self) -> None:
        s = self.settings
        # the user's functions load now: a typo must not wait for the policy's sampling
        for key, spec, load in (
            ("reward.model.parser", s.parser if s.kind == "judge" else None, load_parser),
            ("reward.model.transform", s.transform, load_custom_fn),
        ):
            if spec is not None:
                try:
                    load(spec)
                except (OSError, ValueError, AttributeError, ImportError, SyntaxError, RewardModelError) as e:
                    raise RewardInputError(f"{key}={spec}: {e}") from e
        if s.url is not None:
            _reachable(s.url)
            # a classifier asks the server for its tokenizer: opened now, not after sampling
            self.model = BlockingRewardModel(s)
            return
        if not Path(s.path).is_dir():
            raise RewardInputError(
                f"reward.model.path={s.path} is not a directory; point it at the reward model's HF checkpoint"
            )
        import torch

        gpus = torch.cuda.device_count()
        if gpus and s.num_servers * s.gpus_per_server > gpus:
            raise RewardInputError(
                f"reward.model.num_servers={s.num_servers} x gpus_per_server={s.gpus_per_server} GPUs, and this "
                f"machine has {gpus}; lower them for eval (e.g. reward.model.num_servers=1)"
            )
        # the architecture first: a checkpoint that is no classifier is the likelier mistake
        if s.kind == "classifier":
            # where the launch looks for it (and reuses it)
            self.served_path = str(
                prepare_served_checkpoint(s.path, self.workdir / "reward_model_served").path
            )
        else:
            architecture(s.path)  # a readable config.json, or one line
        tokenizer = load_tokenizer(s.path, f"reward.model.path={s.path}")
        if not getattr(tokenizer, "chat_template", None):
            raise RewardInputError(
                f"reward.model.path={s.path}: its tokenizer has no chat template; a {s.kind} reads prompt and "
                "response as its chat template renders them (add chat_template to tokenizer_config.json)"
            )

    def open(self) -> BlockingRewardModel:
        """The reward model, its servers started (``reward.model.path``) on first use."""
        if self.model is None:
            urls = self._start_servers()
            self.model = BlockingRewardModel(self.settings, urls)
        return self.model

    def _start_servers(self) -> list[str]:
        """The servers, through the one launch path training uses (``sglang/reward_servers.py``):
        alone on this machine (the policy's server has stopped), probed at the tolerance of
        their precision or ``--reward-check-tolerance``."""
        settings = self.settings
        if self.check_tolerance is not None:
            settings = settings.replace(probe_tolerance=float(self.check_tolerance))
        cfg = self.run_cfg if self.run_cfg is not None else OmegaConf.structured(DAPOConfig)
        self.servers = RewardServers.launch(
            cfg, settings, self.workdir, alone=True, max_total_tokens=self.context_tokens
        )
        return self.servers.urls

    def close(self, keep_logs: bool = False) -> None:
        """Close the client, stop the servers this process started, remove the work directory
        (kept with ``keep_logs`` when a server ran: its log says why it failed)."""
        try:
            if self.model is not None:
                self.model.close()
                self.model = None
        finally:
            ran = self.servers is not None
            if self.servers is not None:
                with contextlib.suppress(Exception):
                    self.servers.stop()
            self.servers = None
            if not (keep_logs and ran):
                shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        keep = exc is not None and self.servers is not None
        self.close(keep_logs=keep)
        if keep and not getattr(exc, "megatron_dapo_context", None):
            with contextlib.suppress(AttributeError):
                exc.megatron_dapo_context = f"reward server logs: {self.workdir}"
        return False


def served_scorer(reward, run_cfg, rule, *, context_tokens: int, check_tolerance: float | None = None):
    """``(scorer, reward model)`` for ``evaluate`` from the ``reward`` section, or ``(None, None)``
    without ``reward.model``. Checked before sampling; the caller closes both."""
    settings = settings_from_config(reward)
    if settings is None:
        return None, None
    try:
        model = EvalRewardModel(settings, run_cfg, context_tokens, check_tolerance)
    except RewardModelError as e:
        raise RewardInputError(str(e)) from e
    try:
        scorer = ServedScorer(model.open, combine=settings.combine, rule=rule)
    except BaseException as e:
        model.close()
        if isinstance(e, (OSError, ValueError, AttributeError, ImportError, SyntaxError)):
            raise RewardInputError(f"reward.combine={settings.combine}: {e}") from e
        raise
    return scorer, model
