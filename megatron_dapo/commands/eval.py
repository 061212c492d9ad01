"""`megatron-dapo eval`: avg@k / pass@k / maj@k with the DAPO reward.

Sources: an HF checkpoint (`--hf-dir`: the HF engine on CPU, an SGLang server on GPU) or any
running OpenAI-compatible endpoint (`--url`: SGLang, vLLM, Ray Serve). Defaults follow the DAPO
AIME protocol: k=32 samples per problem at temperature 1.0, top_p 0.7. `--run RUN_DIR` builds the
prompts as that run did (data template, chat template, prompt and response lengths, data files
and reward from its config.yaml); flags given explicitly override it. Every prompt is checked
against the prompt budget and the model's context before anything is sampled.

A served reward model (`reward.model`, as training uses it: the run's, or `reward.*=...`
overrides) judges the responses instead of the rule: by `reward.model.url`, or served here from
`reward.model.path` once sampling is done. A response it could not score is left out of its
problem's avg@k / pass@k / maj@k, never counted as wrong, and counted in `unscored`.

With tools: a run trained with `rollout.multi_turn.enable` is evaluated as its validation ran, its
prompts listing the tools and each sample an episode through the same loop and tools (its tool
YAML, call format, turn and token budgets); `--tools PATH` gives another tool YAML, `--tools none`
samples one turn without tools. `--hf-dir` runs the episodes on the HF engine or an SGLang server
(`--engine`), `--url` through the chat API's `tools` and `tool_calls`. The metrics then also hold
the model turns and tool calls per episode and the calls answered by an error or a time-out
(`multiturn/*`). With `--run`, the sampling protocol (k, temperature, top_p, top_k, seed) and the
problem limit are the run's validation's unless a flag gives them, so `eval --run` of a run's
checkpoint measures what its validation measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import threading
from pathlib import Path

from omegaconf import OmegaConf

from megatron_dapo.agent.bridge import ChatBridge
from megatron_dapo.agent.from_config import tool_specs
from megatron_dapo.agent.runner import MultiTurnSettings
from megatron_dapo.agent.tools.host import ToolHost
from megatron_dapo.commands.eval_reward import (
    RewardInputError,
    reward_overrides,
    reward_section,
    served_scorer,
)
from megatron_dapo.commands.eval_tools import NO_TOOLS, EvalTools, EvalToolsError, eval_tools
from megatron_dapo.config import ConfigError, DAPOConfig, load_config
from megatron_dapo.data.dataset import PromptDataset
from megatron_dapo.data.loading import load_prompt_rows
from megatron_dapo.data.types import DataError
from megatron_dapo.driver.datasets import make_scorer
from megatron_dapo.driver.validation import engine_generator
from megatron_dapo.eval.chat_tools import make_chat_tool_generator
from megatron_dapo.eval.openai_endpoint import (
    check_reachable,
    make_endpoint_generator,
    models_url,
    served_context_length,
)
from megatron_dapo.eval.prompt_fit import PromptSettings, PromptTooLong, check_prompts_fit
from megatron_dapo.eval.runner import EvalProblem, dedupe_problems, evaluate
from megatron_dapo.hf_tokenizer import load_tokenizer
from megatron_dapo.ports import free_port
from megatron_dapo.rewards.scorer import Scorer
from megatron_dapo.rollout.hf_engine import HFEngine
from megatron_dapo.rollout.types import SamplingParams
from megatron_dapo.sglang.client import SGLangEngine
from megatron_dapo.sglang.engines import launch_sglang_engines, server_config, stop_sglang_engines
from megatron_dapo.sglang.server import SGLangServer, SGLangServerConfig

DEFAULT_DATA = "data/aime-2024.parquet"
# The CLI's own defaults, used where neither a flag nor --run gives a value.
DEFAULTS = {
    "template": "auto",
    "apply_chat_template": True,
    "max_prompt_length": 2048,
    "max_response_length": 20480,
}
# The sampling protocol's defaults (the DAPO AIME protocol), used where neither a flag nor --run's
# rollout.val / trainer.seed gives a value.
PROTOCOL_DEFAULTS = {"k": 32, "temperature": 1.0, "top_p": 0.7, "top_k": -1, "seed": 0}
FLAGS = {
    "template": "--template",
    "apply_chat_template": "--no-chat-template",
    "max_prompt_length": "--max-prompt-length",
    "max_response_length": "--max-tokens",
}


def register(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-dir", help="HF checkpoint to sample from")
    src.add_argument("--url", help="base URL of an OpenAI-compatible server, e.g. http://host:30000")
    p.add_argument(
        "--run",
        metavar="RUN_DIR",
        help="a run directory: its config.yaml gives the data template, chat template, lengths, "
        "validation files and reward",
    )
    p.add_argument("--model", default="default", help="model name sent to the endpoint (--url)")
    p.add_argument(
        "--tokenizer",
        help="the model's tokenizer dir: prompts are sent as its ids, responses counted in its tokens "
        "(default: the run's model, else --hf-dir; --url needs one of them)",
    )
    p.add_argument(
        "--data",
        nargs="+",
        help=f"eval set(s) (verl parquet/jsonl; default: the run's data.val_files, else {DEFAULT_DATA})",
    )
    p.add_argument(
        "--k", type=int, help="samples per problem (avg@k; default: the run's rollout.val.n, else 32)"
    )
    p.add_argument("--pass-k", type=int, nargs="*", default=[1, 8, 16], help="k values for pass@k / maj@k")
    p.add_argument("--temperature", type=float, help="default: the run's rollout.val.temperature, else 1.0")
    p.add_argument("--top-p", type=float, help="default: the run's rollout.val.top_p, else 0.7")
    p.add_argument(
        "--max-tokens",
        type=int,
        help="max response tokens (default: the run's rollout.val.max_response_length or "
        f"data.max_response_length, else {DEFAULTS['max_response_length']})",
    )
    p.add_argument(
        "--max-prompt-length",
        type=int,
        help=f"max prompt tokens (default: the run's data.max_prompt_length, else {DEFAULTS['max_prompt_length']})",
    )
    p.add_argument(
        "--chat-template",
        dest="chat_template",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="render prompts with the tokenizer's chat template (default: the run's "
        "data.apply_chat_template, else on); --no-chat-template sends the prompt contents as they are",
    )
    p.add_argument(
        "--template",
        help="prompt template for bare problems: auto | dapo | none | a string with {problem} "
        "(default: the run's data.template, else auto)",
    )
    p.add_argument(
        "--limit",
        type=int,
        help="evaluate only the first N distinct problems (default: the run's data.val_max_samples, else all)",
    )
    p.add_argument("--seed", type=int, help="sampling seed (default: the run's trainer.seed, else 0)")
    p.add_argument(
        "--tools",
        metavar="YAML|none",
        help="episodes with the tools of this tool YAML (the run's other rollout.multi_turn settings, else "
        "the schema's); default: the run's rollout.multi_turn.tool_config_path when the run trained with "
        f"tools; {NO_TOOLS}: one turn without tools",
    )
    p.add_argument(
        "--engine",
        choices=["auto", "hf", "sglang"],
        default="auto",
        help="engine for --hf-dir: auto (an SGLang server on a GPU with sglang installed, else the HF "
        "engine), hf, or sglang (a server started here, on the CPU without a GPU: the run's "
        "rollout.sglang settings, `make setup-sglang`)",
    )
    p.add_argument("--out", help="write the metrics as JSON here")
    p.add_argument("--dump", help="write every response (text, tokens, score) as JSONL here")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="reward.KEY=VALUE",
        help="the reward section, as in a run config (over --run's): e.g. reward.model.kind=judge "
        "reward.model.url=http://host:30000, or reward.model.path=DIR to serve a reward model here",
    )
    p.add_argument(
        "--reward-check-tolerance",
        type=float,
        help="a classifier served from reward.model.path must score probe texts as transformers does "
        "within this (default: 1e-4 for a float32 server on CPU, 4e-2 for a GPU server's bf16/fp16)",
    )
    p.set_defaults(func=run)


class EvalInputError(ValueError):
    """Bad input to `eval`: printed as one line, exit status 2."""


def _load_run(run_dir: str, overrides: list[str]):
    """The run's config (read with the config loader, ``overrides`` on top) and its path."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise EvalInputError(
            f"--run {run_dir} has no config.yaml; point it at a run directory (runs/NAME) that train wrote"
        )
    try:
        return load_config(path, overrides), path
    except ConfigError as e:
        raise EvalInputError(f"--run {path}: {e}") from e


