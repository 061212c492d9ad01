"""Range and cross-field checks of a merged config. Each failure names the key(s) and spells out the fix.

The only place a knob's range is checked: the runtime configs built from the schema
(`config/knobs.py`) hold values checked here. One function per section; a check that relates two
sections lives with the section whose key it names first.

Model-shape checks (heads divisible by TP, layers by PP) read `model.path/config.json` when it
exists; they never import transformers or megatron, so validation stays instant.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import warnings
from pathlib import Path
from urllib.parse import urlparse

from omegaconf import DictConfig

from megatron_dapo.actor.gpu_settings import GpuSettingsError, ddp_overlap
from megatron_dapo.config.errors import ConfigError
from megatron_dapo.config.schema import RewardModelConfig

# algo/kl_control.py's clip of the adaptive controller's error (not imported: algo/ imports torch)
_ADAPTIVE_KL_ERROR_CLIP = 0.2

_KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")

CHOICES: dict[str, tuple] = {
    "model.dtype": ("fp32", "bf16", "fp16"),
    "model.transformer_impl": ("auto", "transformer_engine", "local"),
    "model.fp8": (None, "e4m3", "hybrid"),
    "model.fp8_recipe": ("delayed", "tensorwise", "blockwise", "mxfp8"),
    "data.format": ("auto", "parquet", "jsonl", "hf"),
    "data.template": ("auto", "dapo", "none"),
    "rollout.engine": ("auto", "sglang", "hf"),
    "rollout.multi_turn.tool_response_truncate_side": ("left", "right", "middle"),
    "rollout.multi_turn.tokenization_sanity_check_mode": ("strict", "ignore_strippable", "disable"),
    # algo/'s ADV_ESTIMATORS and POLICY_LOSS_TYPES (not imported: algo/ imports torch)
    "algorithm.adv_estimator": ("grpo", "rloo", "reinforce_plus_plus_baseline"),
    "algorithm.policy_loss": ("vanilla", "gspo", "cispo", "sapo", "gpg"),
    # algo/kl.py's KL_PENALTY_KINDS; the reward penalty takes the base kinds (a "+" changes only
    # a gradient, and a reward has none)
    "actor.kl_loss_type": _KL_KINDS + tuple(f"{k}+" for k in _KL_KINDS),
    "algorithm.kl_penalty": _KL_KINDS,
    "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
    "algorithm.loss_agg_mode": (
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    ),
    "algorithm.filter_groups.metric": ("acc", "score", "seq_final_reward"),
    "optim.lr_scheduler": ("constant", "cosine"),
    "trainer.device": ("auto", "cpu", "cuda"),
    "parallel.optimizer_checkpoint_format": ("dp_reshardable", "fully_reshardable"),
    "trainer.placement": ("colocated", "disaggregated"),
    "actor.routing_replay": ("none", "rollout"),
    "trainer.mode": ("sync", "one_step_off", "async"),
    "trainer.weight_sync.transport": ("auto", "object_store", "nccl", "cuda_ipc", "disk"),
    "logging.wandb_mode": ("offline", "online"),
    "reward.model.kind": (None, "classifier", "judge"),
    "reward.model.placement": ("own", "colocated"),
    "reward.model.too_long": ("cut", "unscored"),
}

POSITIVE_INTS = (
    "parallel.tensor_model_parallel_size",
    "parallel.pipeline_model_parallel_size",
    "parallel.context_parallel_size",
    "parallel.expert_model_parallel_size",
    "parallel.actor_world_size",
    "data.max_prompt_length",
    "data.max_response_length",
    "rollout.n",
    "rollout.gen_batch_size",
    "rollout.num_engines",
    "rollout.tensor_parallel_size",
    "rollout.max_concurrency_per_engine",
    "rollout.groups_per_call",
    "rollout.val.n",
    "actor.ppo_mini_batch_size",
    "actor.ppo_epochs",
    "actor.micro_batch_max_tokens",
    "actor.logprob_chunk_tokens",
    "actor.max_consecutive_skips",
    "trainer.train_batch_size",
    "trainer.total_steps",
    "trainer.keep_last",
    "trainer.weight_sync.bucket_mb",
    "model.make_vocab_size_divisible_by",
    "reward.model.num_servers",
    "reward.model.gpus_per_server",
    "reward.model.max_in_flight",
    "reward.model.max_new_tokens",
)


def _get(cfg: DictConfig, key: str):
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def _nearest(value, allowed: tuple) -> str:
    """ "; did you mean 'x'?" for the allowed string most like ``value``, or ""."""
    names = {a.lower(): a for a in allowed if isinstance(a, str)}
    match = difflib.get_close_matches(str(value).lower(), list(names), n=1, cutoff=0.6)
    return f"; did you mean {names[match[0]]!r}?" if match else ""


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _hf_config(cfg: DictConfig) -> dict | None:
    path = cfg.model.path
    if not path or path == "???":
        return None
    f = Path(path) / "config.json"
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"model.path: {f} is not readable JSON ({e}); point model.path at an HF checkpoint"
        ) from e


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError on the first inconsistency found."""
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ConfigError(
                f"{key}={value!r} is not one of {', '.join(map(str, allowed))}{_nearest(value, allowed)}"
            )
    for key in POSITIVE_INTS:
        value = _get(cfg, key)
        if value < 1:
            raise ConfigError(f"{key}={value} must be >= 1")
    check_algorithm(cfg)
    check_trainer(cfg)
    check_rollout(cfg)
    check_parallel(cfg)
    check_actor(cfg)
    check_model(cfg)
    check_optim(cfg)
    check_reward(cfg)
    hf = _hf_config(cfg)
    if hf:
        check_model_config(cfg, hf)


