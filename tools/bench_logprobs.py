"""Benchmark: the output layer + log-probs + entropy three ways, forward and backward, in one run.

    python tools/bench_logprobs.py [--tokens 2048] [--vocab 32768] [--hidden 256] [--dtype fp32]
                                   [--chunks 256,512,1024] [--forward-only] [--cpu]

- naive: ``logits = hidden @ weight.T``, then ``log_softmax(logits.float() / T).gather(...)`` and
  entropy ``-(p * logp).sum(-1)``, as verl computes them;
- chunked: the same logits, then the chunked vocab-parallel kernel
  (``actor/logprobs.vocab_parallel_logprobs``, the actor's kernel before the fused one);
- fused: ``actor/logprobs.fused_linear_logprobs``, the output layer inside the kernel, chunks of
  ``--chunk-tokens`` tokens, logits recomputed in the backward (the actor's path now).

Every variant back-propagates into both the hidden states and the output weight. Each runs in a
fresh subprocess so peak memories do not mix. "Peak extra memory" is the peak during the
variant's forward (+ backward) minus the memory held once its inputs exist (hidden, weight,
targets, upstream gradients): on CUDA ``torch.cuda.max_memory_allocated``, on CPU the process's
peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``), whose baseline is the peak right after the
inputs were allocated and touched. The gradients of hidden and weight are part of every
variant's extra memory. Time is the median of ``--repeats`` runs after one warm-up. Memory and
time are printed as ratios to naive. ``--chunks`` adds one fused run per chunk size (how the
default ``actor.logprob_chunk_tokens`` was chosen).

The default shape is a small CPU one (minutes on a loaded 2-core machine). The issue's GPU shape, Qwen2.5-1.5B's output
layer at 16k tokens, is ``--tokens 16384 --vocab 151936 --hidden 1536 --dtype bf16`` on CUDA; it
has not been measured with this version of the tool.
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
VARIANTS = ("naive", "chunked", "fused")


def _peak_bytes(device) -> int:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def worker(args) -> dict:
    import torch

    from megatron_dapo.actor.logprobs import fused_linear_logprobs, naive_logprobs, vocab_parallel_logprobs

    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    dtype = getattr(torch, DTYPES[args.dtype])
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, generator=gen)
    weight = torch.randn(args.vocab, args.hidden, device=device, dtype=dtype, generator=gen)
    weight.mul_(args.hidden**-0.5)
    targets = torch.randint(0, args.vocab, (args.tokens,), device=device, generator=gen)
    g_lp = torch.randn(args.tokens, device=device, generator=gen)
    g_ent = torch.randn(args.tokens, device=device, generator=gen)
    hidden.requires_grad_(not args.forward_only)
    weight.requires_grad_(not args.forward_only)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    baseline = _peak_bytes(device)

    def run():
        if args.variant == "fused":
            lp, ent = fused_linear_logprobs(
                hidden, weight, targets, temperature=args.temperature, chunk_tokens=args.chunk_tokens
            )
        elif args.variant == "chunked":
            lp, ent = vocab_parallel_logprobs(hidden @ weight.t(), targets, temperature=args.temperature)
        else:
            lp, ent = naive_logprobs(hidden @ weight.t(), targets, args.temperature)
        if not args.forward_only:
            ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
            hidden.grad = weight.grad = None
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


def _spawn(variant: str, args, chunk_tokens: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant] + [
        f"--tokens={args.tokens}",
        f"--vocab={args.vocab}",
        f"--hidden={args.hidden}",
        f"--dtype={args.dtype}",
        f"--temperature={args.temperature}",
        f"--chunk-tokens={chunk_tokens}",
        f"--repeats={args.repeats}",
        f"--threads={args.threads}",
    ]
    cmd += ["--forward-only"] if args.forward_only else []
    cmd += ["--cpu"] if args.cpu else []
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["chunk_tokens"] = chunk_tokens
    return result


def main(argv=None) -> int:
    from megatron_dapo.actor.logprobs import DEFAULT_CHUNK_TOKENS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS, help="fused kernel's chunk")
    p.add_argument("--chunks", default="", help="comma-separated extra fused chunk sizes to compare")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--forward-only", action="store_true", help="no backward (pi_old scoring)")
    p.add_argument("--cpu", action="store_true", help="stay on the CPU even when CUDA is present")
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.variant = args.worker
        print(json.dumps(worker(args)))
        return 0
    runs = [_spawn(v, args, args.chunk_tokens) for v in VARIANTS]
    runs += [
        _spawn("fused", args, int(c)) for c in args.chunks.split(",") if c and int(c) != args.chunk_tokens
    ]
    naive = runs[0]
    gib = 1 << 30
    mode = "forward" if args.forward_only else "forward+backward (into hidden and weight)"
    print(
        f"{args.tokens} tokens x {args.vocab} vocab x {args.hidden} hidden, {args.dtype}, {mode}, "
        f"{naive['device']}"
    )
    print(f"  {'variant':<14} {'peak extra':>12} {'x naive':>8} {'time':>11} {'x naive':>8}")
    for r in runs:
        name = r["variant"] + (f" c={r['chunk_tokens']}" if r["variant"] == "fused" else "")
        print(
            f"  {name:<14} {r['extra_bytes'] / gib:8.3f} GiB {r['extra_bytes'] / max(naive['extra_bytes'], 1):8.3f} "
            f"{r['time_s'] * 1e3:8.1f} ms {r['time_s'] / naive['time_s']:8.3f}"
        )
    bad = [
        r for r in runs if abs(r["checksum"] - naive["checksum"]) > 1e-3 * max(1.0, abs(naive["checksum"]))
    ]
    for r in bad:
        print(
            f"  WARNING: {r['variant']} differs (sum of log-probs {r['checksum']} vs naive {naive['checksum']})"
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