# Each numeric flag: (the valid range in words, the test). Written as `not (test)` below, so NaN,
# which every comparison rejects, is refused too.
_RANGES = {
    "k": (">= 1", lambda v: v >= 1),
    "temperature": (">= 0 (0: greedy)", lambda v: v >= 0),
    "top_p": ("in (0, 1]", lambda v: 0 < v <= 1),
    "max_tokens": (">= 1", lambda v: v >= 1),
    "max_prompt_length": (">= 1", lambda v: v >= 1),
    "limit": (">= 1", lambda v: v >= 1),
    "seed": (">= 0", lambda v: v >= 0),
}


def _check_numbers(args) -> None:
    """Every numeric flag against its range, before the URL, the run, the data or the model are
    read: a bad number would otherwise surface as whatever later check it happens to upset."""
    for dest, (valid, ok) in _RANGES.items():
        value = getattr(args, dest)
        if value is not None and not ok(value):
            flag = "--" + dest.replace("_", "-")
            raise EvalInputError(f"{flag}={value} must be {valid}")
    bad = [k for k in args.pass_k if not k >= 1]
    if bad:
        raise EvalInputError(
            f"--pass-k {' '.join(map(str, args.pass_k))}: every k must be >= 1 (got {bad[0]})"
        )


def _settings(args, cfg, cfg_path):
    """Prompt settings: an explicit flag, else the run's config, else the CLI's default."""
    flags = {
        "template": args.template,
        "apply_chat_template": args.chat_template,
        "max_prompt_length": args.max_prompt_length,
        "max_response_length": args.max_tokens,
    }
    from_run = {}
    if cfg is not None:
        from_run = {
            "template": ("data.template", cfg.data.template),
            "apply_chat_template": ("data.apply_chat_template", cfg.data.apply_chat_template),
            "max_prompt_length": ("data.max_prompt_length", cfg.data.max_prompt_length),
            "max_response_length": (
                ("rollout.val.max_response_length", cfg.rollout.val.max_response_length)
                if cfg.rollout.val.max_response_length
                else ("data.max_response_length", cfg.data.max_response_length)
            ),
        }
    values, origin = {}, {}
    for key, flag_value in flags.items():
        if flag_value is not None:
            values[key], origin[key] = flag_value, FLAGS[key]
        elif key in from_run:
            name, value = from_run[key]
            values[key], origin[key] = value, f"{name} in {cfg_path}"
        else:
            values[key], origin[key] = DEFAULTS[key], f"{FLAGS[key]} (default)"
    if values["apply_chat_template"] is True and origin["apply_chat_template"] == "--no-chat-template":
        origin["apply_chat_template"] = "--chat-template"
    for key in ("max_prompt_length", "max_response_length"):
        if values[key] < 1:
            raise EvalInputError(f"{origin[key]}={values[key]} must be >= 1")
    return PromptSettings(origin=origin, **values)


