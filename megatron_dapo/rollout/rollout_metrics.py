"""The rollout manager's metrics: what one ``collect`` did (``rollout/*``)."""

from __future__ import annotations

import math
from typing import Any

from megatron_dapo.rollout.engine_pool import EnginePool
from megatron_dapo.rollout.ledger import Ledger
from megatron_dapo.rollout.types import EpisodeInfo, RolloutSample

# rollout metrics that measure time or race the abort; every other one is a function of
# (seed, config, weights) alone
TIMING_DEPENDENT_METRICS = (
    "rollout/surplus",
    "rollout/aborted",
    "rollout/retries",
    "rollout/time_s",
    "rollout/gen_time_s",
    "rollout/wait_time_s",
    "rollout/engine_busy_fraction",
    "rollout/tokens_per_s",
    "rollout/tokens_generated",
    "reward/score_time_s",
    "reward/hidden_fraction",
    "reward/early_fraction",
)


def rollout_metrics(
    cfg: Any, pool: EnginePool, samples: list[RolloutSample], ledger: Ledger, wall: float, version: int
) -> dict[str, float]:
    """The ``rollout/*`` metrics of one ``collect``: the buckets of the ledger, the engines'
    state, timing and throughput, and the batch's lengths and rewards."""
    lengths = [s.response_length for s in samples]
    all_intervals = [iv for ivs in ledger.intervals.values() for iv in ivs]
    gen_time = union_length(all_intervals)
    busy = [union_length(ivs) / wall if wall > 0 else 0.0 for ivs in ledger.intervals.values()]
    m = {
        "rollout/gen_rounds": ledger.rounds,
        "rollout/prompts_drawn": ledger.drawn - ledger.resumed,  # new prompts from the data
        "rollout/groups_in_batch": len(samples) // cfg.n,
        "rollout/keep_rate": len(ledger.kept) / ledger.scored_groups if ledger.scored_groups else 0.0,
        "rollout/unused": ledger.surplus + ledger.aborted,
        "rollout/filtered_all_correct": ledger.filtered["all_correct"],
        "rollout/filtered_all_wrong": ledger.filtered["all_wrong"],
        "rollout/filtered_other": ledger.filtered["other"],
        "rollout/filtered_unscored": ledger.filtered["unscored"],
        # responses the reward model could not score (timeout, 5xx, unparseable, down): left out
        # of their groups, never scored 0
        "reward/unscored": float(sum(ledger.unscored.values())),
        "rollout/zero_spread_fraction": (
            ledger.zero_spread / ledger.scored_groups if ledger.scored_groups else 0.0
        ),
        "rollout/surplus": ledger.surplus,
        "rollout/aborted": ledger.aborted,
        "rollout/retries": ledger.retries,
        "rollout/engines_down": len(pool.down),
        # found hung this step with calls in flight; and the down engines this run cannot
        # restart (given by URL), which it goes on without
        "rollout/engines_hung": len(ledger.hung),
        "rollout/engines_lost": pool.lost_count(),
        "rollout/partial_batch": float(len(samples) < cfg.train_batch_size * cfg.n),
        "rollout/time_s": wall,
        "rollout/gen_time_s": gen_time,
        "rollout/wait_time_s": max(wall - gen_time, 0.0),
        "rollout/engine_busy_fraction": sum(busy) / len(busy),
        "rollout/tokens_per_s": ledger.tokens / gen_time if gen_time > 0 else 0.0,
        # every token an engine returned, once (a retried or continued request adds only
        # what it generated after the tokens kept from before)
        "rollout/tokens_generated": ledger.tokens,
    }
    if cfg.partial:
        m.update(partial_metrics(samples, ledger, version))
    generated = generated_samples(ledger)
    if any(s.episode is not None for s in samples):
        m.update(multiturn_metrics(samples, generated))
    m.update(reward_metrics(samples, ledger, all_intervals))
    # over every response of the groups scored up to the cut (those the filter dropped too: a
    # reward that fails makes its groups all-wrong, and they never reach the batch)
    m["rollout/reward_errors"] = sum(s.reward_error is not None for s in generated)
    if samples:
        n = len(samples)
        scored = [s for s in samples if s.unscored is None]  # rewards of the scored ones only
        k = max(len(scored), 1)
        m.update(
            {
                "rollout/response_length/mean": sum(lengths) / n,
                "rollout/response_length/max": max(lengths),
                "rollout/response_length/min": min(lengths),
                # verl: share of responses that used the whole budget
                "rollout/response_length/clip_ratio": sum(x >= cfg.max_response_length for x in lengths) / n,
                "rollout/truncation_rate": sum(s.truncated for s in samples) / n,
                "rollout/reward/mean": sum(s.final_reward for s in scored) / k,
                "rollout/score/mean": sum(s.score for s in scored) / k,
                "rollout/acc/mean": sum(s.acc for s in scored) / k,
                "rollout/overlong_penalty/mean": sum(s.overlong_penalty for s in samples) / n,
            }
        )
    return m


def generated_samples(ledger: Ledger) -> list[RolloutSample]:
    """Every response of the groups scored up to the cut (or of all drawn, without one), in
    draw order: the batch's and the filtered groups' alike. Call after ``ledger.settle()``."""
    return [s for serial in range(ledger.scored_groups) for s in ledger.groups[serial].samples or []]