def check_algorithm(cfg: DictConfig) -> None:
    alg, ro = cfg.algorithm, cfg.rollout
    # CISPO clips only the stop-gradient weight of its tokens; 1.0 removes the lower bound (the
    # MiniMax-M1 setting). For the other losses a ratio bound of 0 clips every token with A < 0.
    if alg.policy_loss == "cispo":
        if not 0.0 <= alg.clip_ratio_low <= 1.0:
            raise ConfigError(
                f"algorithm.clip_ratio_low={alg.clip_ratio_low} must be in [0, 1] with algorithm.policy_loss=cispo "
                "(1.0: no lower bound on the weight)"
            )
    elif not 0.0 <= alg.clip_ratio_low < 1.0:
        hint = (
            "; 1.0 (no lower bound) is allowed with algorithm.policy_loss=cispo only"
            if alg.clip_ratio_low == 1.0
            else ""
        )
        raise ConfigError(
            f"algorithm.clip_ratio_low={alg.clip_ratio_low} must be in [0, 1) with algorithm.policy_loss="
            f"{alg.policy_loss} (DAPO: 0.2){hint}"
        )
    # the ratio is clipped to [1 - low, 1 + high]: DAPO's clip-higher raises high above low, so
    # a high below low is almost always the two values swapped (SAPO, GPG and CISPO's weight
    # bound read them otherwise)
    if alg.policy_loss in ("vanilla", "gspo") and alg.clip_ratio_high < alg.clip_ratio_low:
        raise ConfigError(
            f"algorithm.clip_ratio_high={alg.clip_ratio_high} is below algorithm.clip_ratio_low="
            f"{alg.clip_ratio_low}: the upper clip must be at least the lower one (DAPO: low 0.2, high 0.28); "
            "swap them"
        )
    for name in ("tau_pos", "tau_neg"):
        if not alg[name] > 0:
            raise ConfigError(
                f"algorithm.{name}={alg[name]} must be > 0 (SAPO's gate temperature; verl: tau_pos 1.0, tau_neg 1.05)"
            )
    if not 0.0 <= alg.entropy_coeff < float("inf"):
        raise ConfigError(
            f"algorithm.entropy_coeff={alg.entropy_coeff} must be >= 0 (the entropy bonus's weight; 0 turns it off)"
        )
    _check_kl_in_reward(alg, cfg.trainer.train_batch_size * cfg.rollout.n)
    if not 0.0 <= alg.clip_ratio_high <= 10.0:
        raise ConfigError(f"algorithm.clip_ratio_high={alg.clip_ratio_high} must be in [0, 10] (DAPO: 0.28)")
    if alg.clip_ratio_c is not None and alg.clip_ratio_c <= 1.0:
        raise ConfigError(
            f"algorithm.clip_ratio_c={alg.clip_ratio_c} must be > 1 (dual-clip lower bound; the 32B recipe "
            "uses 10) or null to disable dual-clip"
        )
    if alg.tis.enable and alg.tis.cap <= 0:
        raise ConfigError(f"algorithm.tis.cap={alg.tis.cap} must be > 0")
    if alg.tis.enable:
        # the same loss as the general form (token level, cap = threshold); one knob is kept
        warnings.warn(
            "algorithm.tis is deprecated: use algorithm.rollout_correction.mode=tis "
            f"algorithm.rollout_correction.threshold={alg.tis.cap:g} (same loss) and tis.enable=false",
            FutureWarning,
            stacklevel=3,
        )
    if alg.filter_groups.max_num_gen_batches < 0:
        raise ConfigError("algorithm.filter_groups.max_num_gen_batches must be >= 0 (0 = unlimited)")
    _check_rollout_correction(alg)
    data = cfg.data
    ob = alg.overlong_buffer
    if ob.enable:
        if not 0 < ob.len <= data.max_response_length:
            raise ConfigError(
                f"algorithm.overlong_buffer.len={ob.len} must be in (0, data.max_response_length="
                f"{data.max_response_length}]; the DAPO recipe uses 4096 of 20480 (or set "
                "algorithm.overlong_buffer.enable=false)"
            )
        if ob.penalty_factor < 0:
            raise ConfigError(f"algorithm.overlong_buffer.penalty_factor={ob.penalty_factor} must be >= 0")
    if not alg.filter_groups.enable and alg.allow_partial_batch:
        raise ConfigError(
            "algorithm.allow_partial_batch only applies with algorithm.filter_groups.enable=true"
        )
    if (
        alg.filter_groups.enable
        and not alg.allow_partial_batch
        and alg.filter_groups.max_num_gen_batches > 0
        and (not ro.over_sample or alg.filter_groups.max_num_gen_batches == 1)
        and alg.filter_groups.max_num_gen_batches * ro.gen_batch_size < cfg.trainer.train_batch_size
    ):
        budget = alg.filter_groups.max_num_gen_batches * ro.gen_batch_size
        raise ConfigError(
            f"algorithm.filter_groups.max_num_gen_batches={alg.filter_groups.max_num_gen_batches} x "
            f"rollout.gen_batch_size={ro.gen_batch_size} = {budget} prompts can never fill "
            f"trainer.train_batch_size={cfg.trainer.train_batch_size}; raise max_num_gen_batches (0 = unlimited) "
            "or rollout.gen_batch_size, or algorithm.allow_partial_batch=true"
        )


