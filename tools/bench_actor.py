"""Benchmark: the actor's throughput against the bare model and the chip, in one run.

    python tools/bench_actor.py --shape tiny            # CPU, seconds
    python tools/bench_actor.py --shape 1.5b            # CUDA: Qwen2.5-1.5B dims, random weights, bf16

One process (TP=PP=DP=1) builds the actor as the trainer does (``actor.actor.build_actor`` over a
config-only HF directory, random weights, distributed optimizer) and times, after one warm-up of
each:

- ``actor.update``: the pi_old forward (``compute_logprobs``) and the optimizer mini-batch updates
  of one rollout batch;
- ``actor.compute_logprobs`` with entropy, on the same batch;
- the bare megatron ``GPTModel`` forward+backward (its own output layer and vocab-parallel
  cross-entropy, no optimizer step) on rows of ``--micro-batch-tokens`` tokens, as many rows as
  the update's tokens fill: the ceiling the actor's own work around the model is measured against.

For each (the median of ``--repeats`` calls): tokens/s (real tokens: prompt + response of every sample, once per call), MFU, peak
memory (CUDA ``max_memory_allocated`` reset before each; on CPU the peak RSS, VmHWM reset before
each through /proc/self/clear_refs where the kernel allows it, else the process's peak so far),
and the micro-batches' padding fraction (padded positions / all positions). FLOPs per token, with
N the model's parameters (tied embeddings once), L layers, h hidden size, s the token's sequence
length: forward+backward 6N + 12*L*h*s (tools/gpu_checks/shapes.py), forward 2N + 4*L*h*s, so the
update counts 8N + 16*L*h*s (ppo_epochs=1: one pi_old forward and one forward+backward per
token). The peak is ``--peak-flops`` (default on CUDA: the device's dense bf16 figure from
shapes.PEAKS, 989e12 on an H200); on CPU it is a float32 matmul's FLOP/s measured on this machine
in the same run, so the CPU MFU says how close the actor comes to this CPU's own matmul speed.

The batch (``--shape 1.5b``, the table of issue 27): 64 samples, 8 groups of 8, each a 256-token
prompt and a 224-1792-token response (seeded), ``ppo_mini_batch_size=4`` (two updates),
``micro_batch_max_tokens=4096``. ``--shape tiny``: 8 samples, 2 groups of 4, 16-token prompts,
8-56-token responses, two updates, 128-token micro-batches. The 1.5b figures have not been
measured with this tool on this machine (no GPU here).

The last line is ``RESULT {json}`` with every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gpu_checks.shapes import QWEN25, peak_tflops, train_step_flops


@dataclass(frozen=True)
class Shape:
    hf_size: str  # key of shapes.QWEN25
    dtype: str
    samples: int
    group_size: int
    prompt_len: int
    response_range: tuple[int, int]
    mini_batch_groups: int
    micro_batch_tokens: int


SHAPES = {
    "1.5b": Shape("1.5B", "bf16", 64, 8, 256, (224, 1792), 4, 4096),
    "tiny": Shape("tiny", "fp32", 8, 4, 16, (8, 56), 1, 128),
}


def _cpu_matmul_flops(seconds: float = 0.5) -> float:
    """This CPU's float32 matmul FLOP/s: the best of repeated 512^3 products."""
    import torch

    a, b = torch.randn(512, 512), torch.randn(512, 512)
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        a @ b
        best = max(best, 2 * 512**3 / (time.perf_counter() - t0))
    return best


class PeakMemory:
    """Peak memory of a phase: CUDA's allocator counter, or the process's peak RSS on CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.note = "CUDA max_memory_allocated"

    def reset(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM
            self.note = "peak RSS (VmHWM, reset per phase)"
        except OSError:
            self.note = "peak RSS of the process so far (ru_maxrss; cannot reset here)"

    def read(self) -> int:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _batch(shape: Shape, seed: int):
    import torch

    from megatron_dapo.actor.batch import make_actor_batch

    vocab = QWEN25[shape.hf_size]["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    lo, hi = shape.response_range
    prompts, responses = [], []
    for _ in range(shape.samples):
        prompts.append(torch.randint(0, vocab, (shape.prompt_len,), generator=gen).tolist())
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        responses.append(torch.randint(0, vocab, (n,), generator=gen).tolist())
    advantages = torch.randn(shape.samples, generator=gen).tolist()
    groups = [i // shape.group_size for i in range(shape.samples)]
    return make_actor_batch(prompts, responses, advantages, groups)


def _write_hf_config(path: Path, size: str) -> Path:
    """config.json only: the weights are megatron's random initialisation."""
    from transformers import Qwen2Config

    Qwen2Config(
        architectures=["Qwen2ForCausalLM"],
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        **QWEN25[size],
    ).save_pretrained(path)
    return path