def _protocol(args, cfg) -> dict:
    """k, temperature, top_p, top_k and seed: a flag, else the run's validation's, else the
    protocol's default."""
    from_run = {}
    if cfg is not None:
        v = cfg.rollout.val
        from_run = {"k": v.n, "temperature": v.temperature, "top_p": v.top_p, "top_k": v.top_k}
        from_run["seed"] = cfg.trainer.seed
    flags = {"k": args.k, "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed}
    out = {}
    for key, default in PROTOCOL_DEFAULTS.items():
        value = flags.get(key)
        out[key] = value if value is not None else from_run.get(key, default)
    return out


def _problems(files, settings, tokenizer, layout_cfg, limit, tools: list[dict] | None = None):
    """Deduplicated problems; ``layout_cfg``: the run whose column layout the files have."""
    read = {}
    if layout_cfg is not None:
        data = layout_cfg.data
        read = {
            "format": data.format,
            "prompt_key": data.prompt_key,
            "answer_key": data.answer_key,
            "skip_bad_rows": data.skip_bad_rows,
        }
    rows: list[dict] = []
    for f in files:
        part = load_prompt_rows(str(f), template=settings.template, **read)
        offset = len(rows)  # row indices stay unique across files
        rows.extend({**r, "index": r["index"] + offset} for r in part)
    ds = PromptDataset(
        rows,
        tokenizer,
        # keep every prompt here: an eval that dropped the long ones would measure a different
        # set; check_prompts_fit stops on them instead
        max_prompt_length=sys.maxsize,
        apply_chat_template=settings.apply_chat_template,
        seed=0,
        shuffle=False,
        tools=tools,  # the chat template lists them, as in the run's prompts
    )
    problems = dedupe_problems(
        [
            EvalProblem(
                str(s.index),
                s.prompt_text,
                s.prompt_ids,
                s.data_source,
                s.ground_truth,
                s.extra_info,
                messages=s.messages,
            )
            for s in ds.samples
        ]
    )
    return problems[:limit] if limit else problems


def _checkpoint_context(model_dir) -> int | None:
    """``max_position_embeddings`` of an HF checkpoint's config.json (or its text config)."""
    try:
        hf = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for section in (hf, hf.get("text_config") or {}):
        value = section.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return None


def _context(args, cards, tok_path) -> tuple[int | None, str]:
    """The model's context length and where it was read."""
    if args.url:
        served = served_context_length(cards, args.model)
        if served is not None:
            return served, f"max_model_len at {models_url(args.url)}"
        model_dir = tok_path
    else:
        model_dir = args.hf_dir
    value = _checkpoint_context(model_dir)
    return value, f"max_position_embeddings in {Path(model_dir) / 'config.json'}"


def _token_counter(tokenizer):
    """The tokenizer's count of a text's tokens; one call at a time (a fast tokenizer's settings
    are changed per call, and concurrent calls can fail with "Already borrowed")."""
    lock = threading.Lock()

    def count(text: str) -> int:
        with lock:
            return len(tokenizer.encode(text, add_special_tokens=False))

    return count


def _hf_generator(args, cfg, tokenizer, max_tokens: int, protocol: dict, episodes=None):
    """An engine for the checkpoint (``--engine``) and the generator over it; ``episodes``: the
    episode loop of an evaluation with tools (one turn without)."""
    sampling = SamplingParams(
        temperature=protocol["temperature"],
        top_p=protocol["top_p"],
        top_k=protocol["top_k"],
        max_new_tokens=max_tokens,
        stop_token_ids=[] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)],
    )
    engine, cleanup = _engine(args, cfg, protocol["seed"])
    generate = engine_generator([engine], tokenizer, sampling, seed=protocol["seed"], episodes=episodes)
    return generate, cleanup