def check_trainer(cfg: DictConfig) -> None:
    trainer = cfg.trainer
    if trainer.mode == "async" and trainer.max_staleness < 1:
        raise ConfigError(
            f"trainer.max_staleness={trainer.max_staleness} must be >= 1 with trainer.mode=async "
            "(the engines generate that many batches ahead; 0 is trainer.mode=sync)"
        )
    if trainer.mode in ("one_step_off", "async") and trainer.placement == "colocated":
        # the next rollout runs while the actor trains: both need the devices at once
        raise ConfigError(
            f"trainer.mode={trainer.mode} overlaps generation with training, which colocated engines cannot "
            "(they share the actor's devices); set trainer.placement=disaggregated (with trainer.rollout_gpus) "
            "or trainer.mode=sync"
        )
    tb, mb = trainer.train_batch_size, cfg.actor.ppo_mini_batch_size
    if tb % mb:
        raise ConfigError(
            f"trainer.train_batch_size={tb} must be a multiple of actor.ppo_mini_batch_size={mb} "
            f"(prompts); e.g. actor.ppo_mini_batch_size={_largest_divisor_at_most(tb, mb)}"
        )
    if trainer.placement == "disaggregated" and trainer.device == "cuda" and trainer.rollout_gpus < 1:
        raise ConfigError("trainer.placement=disaggregated needs trainer.rollout_gpus >= 1 for the engines")
    for name, value in trainer.call_timeout.items():
        if value <= 0:
            raise ConfigError(
                f"trainer.call_timeout.{name}={value} must be > 0 (seconds the driver waits on one call to the ranks)"
            )
    if trainer.stop_timeout_s <= 0:
        raise ConfigError(
            f"trainer.stop_timeout_s={trainer.stop_timeout_s} must be > 0 (seconds a SIGTERM stop may take)"
        )


