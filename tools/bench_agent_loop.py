"""Benchmark the agent loop: how long a rollout of K-turn tool-use episodes takes against the
least any scheduler could take with the same draws.

The real rollout manager and the real episode runner (``agent.runner.MultiTurn`` over the real
chat-template bridge and Hermes call parser, on the calculator demo's character tokenizer, with
the ReTool recipe's ``rollout.multi_turn`` settings) drive stand-ins for what costs time:
- an engine with ``--slots`` sequences decoding at once (continuous batching: a request takes a
  free slot, waits for one when all are taken) at ``--token-ms`` per token per slot;
- a tool that sleeps the latency its call names, drawn from a log-normal (median
  ``--tool-median-s``, ``--tool-sigma``) cut at ``--tool-timeout-s`` (ReTool's sandbox time-out);
  the drawn latency travels in the call's arguments (``{"s": ...}``), as code that runs that long;
  as many calls at once as the recipe's ``tool_workers``.
Each episode's plan is drawn from its first request's seed alone: K model turns whose lengths are
log-normal around ``--turn-tokens``, each but the last ending in one tool call. So the draws do not
depend on the scheduling, and the ideal is computed from them alone: the longer of the longest
episode's own chain (its turns' tokens at one slot's speed plus its tools' latencies) and the
engine's total busy time (all tokens over all slots). One round keeps every group (dynamic
sampling off), so nothing is aborted; the stand-ins do not model a turn continued after an abort.

Times are the recipe's scaled by ``--time-scale`` (0.1: a second of the bench stands for ten):
before scaling, 20 ms a token per slot and 128 slots (an SGLang TP=4 engine of the 32B recipe
decoding ~100-150 responses at once), 700 tokens a model turn (the planner's 4096-token mean
response over ~5 turns), tools with a 0.5 s median and a 30 s time-out. ``--episodes`` 512 is one
engine's share of a ReTool step (8,192 episodes over 16 engines; the recipe's first dynamic-sampling
round is 24,576 over 32).

``--engine hf``: the same episodes through the real HF engine (a fresh tiny Qwen2 model of the
demo's shape, on CPU): each turn decodes its planned number of tokens (EOS ignored), then the
planned text replaces the sampled one so the episode goes as planned. Its per-token costs are
measured first, the quickest of ``--hf-repeats`` (one request alone for the chain; a full batch of
``--hf-batch`` for the busy time).

    python tools/bench_agent_loop.py [--episodes 512] [--turns 8] [--time-scale 0.1] [--slots 128]
    python tools/bench_agent_loop.py --engine hf --episodes 64 --turns 4 --turn-tokens 100

The last line is ``agent loop: rollout X s, ideal Y s, ratio R``. Wall times move with the
machine's load; the ratio less so.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_dapo.agent.bridge import ChatBridge  # noqa: E402
from megatron_dapo.agent.calls import get_call_format  # noqa: E402
from megatron_dapo.agent.runner import AppendOnly, MultiTurn, MultiTurnSettings  # noqa: E402
from megatron_dapo.config import load_config  # noqa: E402
from megatron_dapo.data.types import PromptSample  # noqa: E402
from megatron_dapo.demo.tokenizer import ASSISTANT, CHARACTERS, build_calculator_tokenizer  # noqa: E402
from megatron_dapo.rollout.manager import RolloutManager, RolloutManagerConfig  # noqa: E402
from megatron_dapo.rollout.types import GenerationRequest, GenerationResult, SamplingParams  # noqa: E402

RECIPE = REPO / "configs" / "retool_qwen2.5_32b.yaml"
TOOL = "run"
# the longest call text a turn ends with, so a planned turn is never shorter than its call
_CALL_ROOM = 80


# ---------------------------------------------------------------- the draws
@dataclass
class Plan:
    """One episode: its model turns' token counts and the latency of the tool call each makes."""

    turn_tokens: list[int]
    tool_s: list[float]  # one per turn but the last

    def chain_s(self, token_s: float) -> float:
        return sum(self.turn_tokens) * token_s + sum(self.tool_s)


