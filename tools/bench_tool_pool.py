"""Benchmark the tool workers under load: one turn of --episodes episodes, each calling a tool that
waits --sleep-s, through the real episode loop (MultiTurn) and tool host (ToolHost, one process per
worker), for each --workers count.

Prints, per worker count, the turn's wall time (workers started beforehand, as in a run after its
first turn), the ideal ceil(episodes / workers) * sleep, and the workers' mean resident memory.

    python tools/bench_tool_pool.py [--episodes 512] [--sleep-s 1] [--workers 64 512]

A tool that waits rather than computes (a web search, a remote sandbox) is what this measures: the
workers then share no cores. Run it where there are cores and memory for the largest count.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_dapo.agent.runner import AppendOnly, MultiTurn, MultiTurnSettings  # noqa: E402
from megatron_dapo.agent.tools.host import ToolHost  # noqa: E402
from megatron_dapo.agent.tools.spec import ToolSpec  # noqa: E402
from megatron_dapo.rollout.types import GenerationRequest, GenerationResult, SamplingParams  # noqa: E402

TOOL = """
import time


def wait(seconds):
    time.sleep(float(seconds))
    return "done"
"""


@dataclass
class _Call:
    name: str
    arguments: dict
    error: str | None = None


class _Calls:
    def __init__(self, sleep_s: float):
        self.sleep_s = sleep_s

    def parse(self, text):
        return [_Call("wait", {"seconds": self.sleep_s})] if "[" in text else []


class _Chat:
    end_of_turn_ids = [ord("$")]

    def env_ids(self, messages, *, ended_with_eot=True):
        return [ord(c) for m in messages for c in f"<{m['content']}>"]

    def truncate(self, text, max_tokens, side):
        return text[:max_tokens]


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


class _Engine:
    """Turn 0 calls the tool; the turn after the answer stops."""

    name = "bench"

    def generate(self, requests, on_result=None):
        out = []
        for q in requests:
            ids = [ord(c) for c in ("[w]$" if q.request_id.endswith("/t0") else "ok$")]
            out.append(GenerationResult(q.request_id, ids, [0.0] * len(ids), "stop", weight_version=0))
        return out


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run(episodes: int, sleep_s: float, workers: int, tool_file: Path) -> tuple[float, float]:
    spec = ToolSpec(
        name="wait",
        kind="function",
        target=f"{tool_file}:wait",
        schema={
            "type": "function",
            "function": {
                "name": "wait",
                "parameters": {"type": "object", "properties": {"seconds": {"type": "number"}}},
            },
        },
    )
    host = ToolHost([spec], timeout_s=sleep_s * episodes + 60, workers=workers, memory_mb=1024)
    settings = MultiTurnSettings(
        max_assistant_turns=2,
        max_turn_tokens=None,
        max_tool_response_tokens=50,
        tool_response_truncate_side="right",
        max_parallel_calls=1,
    )
    loop = MultiTurn(settings, AppendOnly(_Chat()), host, _Calls(sleep_s), _Tokenizer())
    requests = [
        GenerationRequest(f"e{i}", [ord("Q")], SamplingParams(max_new_tokens=40)) for i in range(episodes)
    ]
    try:
        host.start(timeout_s=600)
        start = time.perf_counter()
        results = loop.run(_Engine(), requests, threading.Event())
        wall = time.perf_counter() - start
        rss = [_rss_mb(w.proc.pid) for w in host._pool if w.proc is not None]
    finally:
        loop.close()
    bad = sum(r.episode.turns[1].errors + r.episode.turns[1].timeouts for r in results)
    if bad:
        raise SystemExit(f"{bad} tool calls failed")
    return wall, sum(rss) / max(1, len(rss))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=512)
    ap.add_argument("--sleep-s", type=float, default=1.0)
    ap.add_argument("--workers", type=int, nargs="+", default=[64, 512])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tool_file = Path(tmp) / "wait_tool.py"
        tool_file.write_text(TOOL)
        for workers in args.workers:
            wall, rss = run(args.episodes, args.sleep_s, workers, tool_file)
            ideal = math.ceil(args.episodes / workers) * args.sleep_s
            print(
                f"{args.episodes} episodes x {args.sleep_s:g} s tool, {workers} workers: turn {wall:.2f} s "
                f"(ideal {ideal:g} s), worker RSS {rss:.0f} MiB each"
            )


if __name__ == "__main__":
    main()