def check_rollout(cfg: DictConfig) -> None:
    ro = cfg.rollout
    for prefix, s in (("rollout", ro), ("rollout.val", ro.val)):
        if s.temperature <= 0:
            raise ConfigError(f"{prefix}.temperature={s.temperature} must be > 0")
        if not 0 < s.top_p <= 1:
            raise ConfigError(f"{prefix}.top_p={s.top_p} must be in (0, 1]")
        if s.top_k == 0 or s.top_k < -1:
            raise ConfigError(f"{prefix}.top_k={s.top_k} must be -1 (off) or >= 1")
    if ro.max_over_sample_factor < 1:
        raise ConfigError(f"rollout.max_over_sample_factor={ro.max_over_sample_factor} must be >= 1")
    if ro.max_retries < 0:
        raise ConfigError(
            f"rollout.max_retries={ro.max_retries} must be >= 0 (engine calls retried elsewhere)"
        )
    if ro.request_timeout_s <= 0:
        raise ConfigError(
            f"rollout.request_timeout_s={ro.request_timeout_s} must be > 0 (seconds one engine call may take)"
        )
    if ro.sglang.health_timeout_s <= 0:
        raise ConfigError(
            f"rollout.sglang.health_timeout_s={ro.sglang.health_timeout_s} must be > 0 "
            "(seconds a running SGLang server may take to answer GET /health before it is restarted)"
        )
    if ro.health_probe_interval_s <= 0:
        raise ConfigError(
            f"rollout.health_probe_interval_s={ro.health_probe_interval_s} must be > 0 "
            "(seconds an engine holding requests may stay silent before its health is checked)"
        )
    _check_multi_turn(cfg)


def _check_multi_turn(cfg: DictConfig) -> None:
    mt = cfg.rollout.multi_turn
    at_least_one = {
        "max_assistant_turns": "model turns per episode",
        "max_tool_response_tokens": "tokens of one tool answer",
        "max_parallel_calls": "tool calls run per model turn",
        "tool_workers": "tool processes",
        "tool_memory_mb": "MiB per tool process",
    }
    for key, what in at_least_one.items():
        if mt[key] < 1:
            raise ConfigError(f"rollout.multi_turn.{key}={mt[key]} must be >= 1 ({what})")
    if mt.max_turn_tokens is not None and mt.max_turn_tokens < 1:
        raise ConfigError(
            f"rollout.multi_turn.max_turn_tokens={mt.max_turn_tokens} must be >= 1, or null for no per-turn cap"
        )
    if not mt.tool_timeout_s > 0:
        raise ConfigError(
            f"rollout.multi_turn.tool_timeout_s={mt.tool_timeout_s} must be > 0 (seconds one tool call may take)"
        )
    if mt.tool_timeout_s >= cfg.rollout.request_timeout_s:
        raise ConfigError(
            f"rollout.multi_turn.tool_timeout_s={mt.tool_timeout_s:g} must be below rollout.request_timeout_s="
            f"{cfg.rollout.request_timeout_s:g}: an episode's engine call includes its tool calls"
        )
    if mt.enable and mt.tool_config_path is None:
        raise ConfigError(
            "rollout.multi_turn.enable=true needs rollout.multi_turn.tool_config_path (a tool YAML: "
            "tools: [{function: path.py:fn, tool_schema: {...}}]; see docs/agentic.md)"
        )


# rewards/served/judge.py's PLACEHOLDERS and built-in parsers (not imported: the rewards package
# imports httpx, and loading a config stays light)
_JUDGE_PLACEHOLDERS = ("question", "response", "ground_truth")
_JUDGE_PARSERS = ("yes_no", "boxed_score")
# a {name} that is not a LaTeX argument (\boxed{x} is preceded by a letter)
_PLACEHOLDER = re.compile(r"(?<![\\\w])\{([A-Za-z_]+)\}")