def draw_plan(seed: int, args) -> Plan:
    rng = random.Random(seed)
    scale = args.time_scale
    lo, hi = _CALL_ROOM + 8, max(_CALL_ROOM + 8, int(args.turn_tokens * 4))
    tokens = [
        min(hi, max(lo, round(rng.lognormvariate(math.log(args.turn_tokens), args.turn_sigma))))
        for _ in range(args.turns)
    ]
    tools = [
        min(args.tool_timeout_s, rng.lognormvariate(math.log(args.tool_median_s), args.tool_sigma)) * scale
        for _ in range(args.turns - 1)
    ]
    return Plan(tokens, tools)


class Plans:
    """Which episode and turn a request is, and the planned tokens of that turn.

    An episode is known by its first request's seed: that turn writes ``e<seed>`` first, which every
    later request of the episode carries right after the prompt. The turn is the number of the
    model's end-of-turn tokens in the request's context."""

    def __init__(self, args, tokenizer):
        self.args, self.tok = args, tokenizer
        self.assistant = tokenizer.convert_tokens_to_ids(ASSISTANT)
        self.eot = tokenizer.eos_token_id
        # one id per character: a turn's ids are built here, not encoded (its 700 characters
        # would cost the stand-in more time than the loop it measures)
        self.char_ids = {c: tokenizer.convert_tokens_to_ids(c) for c in CHARACTERS}
        self.by_tag: dict[str, Plan] = {}
        self._lock = threading.Lock()

    def turn(self, q: GenerationRequest) -> tuple[Plan, int, list[int]]:
        ctx = q.prompt_ids
        k = ctx.count(self.eot)
        if k == 0:
            tag = f"e{q.sampling.seed}"
            with self._lock:
                plan = self.by_tag.setdefault(tag, draw_plan(q.sampling.seed, self.args))
        else:
            start = ctx.index(self.assistant) + 1
            tag = self.tok.decode(ctx[start : start + 16]).split(" ", 1)[0]
            plan = self.by_tag[tag]
        n = plan.turn_tokens[k]
        last = k == len(plan.tool_s)
        call = (
            "done"
            if last
            else "<tool_call>"
            + json.dumps({"name": TOOL, "arguments": {"s": round(plan.tool_s[k], 6)}})
            + "</tool_call>"
        )
        head = f"{tag} " if k == 0 else ""
        filler = [self.char_ids["x"]] * (n - 1 - len(head) - len(call))
        ids = [self.char_ids[c] for c in head] + filler + [self.char_ids[c] for c in call] + [self.eot]
        assert len(ids) == n, (len(ids), n)
        return plan, k, ids


# ---------------------------------------------------------------- the stand-ins
class SlotEngine:
    """A continuous-batching engine: ``slots`` sequences decode at once, each at ``token_s`` a
    token; a request waits for a free slot. ``abort`` ends the running ones where they are."""

    name = "bench-engine"

    def __init__(self, plans: Plans, slots: int, token_s: float):
        self.plans, self.token_s = plans, token_s
        self._slots = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="slot")
        self._abort = threading.Event()

    def _decode(self, q: GenerationRequest, on_result, aborted: threading.Event) -> GenerationResult:
        _, _, ids = self.plans.turn(q)
        ids = ids[: q.sampling.max_new_tokens]
        start = time.monotonic()
        if aborted.wait(len(ids) * self.token_s):
            done = min(len(ids), int((time.monotonic() - start) / self.token_s))
            return GenerationResult(q.request_id, ids[:done], [-0.5] * done, "abort", 0)
        finish = "stop" if ids[-1] == self.plans.eot else "length"
        res = GenerationResult(q.request_id, ids, [-0.5] * len(ids), finish, 0)
        if on_result is not None:
            on_result(res)
        return res

    def generate(self, requests, on_result=None):
        aborted = self._abort  # an abort reaches the calls in flight when it comes, not later ones
        futures = [self._slots.submit(self._decode, q, on_result, aborted) for q in requests]
        return [f.result() for f in futures]

    def abort(self):
        self._abort.set()
        self._abort = threading.Event()

    def health(self, check_process=True):
        return True

    def close(self):
        self._slots.shutdown(wait=False, cancel_futures=True)


