"""`megatron-dapo eval`: avg@k / pass@k / maj@k with the DAPO reward.

Sources: an HF checkpoint (`--hf-dir`: the HF engine on CPU, an SGLang server on GPU) or any
running OpenAI-compatible endpoint (`--url`: SGLang, vLLM, Ray Serve). Defaults follow the DAPO
AIME protocol: k=32 samples per problem at temperature 1.0, top_p 0.7.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate avg@k / pass@k / maj@k (AIME protocol by default)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-dir", help="HF checkpoint to sample from")
    src.add_argument("--url", help="base URL of an OpenAI-compatible server, e.g. http://host:30000")
    p.add_argument("--model", default="default", help="model name sent to the endpoint (--url)")
    p.add_argument("--tokenizer", help="tokenizer dir for the chat template (default: --hf-dir)")
    p.add_argument(
        "--data",
        default="data/aime-2024.parquet",
        help="eval set (verl parquet/jsonl; default: the DAPO AIME 2024 file)",
    )
    p.add_argument("--k", type=int, default=32, help="samples per problem (avg@k)")
    p.add_argument("--pass-k", type=int, nargs="*", default=[1, 8, 16], help="k values for pass@k / maj@k")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=20480, help="max response tokens")
    p.add_argument("--max-prompt-length", type=int, default=2048)
    p.add_argument("--no-chat-template", action="store_true", help="send the prompt contents as they are")
    p.add_argument("--template", default="auto", help="prompt template for bare problems: auto | dapo | none")
    p.add_argument("--limit", type=int, help="evaluate only the first N distinct problems")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the metrics as JSON here")
    p.add_argument("--dump", help="write every response as JSONL here")
    p.set_defaults(func=run)


def _problems(args, tokenizer):
    from megatron_dapo.data.dataset import PromptDataset
    from megatron_dapo.data.loading import load_prompt_rows
    from megatron_dapo.eval.runner import EvalProblem, dedupe_problems

    rows = load_prompt_rows(args.data, template=args.template)
    ds = PromptDataset(
        rows,
        tokenizer,
        max_prompt_length=args.max_prompt_length,
        apply_chat_template=not args.no_chat_template,
        seed=0,
        shuffle=False,
    )
    problems = dedupe_problems(
        [
            EvalProblem(
                str(s.index), s.prompt_text, s.prompt_ids, s.data_source, s.ground_truth, s.extra_info
            )
            for s in ds.samples
        ]
    )
    return problems[: args.limit] if args.limit else problems


def _hf_generator(args, tokenizer):
    """An engine for the checkpoint: SGLang when a GPU and sglang are there, else the HF engine."""
    import torch

    from megatron_dapo.driver.validation import engine_generator
    from megatron_dapo.rollout.types import SamplingParams

    sampling = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_tokens,
        stop_token_ids=[] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)],
    )
    cleanup = []
    try:
        import sglang  # noqa: F401

        use_sglang = torch.cuda.is_available()
    except ImportError:
        use_sglang = False
    if use_sglang:
        from megatron_dapo.sglang.client import SGLangEngine
        from megatron_dapo.sglang.server import SGLangServer, SGLangServerConfig

        server = SGLangServer(
            SGLangServerConfig(model_path=args.hf_dir, tp_size=torch.cuda.device_count())
        ).start()
        server.wait_healthy()
        cleanup.append(server.stop)
        engine = SGLangEngine(server.cfg.url, server=server, tp_size=server.cfg.tp_size)
    else:
        from megatron_dapo.rollout.hf_engine import HFEngine

        engine = HFEngine(
            args.hf_dir, name="hf-eval", seed=args.seed, device="cuda" if torch.cuda.is_available() else "cpu"
        )
    return engine_generator([engine], tokenizer, sampling, seed=args.seed), cleanup


def run(args: argparse.Namespace) -> int:
    from megatron_dapo.data.tokenizer import load_tokenizer
    from megatron_dapo.data.types import DataError
    from megatron_dapo.eval.runner import evaluate
    from megatron_dapo.rewards.scorer import Scorer

    if args.url:
        from megatron_dapo.eval.openai_endpoint import check_reachable

        check_reachable(args.url)  # before the data and tokenizer: a wrong port is the usual mistake
    tok_path = args.tokenizer or args.hf_dir
    if tok_path is None and not args.no_chat_template:
        print("eval: --url needs --tokenizer (for the chat template) or --no-chat-template", file=sys.stderr)
        return 2
    if not Path(args.data).exists():
        print(
            f"eval: --data {args.data} not found; point it at the AIME 2024 parquet (DAPO layout)",
            file=sys.stderr,
        )
        return 2
    if not args.url and not (Path(args.hf_dir) / "config.json").is_file():
        print(
            f"eval: --hf-dir {args.hf_dir} has no config.json; point it at an HF checkpoint directory",
            file=sys.stderr,
        )
        return 2
    tokenizer = load_tokenizer(tok_path) if tok_path else _PlainTokenizer()
    try:
        problems = _problems(args, tokenizer)
    except DataError as e:
        print(f"eval: {e}", file=sys.stderr)
        return 2
    cleanup = []
    if args.url:
        from megatron_dapo.eval.openai_endpoint import make_endpoint_generator

        generate = make_endpoint_generator(
            args.url,
            model=args.model,
            temperature=args.temperature,
            top_p=args.top_p,
            max_tokens=args.max_tokens,
        )
    else:
        generate, cleanup = _hf_generator(args, tokenizer)
    with Scorer() as scorer:
        try:
            metrics = evaluate(
                problems,
                generate,
                scorer,
                k=args.k,
                pass_ks=tuple(k for k in args.pass_k if k <= args.k),
                dump_path=args.dump,
                prefix="",
            )
        finally:
            for fn in cleanup:
                fn()
    text = json.dumps(metrics, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


class _PlainTokenizer:
    """Stands in for a tokenizer when an endpoint gets plain prompt text (no ids needed)."""

    eos_token_id = None

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[0] for _ in texts]}

    def encode(self, text, add_special_tokens=True):
        return [0]
