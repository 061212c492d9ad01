"""Benchmark: chunked vocab-parallel log-probs + entropy vs the naive full-softmax version.

    python tools/bench_logprobs.py [--tokens 8192] [--vocab 152064] [--dtype bf16] [--forward-only]

Each variant runs in a fresh subprocess so peak memories do not mix. "Peak extra memory" is the
peak during the variant's forward (+ backward) minus the memory held once its inputs exist
(logits, targets, upstream gradients): on CUDA ``torch.cuda.max_memory_allocated``, on CPU the
process's peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``), whose baseline is the peak right after
the inputs were allocated and touched. The gradient of the logits (same size and dtype as the
logits) is part of both variants' extra memory. Time is the median of ``--repeats`` runs after
one warm-up. The naive variant is ``log_softmax(logits.float() / T).gather(...)`` and entropy
``-(p * logp).sum(-1)``, as verl computes them.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _peak_bytes(device) -> int:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def worker(args) -> dict:
    import torch

    from megatron_dapo.actor.logprobs import naive_logprobs, vocab_parallel_logprobs

    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    dtype = getattr(torch, DTYPES[args.dtype])
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(args.tokens, args.vocab, device=device, dtype=dtype, generator=gen)
    targets = torch.randint(0, args.vocab, (args.tokens,), device=device, generator=gen)
    g_lp = torch.randn(args.tokens, device=device, generator=gen)
    g_ent = torch.randn(args.tokens, device=device, generator=gen)
    logits.requires_grad_(not args.forward_only)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    baseline = _peak_bytes(device)

    def run():
        if args.variant == "naive":
            lp, ent = naive_logprobs(logits, targets, args.temperature)
        else:
            lp, ent = vocab_parallel_logprobs(
                logits, targets, temperature=args.temperature, chunk_bytes=args.chunk_mb << 20
            )
        if not args.forward_only:
            ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
            logits.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()
        return lp.detach()

    times = []
    with torch.set_grad_enabled(not args.forward_only):
        first = run()
        peak = _peak_bytes(device)
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    return {
        "variant": args.variant,
        "device": str(device),
        "extra_bytes": peak - baseline,
        "time_s": statistics.median(times),
        "checksum": float(first.double().sum()),
    }


def _spawn(variant: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant] + [
        f"--tokens={args.tokens}",
        f"--vocab={args.vocab}",
        f"--dtype={args.dtype}",
        f"--temperature={args.temperature}",
        f"--chunk-mb={args.chunk_mb}",
        f"--repeats={args.repeats}",
        f"--threads={args.threads}",
    ]
    cmd += ["--forward-only"] if args.forward_only else []
    cmd += ["--cpu"] if args.cpu else []
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=152064, help="Qwen2.5's (padded) vocabulary")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--chunk-mb", type=int, default=256, help="float32 working set of one chunk")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--forward-only", action="store_true", help="no backward (pi_old scoring)")
    p.add_argument("--cpu", action="store_true", help="stay on the CPU even when CUDA is present")
    p.add_argument("--worker", choices=("naive", "ours"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.variant = args.worker
        print(json.dumps(worker(args)))
        return 0
    naive, ours = _spawn("naive", args), _spawn("ours", args)
    gib = 1 << 30
    mode = "forward" if args.forward_only else "forward+backward"
    print(f"{args.tokens} tokens x {args.vocab} vocab, {args.dtype} logits, {mode}, {ours['device']}")
    for r in (naive, ours):
        print(
            f"  {r['variant']:>5}: peak extra {r['extra_bytes'] / gib:7.3f} GiB   time {r['time_s'] * 1e3:9.1f} ms"
        )
    print(
        f"  ratio ours/naive: memory {ours['extra_bytes'] / max(naive['extra_bytes'], 1):.3f}   "
        f"time {ours['time_s'] / naive['time_s']:.3f}"
    )
    if abs(naive["checksum"] - ours["checksum"]) > 1e-3 * max(1.0, abs(naive["checksum"])):
        print(f"  WARNING: results differ (sum of log-probs {naive['checksum']} vs {ours['checksum']})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