class TimedHF:
    """The real HF engine doing each turn's decoding (its planned length, EOS ignored); the
    planned text then stands in for the sampled one, so the episode follows its plan."""

    name = "bench-hf"

    def __init__(self, plans: Plans, engine):
        self.plans, self.engine = plans, engine

    def generate(self, requests, on_result=None):
        planned = [self.plans.turn(q)[2] for q in requests]
        sent = [
            GenerationRequest(
                q.request_id,
                q.prompt_ids,
                SamplingParams(
                    temperature=1.0,
                    max_new_tokens=min(len(p), q.sampling.max_new_tokens),
                    seed=q.sampling.seed,
                    ignore_eos=True,
                ),
            )
            for q, p in zip(requests, planned)
        ]
        by_id = {q.request_id: p for q, p in zip(requests, planned)}

        def as_planned(r: GenerationResult) -> GenerationResult:
            if r.finish_reason == "abort":
                return r
            ids = by_id[r.request_id][: len(r.output_ids)]
            finish = "stop" if ids[-1] == self.plans.eot else "length"
            return GenerationResult(r.request_id, ids, [-0.5] * len(ids), finish, 0)

        def forward(r: GenerationResult) -> None:
            if on_result is not None:
                on_result(as_planned(r))

        return [as_planned(r) for r in self.engine.generate(sent, on_result=forward)]

    def abort(self):
        self.engine.abort()

    def health(self, check_process=True):
        return True

    def busy_s(self) -> float:
        """The seconds the HF engine spent decoding (its steps run one at a time)."""
        return self.engine.stats["busy_s"]

    def close(self):
        pass


@dataclass
class Answer:
    text: str
    status: str


class SleepTool:
    """A ``ToolRunner`` whose call runs for the seconds it names; at the time-out it stops and
    answers "timeout", as the tool host does. ``workers``: calls at once (the loop runs as many)."""

    def __init__(self, timeout_s: float, workers: int):
        self.timeout_s, self.workers = timeout_s, workers

    def call(self, episode_id, call, **_):  # the rest: per-sample tool arguments, unused here
        s = float(call.arguments["s"])
        if s >= self.timeout_s:
            time.sleep(self.timeout_s)
            return Answer(f"Error: timed out after {self.timeout_s:g} s", "timeout")
        time.sleep(s)
        return Answer(f"ran {s:.3f} s", "ok")

    def release(self, episode_id):
        pass

    def close(self):
        pass


class Prompts:
    def __init__(self, bridge: ChatBridge):
        self.bridge, self.cursor = bridge, 0

    def next_batch(self, k):
        out = []
        for i in range(self.cursor, self.cursor + k):
            ids = self.bridge.prompt_ids([{"role": "user", "content": f"q{i}"}])
            out.append(PromptSample(i, "bench", [], f"q{i}", ids, "done", {}))
        self.cursor += k
        return out


class Scorer:
    """Every episode's last turn says "done": all right, so no group is filtered either way."""

    @dataclass
    class Result:
        score: float
        acc: bool
        pred: str
        error: str | None = None

    def knows(self, source):
        return True

    def score_many(self, items):
        return [self.Result(1.0, True, "done") for _ in items]


# ---------------------------------------------------------------- one run
def settings(args):
    """The recipe's settings with the bench's sizes: one round of ``episodes // n`` groups."""
    groups = args.episodes // args.n
    overrides = {
        "model.path": "/models/none",
        "rollout.n": args.n,
        "rollout.gen_batch_size": groups,
        "trainer.train_batch_size": groups,
        "actor.ppo_mini_batch_size": groups,
        "algorithm.filter_groups.enable": "false",
        "algorithm.overlong_buffer.enable": "false",
        "rollout.multi_turn.max_assistant_turns": args.turns,
        "rollout.multi_turn.tool_timeout_s": args.tool_timeout_s * args.time_scale,
    }
    if args.groups_per_call is not None:
        overrides["rollout.groups_per_call"] = args.groups_per_call
    if args.seed is not None:  # every episode's plan is drawn from its request's seed
        overrides["trainer.seed"] = args.seed
    return load_config(str(RECIPE), [f"{k}={v}" for k, v in overrides.items()])


