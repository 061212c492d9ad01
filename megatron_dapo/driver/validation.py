"""Validation with the rollout engines: avg@k / pass@k / maj@k under the eval sampling protocol.

The same generator serves `megatron-dapo eval` (an HF engine on a checkpoint) and the trainer's
periodic validation (the training engines, right after a weight sync).
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from megatron_dapo.eval.runner import Completion, EpisodeCounts, EvalProblem, evaluate
from megatron_dapo.rollout.episodes import (
    EpisodeRunner,
    SingleTurn,
    reward_input,
    sampled_length,
    tools_kwargs,
)
from megatron_dapo.rollout.scoring import BROKEN_EPISODE
from megatron_dapo.rollout.types import EpisodeInfo, GenerationRequest, SamplingParams


def engine_generator(
    engines: Sequence[Any],
    tokenizer,
    sampling: SamplingParams,
    *,
    seed: int,
    requests_per_call: int = 64,
    calls_per_engine: int = 1,
    episodes: EpisodeRunner | None = None,
):
    """A `Generator` for `evaluate` that spreads k samples per problem over `engines`.

    Seeds depend on (seed, problem id, sample index) only, so a validation is reproducible and
    the same problem gets the same samples whatever the engine count. ``episodes``: the runner a
    training rollout uses (multi-turn tool use is validated with its tools, as it trains), one turn
    by default. An episode whose token check broke is unscored, as training leaves it
    (``val/unscored/broken_episode``), never scored on tokens that are not what was sampled.
    ``calls_per_engine``: calls of ``requests_per_call`` in flight on each engine at once; an
    engine batches concurrent calls, and one call at a time leaves it waiting at every call's
    last episodes (their later turns come as their tools answer).
    """
    runner = episodes or SingleTurn()

    def generate(problems: Sequence[EvalProblem], k: int) -> list[list[Completion]]:
        requests = []
        for p in problems:
            base = zlib.crc32(p.problem_id.encode()) ^ (seed * 0x9E3779B1 & 0xFFFFFFFF)
            for j in range(k):
                s = SamplingParams(
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    top_k=sampling.top_k,
                    max_new_tokens=sampling.max_new_tokens,
                    stop_token_ids=list(sampling.stop_token_ids),
                    seed=(base * 1_000_003 + j) % (2**63),
                )
                requests.append(
                    GenerationRequest(
                        f"val-{p.problem_id}-{j}", list(p.prompt_ids), s, tools_kwargs=tools_kwargs(p)
                    )
                )
        chunks = [requests[i : i + requests_per_call] for i in range(0, len(requests), requests_per_call)]
        with ThreadPoolExecutor(max(1, len(engines) * calls_per_engine)) as pool:
            parts = list(
                pool.map(
                    lambda ic: runner.run(engines[ic[0] % len(engines)], ic[1], threading.Event()),
                    enumerate(chunks),
                )
            )
        results = [r for part in parts for r in part]
        out: list[list[Completion]] = []
        for i, p in enumerate(problems):
            mine = results[i * k : (i + 1) * k]
            row = []
            for r in mine:
                text, extra = reward_input(r, tokenizer, p.extra_info)
                row.append(
                    Completion(
                        text,
                        sampled_length(r),
                        r.finish_reason == "length",
                        extra_info=None if r.episode is None else extra,
                        episode=None if r.episode is None else episode_counts(r.episode),
                        unscored=BROKEN_EPISODE if r.episode is not None and r.episode.broken else None,
                    )
                )
            out.append(row)
        return out

    return generate


def episode_counts(info: EpisodeInfo) -> EpisodeCounts:
    """An episode's model turns, the calls they wrote, and the calls answered by an error or a
    time-out, counted as the rollout's ``rollout/multiturn/*`` metrics count them."""
    turns = info.turns
    return EpisodeCounts(
        turns=sum(t.role == "assistant" for t in turns),
        tool_calls=sum(t.calls for t in turns if t.role == "assistant"),
        tool_errors=sum(t.errors for t in turns if t.role == "tool"),
        tool_timeouts=sum(t.timeouts for t in turns if t.role == "tool"),
    )


def val_sampling(cfg, tokenizer) -> SamplingParams:
    v = cfg.rollout.val
    eos = tokenizer.eos_token_id
    return SamplingParams(
        temperature=v.temperature,
        top_p=v.top_p,
        top_k=v.top_k,
        max_new_tokens=v.max_response_length or cfg.data.max_response_length,
        stop_token_ids=[] if eos is None else [int(eos)],
    )


def make_validator(cfg, engines, scorer, problems, tokenizer, episodes: EpisodeRunner | None = None):
    per_call = 64
    generate = engine_generator(
        engines,
        tokenizer,
        val_sampling(cfg, tokenizer),
        seed=cfg.trainer.seed,
        requests_per_call=per_call,
        calls_per_engine=max(1, cfg.rollout.max_concurrency_per_engine // per_call),
        episodes=episodes,
    )

    def validate(step: int) -> dict[str, float]:
        return evaluate(problems, generate, scorer, k=cfg.rollout.val.n, pass_ks=(1,))

    return validate