def _padding(micros) -> tuple[int, int]:
    """(real tokens, all positions) of the planned micro-batches."""
    real = sum(int(m.seq_lens.sum()) for m in micros)
    return real, sum(int(m.tokens.numel()) for m in micros)


def _timed(fn, cuda: bool, repeats: int) -> float:
    """The median wall time of ``repeats`` calls."""
    import torch

    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _bare_step(model, rows: int, row_tokens: int, vocab: int, device) -> None:
    """Forward+backward of the bare GPTModel, one row per call, megatron's own loss."""
    import torch

    gen = torch.Generator().manual_seed(1)
    positions = torch.arange(row_tokens, device=device).unsqueeze(0)
    for _ in range(rows):
        ids = torch.randint(0, vocab, (1, row_tokens), generator=gen).to(device)
        labels = torch.randint(0, vocab, (1, row_tokens), generator=gen).to(device)
        model(ids, positions, None, labels=labels).sum().backward()


def run(args) -> dict:
    import torch

    from megatron_dapo.actor import compat
    from megatron_dapo.actor.actor import ActorConfig, build_actor
    from megatron_dapo.actor.optimizer import OptimizerSettings, zero_grads
    from megatron_dapo.actor.parallel import init_parallel
    from megatron_dapo.weights.model_io import unwrap

    shape = SHAPES[args.shape]
    cuda = not compat.on_cpu()
    if shape.dtype == "bf16" and not cuda:
        raise SystemExit(f"--shape {args.shape} needs CUDA (bf16 at this size); use --shape tiny on CPU")
    budget = args.micro_batch_tokens or shape.micro_batch_tokens
    init_parallel()
    work = Path(tempfile.mkdtemp(prefix="bench_actor_"))
    hf_dir = _write_hf_config(work / "hf", shape.hf_size)
    cfg = ActorConfig(
        ppo_mini_batch_size=shape.mini_batch_groups,
        micro_batch_max_tokens=budget,
        logprob_chunk_tokens=args.logprob_chunk_tokens,
    )
    dtype = torch.bfloat16 if shape.dtype == "bf16" else torch.float32
    actor = build_actor(
        hf_dir, cfg, OptimizerSettings(), total_updates=100, params_dtype=dtype, load_weights=False
    )
    batch = _batch(shape, args.seed)
    tokens = int(batch.seq_lens.sum())
    seq = batch.seq_lens.double()
    gpt = unwrap(actor.model[0])
    n_params = sum(p.numel() for p in gpt.parameters())
    layers, hidden = gpt.config.num_layers, gpt.config.hidden_size
    vocab = QWEN25[shape.hf_size]["vocab_size"]
    fwd_flops = float((seq * (2 * n_params + 4 * layers * hidden * seq)).sum())
    update_flops = 4 * fwd_flops  # a pi_old forward plus forward+backward (3 forwards)
    rows = math.ceil(tokens / budget)
    bare_flops = rows * train_step_flops(n_params, layers, hidden, budget, budget)
    if args.peak_flops:
        peak, peak_note = args.peak_flops, "--peak-flops"
    elif cuda:
        name = torch.cuda.get_device_name()
        tf = peak_tflops(name)
        if tf is None:
            raise SystemExit(f"no dense bf16 peak known for {name!r}; pass --peak-flops")
        peak, peak_note = tf * 1e12, f"{name} dense bf16 (tools/gpu_checks/shapes.py)"
    else:
        peak, peak_note = _cpu_matmul_flops(), "measured fp32 matmul FLOP/s of this CPU (not a chip peak)"
    memory = PeakMemory(cuda)

    # Warm-up (kernels, allocator, megatron's buffers), then the timed calls.
    actor.compute_logprobs(batch, with_entropy=True)
    actor.update(batch)
    minis = actor.mini_batches(batch, 0)  # the next update's shuffle (padding only)
    update_plan = [actor._my_micro_batches(batch, m) for m in minis]
    score_plan = actor._my_micro_batches(batch, list(range(len(batch))))
    memory.reset()
    t_update = _timed(lambda: actor.update(batch), cuda, args.repeats)
    mem_update = memory.read()
    memory.reset()
    t_score = _timed(lambda: actor.compute_logprobs(batch, with_entropy=True), cuda, args.repeats)
    mem_score = memory.read()

    model = actor.model[0]
    model.train()
    _bare_step(model, 1, budget, vocab, compat.device())
    zero_grads(actor.model, actor.optimizer)
    memory.reset()
    t_bare = _timed(lambda: _bare_step(model, rows, budget, vocab, compat.device()), cuda, args.repeats)
    mem_bare = memory.read()
    zero_grads(actor.model, actor.optimizer)

    score_real, score_all = _padding(score_plan)
    upd = [_padding(p) for p in update_plan]
    upd_real = score_real + sum(r for r, _ in upd)
    upd_all = score_all + sum(a for _, a in upd)
    figures = {
        "update": dict(
            tokens_per_s=tokens / t_update,
            mfu=update_flops / t_update / peak,
            peak_bytes=mem_update,
            padding_fraction=1 - upd_real / upd_all,
            seconds=t_update,
        ),
        "compute_logprobs": dict(
            tokens_per_s=tokens / t_score,
            mfu=fwd_flops / t_score / peak,
            peak_bytes=mem_score,
            padding_fraction=1 - score_real / score_all,
            seconds=t_score,
        ),
        "bare": dict(
            tokens_per_s=rows * budget / t_bare,
            mfu=bare_flops / t_bare / peak,
            peak_bytes=mem_bare,
            padding_fraction=0.0,
            seconds=t_bare,
        ),
    }
    return dict(
        shape=args.shape,
        device=str(compat.device()),
        dtype=shape.dtype,
        tokens=tokens,
        samples=len(batch),
        updates=len(minis),
        micro_batch_tokens=budget,
        logprob_chunk_tokens=args.logprob_chunk_tokens,
        bare_rows=rows,
        repeats=args.repeats,
        n_params=n_params,
        layers=layers,
        hidden=hidden,
        peak_flops=peak,
        peak_note=peak_note,
        memory_note=memory.note,
        figures=figures,
        ratios=dict(
            update_over_bare_tokens_per_s=figures["update"]["tokens_per_s"] / figures["bare"]["tokens_per_s"],
            update_over_bare_mfu=figures["update"]["mfu"] / figures["bare"]["mfu"],
            compute_logprobs_over_bare_mfu=figures["compute_logprobs"]["mfu"] / figures["bare"]["mfu"],
        ),
    )