def run(args) -> dict:
    cfg = settings(args)
    tok = build_calculator_tokenizer()
    tok.model_max_length = 1 << 30  # episodes here are longer than the demo's
    plans = Plans(args, tok)
    mt = MultiTurnSettings.from_config(cfg, max_context=1 << 30)
    tools = SleepTool(cfg.rollout.multi_turn.tool_timeout_s, cfg.rollout.multi_turn.tool_workers)
    bridge = ChatBridge(tok)
    runner = MultiTurn(mt, AppendOnly(bridge), tools, get_call_format(cfg.rollout.multi_turn.format), tok)
    token_s = args.token_ms / 1000 * args.time_scale
    if args.engine == "hf":
        engine, chain_token_s, busy_token_s = hf_engine(args, tok, plans)
    else:
        engine, chain_token_s, busy_token_s = (
            SlotEngine(plans, args.slots, token_s),
            token_s,
            token_s / args.slots,
        )
    manager = RolloutManager([engine], Scorer(), RolloutManagerConfig.from_config(cfg), tok, episodes=runner)
    t0 = time.perf_counter()
    batch = manager.collect(Prompts(bridge), weight_version=0)
    wall = time.perf_counter() - t0
    measured_busy = engine.busy_s() if hasattr(engine, "busy_s") else None
    forwards = (
        engine.engine.stats["steps"] + engine.engine.stats["prefills"] if hasattr(engine, "busy_s") else None
    )
    engine.close()
    runner.close()

    # every episode must have gone as planned, or the ideal is not this rollout's
    off_plan = [s for s in batch.samples if not _as_planned(s, args.turns)]
    if len(plans.by_tag) != args.episodes or off_plan:
        ends = sorted({str((s.episode or {}).get("end")) for s in off_plan})
        raise SystemExit(
            f"episodes off their plan: {len(plans.by_tag)} planned of {args.episodes}, {len(off_plan)} "
            f"not {args.turns} turns ending 'stop' (ended {', '.join(ends)}; budgets too small for "
            "--turns x --turn-tokens?)"
        )
    chain = max(p.chain_s(chain_token_s) for p in plans.by_tag.values())
    tokens = sum(sum(p.turn_tokens) for p in plans.by_tag.values())
    busy = tokens * busy_token_s
    tool_total = sum(sum(p.tool_s) for p in plans.by_tag.values())
    return {
        "rollout_s": batch.metrics.get("rollout/time_s", wall),
        "chain_s": chain,
        "busy_s": busy,
        "measured_busy_s": measured_busy,
        "forwards": forwards,
        "tokens": tokens,
        "tool_calls": sum(len(p.tool_s) for p in plans.by_tag.values()),
        "tool_s": tool_total,
        "timeouts": sum(
            s >= cfg.rollout.multi_turn.tool_timeout_s for p in plans.by_tag.values() for s in p.tool_s
        ),
        "groups_per_call": cfg.rollout.groups_per_call,
        "tool_workers": tools.workers,
    }


def _as_planned(sample, turns: int) -> bool:
    """The episode took its K turns, ended on the last one's answer, and its tokens count."""
    episode = sample.episode or {}
    assistant = sum(t.get("role") == "assistant" for t in episode.get("turns", []))
    return episode.get("end") == "stop" and assistant == turns and any(sample.loss_mask or [1])


