"""Which causal attention over packed samples is fastest on CPU: forward+backward time of each
variant against SDPA over the same samples right-padded to the longest, measured in one run.

Variants (all fp32, torch's scaled_dot_product_attention; without a forced kernel torch picks its CPU
flash kernel for ``is_causal`` and the math kernel for an explicit mask):
- padded: ``[n, heads, longest, hn]``, ``is_causal`` (the baseline; what padded micro-batches do,
  and SDPAttention's one call for many short packed samples)
- padded_math: the same, torch's math kernel forced
- per_sample: one ``is_causal`` call per sample of the packed ``[t, heads, hn]`` row (torch
  picks its CPU flash kernel)
- per_sample_math: the same, torch's math kernel forced
- document_mask: one call over the whole row with a block-diagonal causal boolean mask
- (CUDA only, not here: torch's ``varlen_attn``; SDPAttention uses it there)

    python tools/bench_packed_attention.py [--heads 8] [--head-dim 64] [--lengths 512,384,...]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def padded(q, k, v, lengths):
    longest = max(lengths)
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()[:-1]]

    def pad(x):
        out = x.new_zeros(len(lengths), longest, *x.shape[1:])
        for i, (s, n) in enumerate(zip(starts, lengths)):
            out[i, :n] = x[s : s + n]
        return out.transpose(1, 2)

    return F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True)


def per_sample(q, k, v, lengths):
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start : start + n].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).squeeze(0).transpose(0, 1))
        start += n
    return torch.cat(out)


def padded_math(q, k, v, lengths):
    with sdpa_kernel(SDPBackend.MATH):
        return padded(q, k, v, lengths)


def per_sample_math(q, k, v, lengths):
    with sdpa_kernel(SDPBackend.MATH):
        return per_sample(q, k, v, lengths)


def document_mask(q, k, v, lengths):
    sample = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(len(sample))
    mask = (sample[:, None] == sample[None, :]) & (pos[None, :] <= pos[:, None])
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).squeeze(0).transpose(0, 1)


def timed(fn, q, k, v, lengths, repeats):
    best = float("inf")
    for _ in range(repeats):
        for x in (q, k, v):
            x.grad = None
        t0 = time.perf_counter()
        fn(q, k, v, lengths).sum().backward()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--lengths", default="512,384,320,256,200,160,96,24")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(n) for n in args.lengths.split(",")]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(sum(lengths), args.heads, args.head_dim, generator=gen).requires_grad_() for _ in range(3)
    )
    ref = per_sample(q, k, v, lengths)
    assert torch.allclose(document_mask(q, k, v, lengths), ref, atol=1e-5)
    base = timed(padded, q, k, v, lengths, args.repeats)
    print(
        f"{len(lengths)} samples, {sum(lengths)} tokens (padded: {len(lengths) * max(lengths)}), "
        f"{args.heads} heads x {args.head_dim}, fp32, {args.threads} threads, forward+backward, best of "
        f"{args.repeats}"
    )
    print(f"{'padded':>14}: {base * 1e3:8.2f} ms  1.00x")
    for fn in (padded_math, per_sample, per_sample_math, document_mask):
        t = timed(fn, q, k, v, lengths, args.repeats)
        print(f"{fn.__name__:>14}: {t * 1e3:8.2f} ms  {t / base:.2f}x")


if __name__ == "__main__":
    main()