def reward_metrics(
    samples: list[RolloutSample], ledger: Ledger, gen_intervals: list[tuple[float, float]]
) -> dict[str, float]:
    """``reward/*``: the reward's components over the batch (the rule's and the model's mean,
    where computed), the responses left unscored by reason (in every group scored up to the cut,
    most of them dropped from the batch with their group), and the scoring time, with the share
    of it that ran while an engine was still generating (hidden behind generation), and the share
    of responses whose reward started before their engine call returned (``early_fraction``: the
    engine handed each over as it completed). With a served
    model, ``reward/<kind>_*`` (kind: classifier or judge) over every response it was asked to
    score this step: requests sent (retries included), retries, latency per response (mean, max,
    back-off included) and, for a judge, the verdict's length in characters."""
    m: dict[str, float] = {}
    rule = [s.rule_score for s in samples if s.rule_score is not None]
    model = [s.model_score for s in samples if s.model_score is not None]
    if rule:
        m["reward/rule_mean"] = sum(rule) / len(rule)
    if model:
        m["reward/model_mean"] = sum(model) / len(model)
    for reason, count in ledger.unscored.items():
        m[f"reward/unscored_{reason}"] = float(count)
    m.update(served_model_metrics(ledger.model_outcomes))
    scoring = union_length(ledger.score_intervals)
    m["reward/score_time_s"] = scoring
    if ledger.scored_responses:  # scored while the rest of their call still generated
        m["reward/early_fraction"] = ledger.scored_early / ledger.scored_responses
    if scoring > 0:
        hidden = sum(union_length(_clip(gen_intervals, a, b)) for a, b in _merged(ledger.score_intervals))
        m["reward/hidden_fraction"] = hidden / scoring
    return m


def served_model_metrics(outcomes: list[tuple[str, Any]]) -> dict[str, float]:
    """``reward/<kind>_*`` from ``(kind, ScoreOutcome)`` pairs (see :func:`reward_metrics`)."""
    m: dict[str, float] = {}
    for kind in sorted({k for k, _ in outcomes}):
        mine = [o for k, o in outcomes if k == kind]
        latency = [o.elapsed_s for o in mine]
        m[f"reward/{kind}_requests"] = float(sum(o.attempts for o in mine))
        m[f"reward/{kind}_retries"] = float(sum(max(o.attempts - 1, 0) for o in mine))
        # answered 429 (rate limited) or 408: retried after their Retry-After
        m[f"reward/{kind}_throttled"] = float(sum(getattr(o, "throttled", 0) for o in mine))
        if kind == "judge":  # prompts cut to fit the judge's context (reward.model.too_long=cut)
            m["reward/judge_inputs_cut"] = float(sum(getattr(o, "cut_tokens", 0) > 0 for o in mine))
        m[f"reward/{kind}_latency_mean_s"] = sum(latency) / len(latency)
        m[f"reward/{kind}_latency_max_s"] = max(latency)
        verdicts = [len(o.verdict) for o in mine if o.verdict is not None]
        if kind == "judge" and verdicts:
            m["reward/judge_verdict_chars_mean"] = sum(verdicts) / len(verdicts)
    return m


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _clip(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo)]


def multiturn_metrics(
    samples: list[RolloutSample], generated: list[RolloutSample] | None = None
) -> dict[str, float]:
    """``rollout/multiturn/*`` over the batch's episodes: model turns and tool calls per episode,
    environment tokens per episode, the episodes the token check kept out of the loss (a prefix
    break; a difference from the template's re-rendering), and those that ended at the turn limit;
    the tool calls answered by an error or a time-out over every episode ``generated`` (default:
    the batch's), the filtered groups' included: a tool that always fails makes its groups
    all-wrong, and they never reach the batch."""
    episodes = [EpisodeInfo.from_dict(s.episode) for s in samples if s.episode is not None]
    n = max(len(episodes), 1)
    turns = [t for e in episodes for t in e.turns]
    every = (
        turns
        if generated is None
        else [t for s in generated if s.episode is not None for t in EpisodeInfo.from_dict(s.episode).turns]
    )
    return {
        "rollout/multiturn/turns_mean": sum(t.role == "assistant" for t in turns) / n,
        "rollout/multiturn/tool_calls_mean": sum(t.calls for t in turns if t.role == "assistant") / n,
        "rollout/multiturn/tool_errors": float(sum(t.errors for t in every if t.role == "tool")),
        "rollout/multiturn/tool_timeouts": float(sum(t.timeouts for t in every if t.role == "tool")),
        "rollout/multiturn/env_tokens_mean": sum(t.end - t.start for t in turns if t.role == "tool") / n,
        "rollout/multiturn/prefix_breaks": float(sum(e.prefix_breaks for e in episodes)),
        "rollout/multiturn/rerender_mismatches": float(sum(e.rerender_mismatches for e in episodes)),
        "rollout/multiturn/ended_turns": float(sum(e.end == "turns" for e in episodes)),
    }


def partial_metrics(samples: list[RolloutSample], ledger: Ledger, version: int) -> dict[str, float]:
    """rollout.partial: groups carried in and out, tokens kept across the cut or dropped as too
    stale, the share of the batch's responses that were interrupted and continued, and the
    batch's tokens by how many versions older than this rollout's weights generated them."""
    m = {
        "rollout/partial_groups_resumed": float(ledger.resumed),
        "rollout/partial_groups_carried": float(len(ledger.carry_out)),
        "rollout/partial_tokens_carried": float(sum(g.tokens() for g in ledger.carry_out)),
        "rollout/partial_tokens_restarted": float(ledger.restarted_tokens),
        "rollout/partial_sample_fraction": (
            sum(s.interrupted > 0 for s in samples) / len(samples) if samples else 0.0
        ),
    }
    unknown = 0
    for s in samples:
        if s.token_versions is None:
            unknown += s.response_length
            continue
        for v in s.token_versions:
            key = f"rollout/tokens_version_lag_{version - v}"
            m[key] = m.get(key, 0.0) + 1.0
    m["rollout/tokens_version_unknown"] = float(unknown)
    return m


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total