def _fn_spec(value: str) -> bool:
    path, sep, name = str(value).rpartition(":")
    return bool(sep and path.endswith(".py") and name.isidentifier())


def _check_reward_placement(cfg: DictConfig) -> None:
    """reward.model.placement=colocated: servers the run starts, one per rollout engine it starts,
    within the engine's GPUs, and both memory fractions in one GPU."""
    m, r = cfg.reward.model, cfg.rollout
    if not 0 < m.mem_fraction_static < 1:
        raise ConfigError(
            f"reward.model.mem_fraction_static={m.mem_fraction_static} must be in (0, 1) (the share of a GPU "
            "a colocated reward server takes for its weights and KV cache)"
        )
    if m.placement != "colocated":
        return
    if m.path is None:
        raise ConfigError(
            "reward.model.placement=colocated places servers the run starts from reward.model.path; a "
            "reward.model.url server runs where it was started: remove reward.model.placement"
        )
    if r.engine == "hf" or r.sglang.urls:
        raise ConfigError(
            "reward.model.placement=colocated puts each reward server on the GPUs of an SGLang rollout engine "
            "the run starts (rollout.engine=sglang or auto, without rollout.sglang.urls); use "
            "reward.model.placement=own"
        )
    if m.num_servers > r.num_engines or m.gpus_per_server > r.tensor_parallel_size:
        raise ConfigError(
            f"reward.model.placement=colocated puts reward server i on rollout engine i's GPUs: "
            f"reward.model.num_servers={m.num_servers} must be <= rollout.num_engines={r.num_engines} and "
            f"reward.model.gpus_per_server={m.gpus_per_server} <= rollout.tensor_parallel_size="
            f"{r.tensor_parallel_size}"
        )
    total = m.mem_fraction_static + r.sglang.mem_fraction_static
    if total > _COLOCATED_MEMORY:
        room = round(_COLOCATED_MEMORY - m.mem_fraction_static, 2)
        raise ConfigError(
            f"reward.model.mem_fraction_static={m.mem_fraction_static} + rollout.sglang.mem_fraction_static="
            f"{r.sglang.mem_fraction_static} = {total:.2f} of each shared GPU, above {_COLOCATED_MEMORY} (CUDA "
            f"context, activations and graphs need the rest): set rollout.sglang.mem_fraction_static={room} "
            "or lower"
        )


# the most of a GPU two SGLang servers sharing it may claim together
_COLOCATED_MEMORY = 0.9


