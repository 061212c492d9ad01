"""Benchmark the HF engine's prefix reuse: an episode's second turn restoring its first prompt's
keys and values (``GenerationRequest.prefix_lengths``) against prefilling its whole context again.

The calculator demo's shape by default: --episodes episodes in groups of 8 (a group's samples share
their prompt), a first turn of 31 prompt + 11 sampled tokens, a tool answer of 18 tokens, a second
turn of 14 tokens. Each round sends every first turn in one call, then every second turn in one
call, once with the prefix lengths and once without (alternating, --repeats times each), on one
engine of --frame positions and one thread, and times the second turns. The sampled tokens of the
two ways must be equal (segments or one prefill give the same numbers on this machine; a machine
where they do not only shows a difference here, not an error). Prints one row per round, the
medians, and as its last line ``prefix reuse: second turns X s reused, Y s recomputed, ratio R``.

    python tools/bench_prefix_reuse.py [--repeats 3] [--episodes 512] [--model DIR]

Without --model it builds the tests' small demo assets (5 warm-start steps) in a temporary
directory. Not a test: run it on a quiet machine; the figures move with load.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.bench_sglang_idle import demo_model  # noqa: E402


def round_trip(engine, first, tool_ids, reuse: bool, second_tokens: int):
    """First turns, then second turns with or without their prefix lengths; the second turns'
    wall time and sampled tokens."""
    from megatron_dapo.rollout.types import GenerationRequest, SamplingParams

    results = engine.generate(first)
    second = [
        GenerationRequest(
            f"{q.request_id}/t1",
            q.prompt_ids + r.output_ids + tool_ids[i],
            SamplingParams(temperature=1.0, max_new_tokens=second_tokens, seed=10_000 + i, ignore_eos=True),
            prefix_lengths=(len(q.prompt_ids),) if reuse else None,
        )
        for i, (q, r) in enumerate(zip(first, results))
    ]
    t0 = time.perf_counter()
    out = engine.generate(second)
    return time.perf_counter() - t0, [r.output_ids for r in out]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--episodes", type=int, default=512)
    p.add_argument("--frame", type=int, default=96)
    p.add_argument("--model", type=Path, default=None)
    args = p.parse_args()

    import torch

    from megatron_dapo.rollout.hf_engine import HFEngine
    from megatron_dapo.rollout.types import GenerationRequest, SamplingParams

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = demo_model(Path(tmp), args.model)
        engine = HFEngine(model, max_batch_size=args.episodes, frame=args.frame)
        vocab = engine.model.config.vocab_size
        rng = random.Random(0)
        prompts = [[rng.randrange(5, vocab) for _ in range(31)] for _ in range(-(-args.episodes // 8))]
        first = [
            GenerationRequest(
                f"e{i}",
                prompts[i // 8],
                SamplingParams(temperature=1.0, max_new_tokens=11, seed=i, ignore_eos=True),
                prefix_lengths=(),
            )
            for i in range(args.episodes)
        ]
        tool_ids = [[rng.randrange(5, vocab) for _ in range(18)] for _ in range(args.episodes)]
        round_trip(engine, first[:16], tool_ids, True, 14)  # warm-up
        times: dict[bool, list[float]] = {True: [], False: []}
        tokens: dict[bool, list] = {}
        for k in range(args.repeats):
            for reuse in (True, False) if k % 2 == 0 else (False, True):
                s, out = round_trip(engine, first, tool_ids, reuse, 14)
                times[reuse].append(s)
                tokens[reuse] = out
                print(f"round {k}: second turns {'reused' if reuse else 'recomputed'} {s:.3f} s", flush=True)
        if tokens[True] != tokens[False]:
            print("the sampled tokens differ between the two ways on this machine")
        reused, again = statistics.median(times[True]), statistics.median(times[False])
        print(f"medians over {args.repeats}: reused {reused:.3f} s, recomputed {again:.3f} s")
        print(
            f"prefix reuse: second turns {reused:.3f} s reused, {again:.3f} s recomputed, ratio {reused / again:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
