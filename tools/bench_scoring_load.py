"""Benchmark a served judge's scoring under load: responses scored per second with a thread held
per response (how the rollout manager scored before: a pool of up to 256 threads, each blocked
on the client's loop) against a coroutine per response on that loop (``submit``, how it scores
now), in one run, against the same stand-in judge.

The stand-in judge is a separate process (its own interpreter, so it does not share the client's
GIL): an asyncio HTTP server that answers ``POST /v1/chat/completions`` with "yes" after
--latency-s, any number at once. The client is the real one (``BlockingRewardModel``, the
OpenAI-compatible API, ``max_in_flight`` = --in-flight) and every response is scored through it;
the figures are of the client side alone (no rollout, no rule reward).

    python tools/bench_scoring_load.py [--responses 4096] [--latency-s 0.05] [--in-flight 512]
                                       [--threads 256] [--repeats 3]

Prints, per mode, scored responses per second (median over --repeats, each mode in turn) and the
ratio coroutines / threads. Run it on a quiet machine; the figures move with load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_dapo.config.schema import RewardModelConfig  # noqa: E402
from megatron_dapo.rewards.served import BlockingRewardModel, RewardSample, ServedRewardSettings  # noqa: E402

ANSWER = json.dumps(
    {"choices": [{"index": 0, "message": {"role": "assistant", "content": "yes"}, "finish_reason": "stop"}]}
).encode()
MODELS = json.dumps({"object": "list", "data": [{"id": "standin"}]}).encode()


async def _serve(port: int, latency_s: float) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                if length:
                    await reader.readexactly(length)
                body = MODELS if head.startswith(b"GET") else ANSWER
                if not head.startswith(b"GET"):
                    await asyncio.sleep(latency_s)
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                    + str(len(body)).encode()
                    + b"\r\n\r\n"
                    + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


def _judge_process(latency_s: float) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        f"import asyncio, sys; sys.path.insert(0, {str(REPO / 'tools')!r}); import bench_scoring_load as b; "
    )
    code += f"asyncio.run(b._serve({port}, {latency_s}))"
    proc = subprocess.Popen([sys.executable, "-c", code])
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, url
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the stand-in judge did not start")


def _samples(n: int) -> list[RewardSample]:
    return [RewardSample(i, [{"role": "user", "content": f"q{i}"}], f"answer {i}", "42") for i in range(n)]


def threads(model: BlockingRewardModel, samples: list[RewardSample], workers: int) -> float:
    """Before: each response's score waited on by a thread of its own (at most ``workers``)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        outcomes = list(pool.map(model.score, samples))
    elapsed = time.perf_counter() - start
    assert all(o.scored for o in outcomes), [o for o in outcomes if not o.scored][:1]
    return len(samples) / elapsed


def coroutines(model: BlockingRewardModel, samples: list[RewardSample]) -> float:
    """Now: each response a coroutine on the client's loop, no thread waiting on it."""
    start = time.perf_counter()
    futures = [model.submit(s) for s in samples]
    wait(futures)
    elapsed = time.perf_counter() - start
    assert all(f.result().scored for f in futures)
    return len(samples) / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--responses", type=int, default=4096)
    parser.add_argument("--latency-s", type=float, default=0.05)
    parser.add_argument("--in-flight", type=int, default=512)
    parser.add_argument(
        "--threads", type=int, default=256, help="the thread-per-response mode's pool (its old cap)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    proc, url = _judge_process(args.latency_s)
    try:
        settings = ServedRewardSettings(
            RewardModelConfig(kind="judge", url=url, max_in_flight=args.in_flight, timeout_s=120.0)
        )
        samples = _samples(args.responses)
        rates: dict[str, list[float]] = {"threads": [], "coroutines": []}
        with BlockingRewardModel(settings) as model:
            model.score_many(samples[:64])  # connections opened, the loop warm
            for _ in range(args.repeats):
                rates["threads"].append(threads(model, samples, min(args.threads, args.in_flight)))
                rates["coroutines"].append(coroutines(model, samples))
    finally:
        proc.kill()
        proc.wait()
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(
        f"judge {args.latency_s * 1000:g} ms, {args.in_flight} in flight, {args.responses} responses, "
        f"median of {args.repeats}:"
    )
    print(
        f"  thread per response ({min(args.threads, args.in_flight)} threads): {med['threads']:.0f} responses/s"
    )
    print(f"  coroutine per response: {med['coroutines']:.0f} responses/s")
    print(f"coroutines / threads: {med['coroutines'] / med['threads']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