def _engine(args, cfg, seed: int):
    """The engine ``--engine`` names and what stops it: SGLang on a GPU with sglang installed (or
    asked for), else the HF engine."""
    import torch

    cuda = torch.cuda.is_available()
    if args.engine == "hf":
        use_sglang = False
    elif args.engine == "sglang":
        use_sglang = True
    else:
        try:
            import sglang  # noqa: F401

            use_sglang = cuda
        except ImportError:
            use_sglang = False
    if not use_sglang:
        engine = HFEngine(args.hf_dir, name="hf-eval", seed=seed, device="cuda" if cuda else "cpu")
        return engine, []
    if cuda:
        server = SGLangServer(
            SGLangServerConfig(model_path=args.hf_dir, tp_size=torch.cuda.device_count())
        ).start()
        try:
            server.wait_healthy()
        except BaseException:
            server.stop()
            raise
        return SGLangEngine(server.cfg.url, server=server, tp_size=server.cfg.tp_size), [server.stop]
    # a CPU server, as a CPU run starts its own: the run's rollout.sglang settings (else the
    # schema's), SGLang's CPU flags, a free port
    base = cfg if cfg is not None else OmegaConf.structured(DAPOConfig)
    server_cfg = OmegaConf.merge(base, {"model": {"path": str(args.hf_dir)}})
    log_dir = Path(tempfile.mkdtemp(prefix="megatron_dapo_eval_sglang_"))
    config = server_config(server_cfg, 0, (), log_dir, port=free_port(), cpu=True)
    print(f"eval: starting an SGLang server on the CPU (log {config.log_file})", file=sys.stderr)
    (engine,) = launch_sglang_engines(server_cfg, [config])
    return engine, [lambda: stop_sglang_engines([engine])]


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (EvalInputError, RewardInputError, EvalToolsError) as e:
        print(f"eval: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    _check_numbers(args)
    cards: list[dict] = []
    if args.url:
        # before the data and tokenizer: a wrong port is the usual mistake
        cards = check_reachable(args.url)
    overrides = reward_overrides(list(args.overrides))
    cfg, cfg_path = _load_run(args.run, overrides) if args.run else (None, None)
    reward = reward_section(cfg, overrides)
    settings = _settings(args, cfg, cfg_path)
    protocol = _protocol(args, cfg)
    tools = eval_tools(args.tools, cfg, cfg_path)
    if tools is not None and args.url and not settings.apply_chat_template:
        raise EvalInputError(
            f"{tools.origin} with --url: episodes go through the chat API, which renders the chat "
            f"template; drop --no-chat-template or give --tools {NO_TOOLS}"
        )
    run_tokenizer = (cfg.model.tokenizer_path or cfg.model.path) if cfg is not None else None
    tok_path = args.tokenizer or run_tokenizer or args.hf_dir
    if tok_path is None:
        raise EvalInputError(
            "--url needs --tokenizer (the served model's tokenizer: prompts are sent as its token ids "
            "and responses counted in its tokens) or --run RUN_DIR"
        )
    files = args.data or (list(cfg.data.val_files) if cfg is not None else [DEFAULT_DATA])
    if not files:
        raise EvalInputError(f"the run's data.val_files in {cfg_path} is empty; give --data")
    for f in files:
        if not Path(f).exists():
            raise EvalInputError(f"--data {f} not found; point it at the AIME 2024 parquet (DAPO layout)")
    if not args.url and not (Path(args.hf_dir) / "config.json").is_file():
        raise EvalInputError(
            f"--hf-dir {args.hf_dir} has no config.json; point it at an HF checkpoint directory"
        )
    try:
        tokenizer = load_tokenizer(tok_path)
    except (OSError, ValueError) as e:
        named = "--tokenizer" if args.tokenizer else "the run's model" if run_tokenizer else "--hf-dir"
        raise EvalInputError(
            f"{named} {tok_path}: no tokenizer there ({e}); point it at the model's checkpoint directory"
        ) from e
    # check_prompts_fit below names over-long prompts with their template and the model's real
    # context; the tokenizer's own warning (against its model_max_length) would only precede it
    tokenizer.model_max_length = sys.maxsize
    try:
        # the run's column layout applies to the run's own files, not to --data
        limit = args.limit or (cfg.data.val_max_samples if cfg is not None else None)
        problems = _problems(
            files,
            settings,
            tokenizer,
            None if args.data else cfg,
            limit,
            None if tools is None else tools.schemas,
        )
    except DataError as e:
        raise EvalInputError(str(e)) from e
    context, context_from = _context(args, cards, tok_path)
    if context is None:
        print(
            f"eval: the model's context length is unknown ({context_from} not found); prompts are "
            f"checked against {settings.name('max_prompt_length')} only",
            file=sys.stderr,
        )
    try:
        check_prompts_fit(problems, settings, context, context_from)
    except PromptTooLong as e:
        raise EvalInputError(str(e)) from e
    if cfg is not None:
        scorer = make_scorer(cfg)  # the run's reward (custom function, boxed fallback)
    else:
        scorer = Scorer()
    with contextlib.ExitStack() as stack:
        stack.enter_context(scorer)
        # the reward model before sampling: every setting it can check is checked now
        served, reward_model = served_scorer(
            reward,
            cfg,
            scorer,
            context_tokens=_reward_context(settings, reward),
            check_tolerance=args.reward_check_tolerance,
        )
        if reward_model is not None:
            stack.enter_context(reward_model)
        cleanup = []
        stack.callback(lambda: [fn() for fn in cleanup])
        if args.url and tools is not None:
            generate = _chat_generator(args, stack, tools, tokenizer, settings, protocol, context)
        elif args.url:
            generate = make_endpoint_generator(
                args.url,
                model=args.model,
                temperature=protocol["temperature"],
                top_p=protocol["top_p"],
                max_tokens=settings.max_response_length,
                count_text=_token_counter(tokenizer),
            )
        else:
            episodes = None
            if tools is not None:
                episodes = tools.runner(tokenizer, context)
                stack.callback(episodes.close)  # the tool processes
            generate, cleanup[:] = _hf_generator(
                args, cfg, tokenizer, settings.max_response_length, protocol, episodes
            )
        k = protocol["k"]
        metrics = evaluate(
            problems,
            _then(generate, cleanup),
            served or scorer,
            k=k,
            pass_ks=tuple(x for x in args.pass_k if x <= k),
            dump_path=args.dump,
            prefix="",
        )
    text = json.dumps(metrics, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if served is not None and not any(key.startswith("avg@") for key in metrics):
        print(
            f"eval: the reward model scored no response ({metrics['unscored']:.0f} unscored: "
            + ", ".join(f"{key[9:]} {v:.0f}" for key, v in metrics.items() if key.startswith("unscored/"))
            + "); --dump writes each one's reason",
            file=sys.stderr,
        )
        return 1
    return 0


def _chat_generator(args, stack, tools: EvalTools, tokenizer, settings, protocol: dict, context):
    """Episodes through the chat API with the tools' schemas; the tools run here."""
    mt = tools.section
    try:
        bridge = ChatBridge(tokenizer)
    except ValueError as e:
        raise EvalInputError(
            f"{tools.origin}: the tokenizer's chat template cannot render tool turns ({e}); give --tokenizer "
            "the served model's tokenizer"
        ) from e
    host = ToolHost(
        [*tool_specs(tools.cfg)],
        timeout_s=mt.tool_timeout_s,
        workers=mt.tool_workers,
        memory_mb=mt.tool_memory_mb,
    )
    stack.callback(host.close)
    turns = MultiTurnSettings.from_config(tools.cfg, max_context=context or 1 << 30)
    return make_chat_tool_generator(
        args.url,
        model=args.model,
        temperature=protocol["temperature"],
        top_p=protocol["top_p"],
        max_tokens=settings.max_response_length,
        count_text=_token_counter(tokenizer),
        tools=host,
        schemas=tools.schemas,
        settings=turns,
        truncate=lambda text: bridge.truncate(
            text, turns.max_tool_response_tokens, turns.tool_response_truncate_side
        ),
    )


def _then(generate, cleanup: list):
    """``generate``, after which the policy's server stops: a reward server eval starts next gets
    the GPUs to itself."""

    def run(problems, k):
        try:
            return generate(problems, k)
        finally:
            while cleanup:
                cleanup.pop()()

    return run


# Room for the judge's prompt template and either model's chat markup around prompt and response
# (the built-in template is 317 characters, judge.py DEFAULT_PROMPT_TEMPLATE; a user's may be
# longer).
_REWARD_MARKUP_TOKENS = 1024


def _reward_context(settings: PromptSettings, reward) -> int:
    """The longest request the reward model gets: the prompt, the response, the markup and a
    judge's verdict (a CPU reward server's KV pool holds one)."""
    verdict = int(reward.model.max_new_tokens) if reward.model.kind == "judge" else 0
    return settings.max_prompt_length + settings.max_response_length + _REWARD_MARKUP_TOKENS + verdict
