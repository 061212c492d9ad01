"""Benchmark scoring each response as it completes against scoring a call's responses when the
call returns: the rollout's wall time with a served reward model whose capacity is the limit.

The real rollout manager (its scheduling, scoring threads and metrics) over stand-ins, so the
figures are of the scheduling alone, not of a model:
- an engine whose responses in a call complete at seeded, long-tailed times (a log-normal spread
  cut at --longest-s, as response lengths are), handing each over as it completes (per response)
  or not at all (per call: the responses reach scoring when the call returns, this project's
  behaviour before scoring per response);
- a reward model that takes --latency-s per response with at most --in-flight requests at once
  (its servers' capacity).
Prints, for each mode, the rollout's wall time, ``reward/hidden_fraction`` and
``reward/early_fraction`` (median over --repeats), and the ratio per call / per response.

    python tools/bench_scoring_overlap.py [--groups 16] [--n 16] [--longest-s 2] [--latency-s 0.1]
                                          [--in-flight 16] [--repeats 3]

The ratio depends on those settings: scoring hides behind generation only while there is
generation left to hide behind. Run it on a quiet machine; the figures move with load.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_dapo.config import load_config  # noqa: E402
from megatron_dapo.data.types import PromptSample  # noqa: E402
from megatron_dapo.rewards.served import ScoreOutcome  # noqa: E402
from megatron_dapo.rollout.manager import RolloutManager, RolloutManagerConfig  # noqa: E402
from megatron_dapo.rollout.types import GenerationResult  # noqa: E402


class Prompts:
    def __init__(self):
        self.cursor = 0

    def next_batch(self, k):
        out = [
            PromptSample(i, "bench", [], f"q{i}", [1, 2, i], "a", {})
            for i in range(self.cursor, self.cursor + k)
        ]
        self.cursor += k
        return out


class Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "a" if ids[0] % 2 else "b"


class RuleStandIn:
    def knows(self, source):
        return False

    def score_many(self, items):
        raise AssertionError("the model alone scores here")


class StaggeredEngine:
    """Response j of a call completes at a seeded time; handed over then when ``hand_over``."""

    name = "bench-engine"

    def __init__(self, longest_s: float, hand_over: bool):
        self.longest_s, self.hand_over = longest_s, hand_over

    def generate(self, requests, on_result=None):
        start = time.monotonic()
        due = []
        for r in requests:
            rng = random.Random(r.sampling.seed)
            due.append((min(rng.lognormvariate(-1.5, 0.8), 1.0) * self.longest_s, r))
        out = {}
        for at, r in sorted(due, key=lambda x: x[0]):
            time.sleep(max(0.0, start + at - time.monotonic()))
            res = GenerationResult(r.request_id, [r.sampling.seed % 7 + 1, 5], [-0.5, -0.5], "stop", 0)
            out[r.request_id] = res
            if self.hand_over and on_result is not None:
                on_result(res)
        return [out[r.request_id] for r in requests]

    def abort(self):
        pass

    def health(self, check_process=True):
        return True


class LimitedJudge:
    """``latency_s`` per response, at most ``in_flight`` at once (the servers' capacity)."""

    kind = "judge"

    def __init__(self, latency_s: float, in_flight: int):
        self.latency_s, self.concurrency = latency_s, in_flight
        self._slots = threading.Semaphore(in_flight)

    def score(self, sample):
        with self._slots:
            time.sleep(self.latency_s)
        score = 1.0 if sample.response == "a" else -1.0
        return ScoreOutcome(sample.sample_id, score, None, "", None, "yes", "", 1, self.latency_s)

    def check_down(self):
        pass


def run(args, hand_over: bool) -> dict:
    # the schema's defaults, with the knobs that shape this rollout: one round, every group kept
    overrides = {
        "model.path": "/models/none",
        "rollout.n": args.n,
        "rollout.gen_batch_size": args.groups,
        "trainer.train_batch_size": args.groups,
        "actor.ppo_mini_batch_size": args.groups,
        "rollout.groups_per_call": 1,
        "rollout.max_concurrency_per_engine": args.groups * args.n,
        "algorithm.filter_groups.enable": "false",
        "algorithm.overlong_buffer.enable": "false",
    }
    cfg = RolloutManagerConfig.from_config(load_config(None, [f"{k}={v}" for k, v in overrides.items()]))
    judge = LimitedJudge(args.latency_s, args.in_flight)
    manager = RolloutManager(
        [StaggeredEngine(args.longest_s, hand_over)], RuleStandIn(), cfg, Tokenizer(), reward_model=judge
    )
    m = manager.collect(Prompts(), weight_version=0).metrics
    return {k: m[k] for k in ("rollout/time_s", "reward/hidden_fraction", "reward/early_fraction")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--longest-s", type=float, default=2.0)
    ap.add_argument("--latency-s", type=float, default=0.1)
    ap.add_argument("--in-flight", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(
        f"{args.groups} groups x {args.n} responses, one call per group, completing over up to "
        f"{args.longest_s:g} s; the judge: {args.latency_s:g} s a response, {args.in_flight} at once"
    )
    rows = {}
    for label, hand_over in (("per call", False), ("per response", True)):
        runs = [run(args, hand_over) for _ in range(args.repeats)]
        rows[label] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        spread = [round(r["rollout/time_s"], 2) for r in runs]
        print(
            f"{label:>13}: rollout {rows[label]['rollout/time_s']:.2f} s (runs {spread}), "
            f"hidden_fraction {rows[label]['reward/hidden_fraction']:.2f}, "
            f"early_fraction {rows[label]['reward/early_fraction']:.2f}"
        )
    ratio = rows["per call"]["rollout/time_s"] / rows["per response"]["rollout/time_s"]
    print(f"rollout time, per call / per response: {ratio:.2f}x")


if __name__ == "__main__":
    main()