def check_reward(cfg: DictConfig) -> None:
    rw = cfg.reward
    m = rw.model
    if m.kind is None:
        for key in ("path", "url", "transform", "prompt_template"):
            if m[key] is not None:
                raise ConfigError(
                    f"reward.model.{key} is set but reward.model.kind is null (off); set reward.model.kind="
                    "classifier or judge, or remove it"
                )
        if rw.combine is not None:
            raise ConfigError(
                "reward.combine mixes the rule reward with a model's score and needs reward.model.kind; for a "
                "rule-only reward of your own use reward.custom_fn"
            )
        return
    where = f"reward.model.kind={m.kind}"
    if (m.path is None) == (m.url is None):
        raise ConfigError(
            f"{where} needs exactly one of reward.model.path (an HF checkpoint directory the run serves) "
            f"and reward.model.url (a running server){'' if m.path is None else ', not both'}"
        )
    if m.url is not None:
        parsed = urlparse(str(m.url))
        if parsed.scheme not in ("http", "https") or not parsed.hostname or not parsed.port:
            raise ConfigError(f"reward.model.url={m.url!r} is not http(s)://HOST:PORT")
        if m.num_servers != 1:
            raise ConfigError(
                f"reward.model.num_servers={m.num_servers} counts servers the run starts from reward.model.path; "
                "with reward.model.url leave it 1"
            )
    _check_reward_placement(cfg)
    if not m.timeout_s > 0:
        raise ConfigError(
            f"reward.model.timeout_s={m.timeout_s} must be > 0 (seconds one scoring request may take)"
        )
    if m.max_retries < 0:
        raise ConfigError(
            f"reward.model.max_retries={m.max_retries} must be >= 0 (retries after the first request)"
        )
    if not m.down_grace_s > 0:
        raise ConfigError(
            f"reward.model.down_grace_s={m.down_grace_s} must be > 0 (seconds a reward server may stay "
            "unreachable before the run stops)"
        )
    if m.step_timeout_s is not None and not m.step_timeout_s > 0:
        raise ConfigError(
            f"reward.model.step_timeout_s={m.step_timeout_s} must be > 0 (seconds a step's scoring may take), "
            "or null for no deadline"
        )
    if m.probe_tolerance is not None and not m.probe_tolerance > 0:
        raise ConfigError(
            f"reward.model.probe_tolerance={m.probe_tolerance} must be > 0, or null for the server's precision's"
        )
    if m.max_restarts < 0:
        raise ConfigError(
            f"reward.model.max_restarts={m.max_restarts} must be >= 0 (restarts of a reward server before "
            "the run stops; 0 stops it at the first death)"
        )
    for key, value in (("reward.model.transform", m.transform), ("reward.combine", rw.combine)):
        if value is not None and not _fn_spec(value):
            raise ConfigError(f"{key}={value!r} must look like 'path/to/file.py:function'")
    if m.kind == "classifier":
        default = RewardModelConfig()
        for key in ("prompt_template", "parser", "temperature", "max_new_tokens", "too_long"):
            if m[key] != getattr(default, key):
                raise ConfigError(
                    f"reward.model.{key} applies to reward.model.kind=judge; a classifier's score is its logit "
                    "(through reward.model.transform): remove it"
                )
        return
    if m.transform is not None:
        raise ConfigError(
            "reward.model.transform applies to reward.model.kind=classifier; a judge's score comes from "
            "reward.model.parser"
        )
    if m.probe_tolerance is not None:
        raise ConfigError(
            "reward.model.probe_tolerance applies to reward.model.kind=classifier (its start-up probe against "
            "transformers); a judge's verdicts are not probed: remove it"
        )
    if m.parser not in _JUDGE_PARSERS and not _fn_spec(m.parser):
        raise ConfigError(
            f"reward.model.parser={m.parser!r} is not one of {', '.join(_JUDGE_PARSERS)} or "
            f"'path/to/file.py:function'{_nearest(m.parser, _JUDGE_PARSERS)}"
        )
    if not 0.0 <= m.temperature < float("inf"):
        raise ConfigError(f"reward.model.temperature={m.temperature} must be >= 0 (0: greedy, the default)")
    if m.prompt_template is not None:
        template = str(m.prompt_template)
        if "{response}" not in template:
            raise ConfigError(
                "reward.model.prompt_template has no {response}: the judge would never see the response; "
                "add it (also {question} and {ground_truth} are filled in)"
            )
        unknown = sorted({p for p in _PLACEHOLDER.findall(template) if p not in _JUDGE_PLACEHOLDERS})
        if unknown:
            raise ConfigError(
                f"reward.model.prompt_template has {', '.join('{' + u + '}' for u in unknown)}, which nothing "
                f"fills in; the placeholders are {', '.join('{' + p + '}' for p in _JUDGE_PLACEHOLDERS)}"
            )