def hf_engine(args, tok, plans):
    """The real HF engine on a fresh tiny model, and its measured seconds per token: a request
    alone (an episode's own chain) and per sequence at a full batch (the engine's busy time)."""
    import torch

    from megatron_dapo.demo.model import TinyModelSpec, create_model
    from megatron_dapo.rollout.hf_engine import HFEngine

    torch.set_num_threads(args.hf_threads)
    spec = TinyModelSpec(max_position_embeddings=args.turns * (int(args.turn_tokens * 4) + 64) + 64)
    engine = HFEngine(model=create_model(spec, tok), max_batch_size=args.hf_batch)
    prompt = ChatBridge(tok).prompt_ids([{"role": "user", "content": "q"}])
    n = int(args.turn_tokens)

    def timed(rows: int) -> float:
        reqs = [
            GenerationRequest(
                f"c{i}", list(prompt), SamplingParams(max_new_tokens=n, seed=i, ignore_eos=True)
            )
            for i in range(rows)
        ]
        engine.generate(reqs)  # warm-up
        best = math.inf
        for _ in range(args.hf_repeats):  # the quickest: what the engine costs with least interference
            t = time.perf_counter()
            engine.generate(reqs)
            best = min(best, time.perf_counter() - t)
        return best / n

    alone, full = timed(1), timed(args.hf_batch) / args.hf_batch
    engine.stats.update(busy_s=0.0, steps=0, prefills=0)  # the rollout's own, from here
    print(
        f"hf engine: {alone * 1e3:.2f} ms a token alone, {full * 1e3:.2f} ms a token per row at batch {args.hf_batch}"
    )
    return TimedHF(plans, engine), alone, full


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("standin", "hf"), default="standin")
    ap.add_argument("--episodes", type=int, default=512)
    ap.add_argument("--n", type=int, default=16, help="episodes per group (rollout.n)")
    ap.add_argument("--turns", type=int, default=8, help="model turns per episode (K, up to 16)")
    ap.add_argument("--turn-tokens", type=float, default=700, help="median tokens of a model turn")
    ap.add_argument("--turn-sigma", type=float, default=0.5)
    ap.add_argument("--token-ms", type=float, default=20.0, help="ms a token per slot, before --time-scale")
    ap.add_argument("--slots", type=int, default=128, help="sequences the engine decodes at once")
    ap.add_argument("--tool-median-s", type=float, default=0.5)
    ap.add_argument("--tool-sigma", type=float, default=2.0)
    ap.add_argument("--tool-timeout-s", type=float, default=30.0)
    ap.add_argument("--time-scale", type=float, default=0.1)
    ap.add_argument("--groups-per-call", type=int, default=None, help="default: the recipe's")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--hf-threads", type=int, default=1)
    ap.add_argument("--hf-repeats", type=int, default=5, help="timings of each HF cost; the quickest is kept")
    ap.add_argument("--seed", type=int, default=None, help="trainer.seed; default: the recipe's")
    args = ap.parse_args(argv)
    if not 1 <= args.turns <= 16:
        ap.error(f"--turns must be 1..16, got {args.turns}")
    if args.episodes % args.n:
        ap.error(f"--episodes ({args.episodes}) must be a multiple of --n ({args.n})")
    print(
        f"{args.episodes} episodes x {args.turns} turns (median {args.turn_tokens:g} tokens) on one "
        + (
            f"engine of {args.slots} slots at {args.token_ms * args.time_scale:g} ms a token"
            if args.engine == "standin"
            else "HF engine"
        )
        + f"; tools log-normal (median {args.tool_median_s * args.time_scale:g} s, sigma {args.tool_sigma:g}) "
        f"cut at {args.tool_timeout_s * args.time_scale:g} s; time scale {args.time_scale:g}"
    )
    r = run(args)
    ideal = max(r["chain_s"], r["busy_s"])
    print(
        f"draws: {r['tokens']} tokens, {r['tool_calls']} tool calls ({r['timeouts']} at the time-out, "
        f"{r['tool_s']:.1f} s in all, {r['tool_s'] / r['tool_workers']:.1f} s over {r['tool_workers']} tool workers); "
        f"{r['groups_per_call']} group(s) per engine call"
    )
    print(f"ideal: longest episode's chain {r['chain_s']:.2f} s, engine busy {r['busy_s']:.2f} s")
    if r["measured_busy_s"] is not None:
        print(f"the engine decoded {r['measured_busy_s']:.2f} s of the rollout in {r['forwards']} forwards")
    print(
        f"agent loop: rollout {r['rollout_s']:.2f} s, ideal {ideal:.2f} s, ratio {r['rollout_s'] / ideal:.2f}"
    )


if __name__ == "__main__":
    main()