def report(r: dict) -> None:
    gib = 1 << 30
    print(
        f"shape {r['shape']} ({r['n_params'] / 1e6:.1f}M params, L={r['layers']}, h={r['hidden']}, {r['dtype']}) on "
        f"{r['device']}: {r['samples']} samples, {r['tokens']} tokens, {r['updates']} updates, micro-batches of "
        f"{r['micro_batch_tokens']} tokens, log-prob chunk {r['logprob_chunk_tokens']}"
    )
    print("MFU = FLOPs / time / peak; FLOPs per token of a sequence of length s:")
    print(
        "  actor.update            8N + 16*L*h*s  (pi_old forward 2N + 4*L*h*s, forward+backward 6N + 12*L*h*s)"
    )
    print("  actor.compute_logprobs  2N + 4*L*h*s")
    print(f"  bare GPTModel fwd+bwd   6N + 12*L*h*s, s = {r['micro_batch_tokens']} ({r['bare_rows']} rows)")
    print(f"  times: median of {r['repeats']} calls after one warm-up")
    print(f"  peak {r['peak_flops'] / 1e12:.3f} TFLOP/s: {r['peak_note']}")
    print(f"  memory: {r['memory_note']}")
    print(f"  {'what':<24} {'tokens/s':>12} {'MFU':>8} {'peak memory':>13} {'padding':>8}")
    for name, label in (
        ("update", "actor.update"),
        ("compute_logprobs", "actor.compute_logprobs"),
        ("bare", "bare GPTModel fwd+bwd"),
    ):
        f = r["figures"][name]
        print(
            f"  {label:<24} {f['tokens_per_s']:12.1f} {f['mfu'] * 100:7.2f}% {f['peak_bytes'] / gib:9.3f} GiB "
            f"{f['padding_fraction'] * 100:7.1f}%"
        )
    q = r["ratios"]
    print(
        f"  update/bare: tokens/s {q['update_over_bare_tokens_per_s']:.3f}, MFU {q['update_over_bare_mfu']:.3f}; "
        f"compute_logprobs/bare MFU {q['compute_logprobs_over_bare_mfu']:.3f}"
    )
    print("RESULT " + json.dumps(r))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="actor.micro_batch_max_tokens")
    p.add_argument("--logprob-chunk-tokens", type=int, default=None, help="actor.logprob_chunk_tokens")
    p.add_argument(
        "--peak-flops", type=float, default=None, help="the chip's peak FLOP/s (H200 bf16: 989e12)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="timed calls of each (median)")
    args = p.parse_args(argv)
    if args.logprob_chunk_tokens is None:
        from megatron_dapo.actor.logprobs import DEFAULT_CHUNK_TOKENS

        args.logprob_chunk_tokens = DEFAULT_CHUNK_TOKENS
    report(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
