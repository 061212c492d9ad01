"""Benchmark the weight sync path: TP-sharded Megatron model -> HF-named buckets -> HF model.

A Qwen2.5-0.5B-shaped model (random bf16 weights) is built at TP=2 on two local ranks; every
repeat gathers and converts its shards into HF buckets (``iter_hf_buckets``) and loads them into a
transformers Qwen2ForCausalLM on rank 0, the way the CPU rollout engine does. The baseline is a
plain copy of the same bytes (one tensor per HF parameter) into the same HF model, in the same
run. Prints both times (median of the repeats) and their ratio.

    python tools/bench_weight_sync.py [--repeats 3] [--bucket-mb 512] [--layers 24]
"""

from __future__ import annotations

import argparse
import statistics
import time

QWEN25_05B = dict(
    architectures=["Qwen2ForCausalLM"],
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
)


def gather_buffers(param, world: int) -> list:
    """Receive buffers for ``dist.gather`` of ``param`` from ``world`` ranks, on the parameter's
    own device: NCCL gathers into CUDA tensors only, gloo into CPU ones."""
    import torch

    return list(torch.empty((world, *param.shape), dtype=param.dtype, device=param.device).unbind(0))


def _bench_rank(rank, world, layers, repeats, bucket_bytes):
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_dapo.actor.model import build_gpt_model
    from megatron_dapo.actor.parallel import init_parallel
    from megatron_dapo.weights.gather import iter_hf_buckets

    init_parallel(tp=world, pp=1)
    config = Qwen2Config(**{**QWEN25_05B, "num_hidden_layers": layers})
    chunks = build_gpt_model(config, params_dtype=torch.bfloat16, perform_initialization=False)
    gen = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.02)
    hf_params = None
    if rank == 0:
        hf = Qwen2ForCausalLM(config).to(torch.bfloat16)
        hf_params = dict(hf.named_parameters())
        sources = {
            n: torch.randn(p.shape, dtype=torch.float32).to(torch.bfloat16) for n, p in hf_params.items()
        }
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    sync_s, copy_s, floor_s, nbytes = [], [], [], 0
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        nbytes, synced = 0, set()
        for bucket in iter_hf_buckets(chunks, bucket_bytes=bucket_bytes):
            if bucket is None:
                continue
            with torch.no_grad():
                for name, tensor in bucket.items():
                    hf_params[name].copy_(tensor)
                    nbytes += tensor.numel() * tensor.element_size()
                    synced.add(name)
        dist.barrier()
        sync_s.append(time.perf_counter() - t0)
        if rank == 0:
            t0 = time.perf_counter()
            with torch.no_grad():
                for name, tensor in sources.items():
                    hf_params[name].copy_(tensor)
            copy_s.append(time.perf_counter() - t0)
        # Transport floor: the bare TP gather of every shard to rank 0, no conversion, no load.
        dist.barrier()
        t0 = time.perf_counter()
        for p in chunks[0].parameters():
            if world == 1:
                continue
            out = gather_buffers(p, world) if rank == 0 else None
            dist.gather(p.detach(), gather_list=out, dst=0, group=group)
        dist.barrier()
        floor_s.append(time.perf_counter() - t0)
    if rank != 0:
        return None
    med = statistics.median
    # HF ties lm_head to embed_tokens, so named_parameters() lists only the synced names.
    names_ok = synced == set(hf_params)
    return dict(sync=med(sync_s), copy=med(copy_s), floor=med(floor_s), bytes=nbytes, names_ok=names_ok)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--layers", type=int, default=24, help="24 is Qwen2.5-0.5B")
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()

    from megatron_dapo.actor.compat import dist_backend as backend
    from megatron_dapo.actor.spawn import run_ranks

    result = run_ranks(_bench_rank, args.tp, args.layers, args.repeats, args.bucket_mb << 20, timeout_s=1800)[
        0
    ]
    gb = result["bytes"] / 1e9
    print(f"model: Qwen2.5-0.5B shape, {args.layers} layers, bf16, TP={args.tp}, {gb:.3f} GB of HF tensors")
    print(f"gather+convert+load into HF model : {result['sync']:.3f} s  ({gb / result['sync']:.2f} GB/s)")
    print(f"plain copy of the same bytes      : {result['copy']:.3f} s  ({gb / result['copy']:.2f} GB/s)")
    print(f"ratio                             : {result['sync'] / result['copy']:.2f}x")
    print(
        f"(bare TP gather of all shards, every parameter incl. replicated norms: {result['floor']:.3f} s"
        f" = {result['floor'] / result['copy']:.2f}x the plain copy; backend {backend()})"
    )
    if not result["names_ok"]:
        print("warning: the HF model's parameter names differ from the synced names")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