def check_parallel(cfg: DictConfig) -> None:
    par = cfg.parallel
    tp, pp, cp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size
    model_parallel = tp * pp * cp
    if par.actor_world_size % model_parallel:
        raise ConfigError(
            f"parallel.actor_world_size={par.actor_world_size} is not a multiple of tp*pp*cp={model_parallel}; "
            f"use a world size of {model_parallel}, {2 * model_parallel}, ... or change the layout"
        )
    dp = par.actor_world_size // model_parallel
    ep = par.expert_model_parallel_size
    if (dp * cp) % ep:
        raise ConfigError(
            f"parallel.expert_model_parallel_size={ep} must divide the {dp * cp} data x context parallel "
            "ranks (actor_world_size / (tp*pp)); megatron splits experts over those"
        )
    if par.overlap_param_gather:
        # The same refusal as actor/gpu_settings.ddp_overlap, before any rank starts.
        try:
            ddp_overlap(True, par.use_distributed_optimizer, par.overlap_grad_reduce, True)
        except GpuSettingsError as e:
            raise ConfigError(str(e)) from None
    if par.sequence_parallel and tp == 1:
        raise ConfigError(
            "parallel.sequence_parallel=true needs tensor_model_parallel_size > 1; set it to false"
        )
    vpp = par.virtual_pipeline_model_parallel_size
    if vpp is not None and (vpp < 1 or pp == 1):
        raise ConfigError(
            f"parallel.virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 1 "
            "and a value >= 1; set it to null otherwise"
        )
    if vpp and vpp > 1 and cfg.trainer.device == "cpu":
        # megatron-core 0.16's interleaved 1F1B schedule feeds stages the wrong micro-batch's
        # activations on gloo (actor.Actor.update refuses it too, for trainer.device=auto).
        raise ConfigError(
            f"parallel.virtual_pipeline_model_parallel_size={vpp} trains only on GPU (megatron-core's "
            "interleaved schedule is wrong on CPU/gloo); set it to null with trainer.device=cpu"
        )


def check_actor(cfg: DictConfig) -> None:
    par, mb, n = cfg.parallel, cfg.actor.ppo_mini_batch_size, cfg.rollout.n
    dp = par.actor_world_size // (
        par.tensor_model_parallel_size * par.pipeline_model_parallel_size * par.context_parallel_size
    )
    if (mb * n) % dp:
        raise ConfigError(
            f"actor.ppo_mini_batch_size * rollout.n = {mb * n} responses must split evenly over the "
            f"{dp} data-parallel ranks (actor_world_size / (tp*pp*cp)); change the mini-batch or the layout"
        )
    aux = cfg.actor.moe_aux_loss_coeff
    if aux is not None and not aux >= 0:
        raise ConfigError(f"actor.moe_aux_loss_coeff={aux} must be >= 0 (or null: the HF config's)")
    scale = cfg.actor.loss_scale_factor
    if scale is not None and scale < 1:
        raise ConfigError(
            f"actor.loss_scale_factor={scale} must be >= 1 (the divisor of seq-mean-token-sum-norm), or null "
            "for data.max_response_length"
        )
    coef = cfg.actor.kl_loss_coef
    if not 0.0 <= coef < float("inf"):
        raise ConfigError(
            f"actor.kl_loss_coef={coef} must be >= 0 (the KL loss's weight with actor.use_kl_loss; GRPO: 0.001)"
        )


def _check_kl_in_reward(alg: DictConfig, responses_per_step: int) -> None:
    ctrl = alg.kl_ctrl
    if not 0.0 <= ctrl.kl_coef < float("inf"):
        raise ConfigError(
            f"algorithm.kl_ctrl.kl_coef={ctrl.kl_coef} must be >= 0 (the reward penalty's initial coefficient; verl: 0.001)"
        )
    if ctrl.type == "adaptive":
        for name, verl in (("target_kl", 0.1), ("horizon", 10000)):
            if not 0.0 < ctrl[name] < float("inf"):
                raise ConfigError(
                    f"algorithm.kl_ctrl.{name}={ctrl[name]} must be > 0 with algorithm.kl_ctrl.type=adaptive (verl: {verl})"
                )
        # each update multiplies the coefficient by 1 + e * n / horizon with e down to -0.2 and n
        # the step's responses: at horizon <= 0.2 n that reaches 0 or below, and a negative
        # coefficient turns the penalty into a KL bonus that grows every step
        floor = _ADAPTIVE_KL_ERROR_CLIP * responses_per_step
        if ctrl.horizon <= floor:
            raise ConfigError(
                f"algorithm.kl_ctrl.horizon={ctrl.horizon:g} lets the adaptive coefficient reach 0 or turn negative "
                f"with {responses_per_step} responses a step (trainer.train_batch_size x rollout.n); it must be "
                f"> {floor:g} ({_ADAPTIVE_KL_ERROR_CLIP:g} x {responses_per_step}), e.g. {math.floor(floor) + 1}"
            )


def check_model(cfg: DictConfig) -> None:
    if cfg.model.fp8 is not None and cfg.model.transformer_impl == "local":
        raise ConfigError(
            "model.fp8 needs Transformer Engine layers; set model.transformer_impl=auto or transformer_engine "
            "(and install the `gpu` extra), or model.fp8=null"
        )


def check_optim(cfg: DictConfig) -> None:
    optim = cfg.optim
    if optim.lr <= 0 or optim.min_lr < 0 or optim.min_lr > optim.lr:
        raise ConfigError(f"optim.lr={optim.lr} must be > 0 and 0 <= optim.min_lr <= optim.lr")
    if optim.clip_grad < 0 or optim.lr_warmup_steps < 0:
        raise ConfigError("optim.clip_grad and optim.lr_warmup_steps must be >= 0")


def check_model_config(cfg: DictConfig, hf: dict) -> None:
    """The checks that read the model's HF config.json."""
    par = cfg.parallel
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    _check_model_shape(hf, tp, pp, par.virtual_pipeline_model_parallel_size, cfg.model.path)
    aux = cfg.actor.moe_aux_loss_coeff
    if aux and not hf.get("num_experts"):
        raise ConfigError(
            f"actor.moe_aux_loss_coeff={aux} is for MoE models; {cfg.model.path} has no experts (set it to null)"
        )
    if aux is None and hf.get("num_experts") and hf.get("output_router_logits"):
        aux = hf.get("router_aux_loss_coef") or 0.0  # the actor's default (HF trains with it)
    if aux and cfg.model.recompute:
        raise ConfigError(
            f"actor.moe_aux_loss_coeff={aux} (null: the HF config's) does not support activation "
            "recomputation (model.recompute); set model.recompute=false or actor.moe_aux_loss_coeff=0"
        )


def _check_rollout_correction(alg: DictConfig) -> None:
    # algo/ imports torch (1.5 s); loading a config (`megatron-dapo config`, `plan`) does not
    # (the one function-local import tools/check_imports.py allows by name: LAZY_EXCEPTIONS)
    from megatron_dapo.algo.rollout_correction import RolloutCorrection

    rc = alg.rollout_correction
    try:
        built = RolloutCorrection(rc.mode, rc.level, rc.threshold, rc.threshold_lower)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if built.active and alg.tis.enable:
        raise ConfigError(
            "algorithm.tis.enable=true and algorithm.rollout_correction.mode="
            f"{rc.mode} correct the same gap twice; use rollout_correction.mode=tis and tis.enable=false"
        )


def _largest_divisor_at_most(n: int, m: int) -> int:
    return max(d for d in range(1, min(n, m) + 1) if n % d == 0)


def _check_model_shape(hf: dict, tp: int, pp: int, vpp: int | None, path: str) -> None:
    heads = hf.get("num_attention_heads")
    kv = hf.get("num_key_value_heads", heads)
    layers = hf.get("num_hidden_layers")
    if heads and heads % tp:
        raise ConfigError(
            f"parallel.tensor_model_parallel_size={tp} does not divide the {heads} attention heads of "
            f"{path}; use one of {_divisors(heads)}"
        )
    if kv and kv % tp:
        raise ConfigError(
            f"parallel.tensor_model_parallel_size={tp} does not divide the {kv} key/value heads of {path}; "
            f"use one of {_divisors(kv)}"
        )
    # MoE experts (and Qwen2-MoE's shared expert) are split over TP (expert TP = TP).
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        size = hf.get(key) if hf.get("num_experts") else None
        if size and size % tp:
            raise ConfigError(
                f"parallel.tensor_model_parallel_size={tp} does not divide {key}={size} of {path} (experts are "
                f"split over TP); use one of {_divisors(size)}"
            )
    stages = pp * (vpp or 1)
    if layers and layers % stages:
        raise ConfigError(
            f"{layers} layers of {path} do not split into pipeline_model_parallel_size * "
            f"virtual_pipeline_model_parallel_size = {stages} equal stages; use a divisor of {layers}"
        )
