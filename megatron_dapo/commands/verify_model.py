"""`megatron-dapo verify-model`: Megatron logits vs HF transformers logits on a fixed batch.

Builds the Megatron model at the requested TP x PP (launching the ranks itself), loads the
weights from the HF directory (or from a Megatron dist checkpoint), runs a forward pass on a
fixed random batch, and compares with the HF model in fp32. Exit code 1 above --atol.
"""

from __future__ import annotations

import argparse
import sys

from megatron_dapo.actor.model import build_gpt_model, forward_logits
from megatron_dapo.actor.parallel import destroy_parallel, init_parallel
from megatron_dapo.actor.spawn import RankFailed, run_ranks
from megatron_dapo.arch import load_hf_config
from megatron_dapo.errors import report
from megatron_dapo.weights.dist_ckpt import load_model_checkpoint
from megatron_dapo.weights.load import load_hf_weights


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hf-dir", required=True, help="HF model directory (reference weights + config)")
    p.add_argument(
        "--megatron-dir", default=None, help="Megatron dist checkpoint to test (default: load --hf-dir)"
    )
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None)
    p.add_argument("--ep", type=int, default=1, help="MoE expert parallel size (runs tp*pp*ep ranks)")
    p.add_argument("--atol", type=float, default=1e-4, help="max allowed |logit difference| (default 1e-4)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--spec",
        choices=["auto", "te", "local"],
        default="auto",
        help="layer spec: Transformer Engine, megatron's local one, or auto (TE when importable on a GPU)",
    )
    p.set_defaults(func=run)


def fixed_batch(vocab_size: int, batch: int, seq_len: int, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq_len), generator=gen)


def verify_rank(rank, world, hf_dir, megatron_dir, tp, pp, vpp, batch, seq_len, seed, spec="auto", ep=1):
    """One rank: Megatron logits, and on the last stage's TP-0 DP-0 rank the diff against HF."""
    import torch

    layout = init_parallel(tp=tp, pp=pp, vpp=vpp, ep=ep)
    config = load_hf_config(hf_dir)
    use_te = {"auto": None, "te": True, "local": False}[spec]
    chunks = build_gpt_model(config, params_dtype=torch.float32, use_te=use_te, perform_initialization=False)
    if megatron_dir:
        load_model_checkpoint(chunks, megatron_dir)
    else:
        load_hf_weights(chunks, hf_dir)
    ids = fixed_batch(config.vocab_size, batch, seq_len, seed)
    logits = forward_logits(chunks, ids)
    diff = None
    if logits is not None and layout.tp_rank == 0 and layout.dp_rank == 0:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            ref = hf(ids).logits
        diff = (logits.float().cpu() - ref).abs().max().item()
    destroy_parallel()
    return diff


def run(args: argparse.Namespace) -> int:
    try:
        results = run_ranks(
            verify_rank,
            args.tp * args.pp * args.ep,
            args.hf_dir,
            args.megatron_dir,
            args.tp,
            args.pp,
            args.vpp,
            args.batch,
            args.seq_len,
            args.seed,
            args.spec,
            args.ep,
        )
    except RankFailed as e:
        status, line = report(e)
        print(line, file=sys.stderr)
        return status
    diff = max(d for d in results if d is not None)
    source = args.megatron_dir or args.hf_dir
    print(
        f"max |logit diff| Megatron(tp={args.tp}, pp={args.pp}, ep={args.ep}, spec={args.spec}, weights={source}) vs HF: {diff:.3e} "
        f"(atol {args.atol:g})"
    )
    if diff > args.atol:
        print("FAIL: above tolerance", file=sys.stderr)
        return 1
    print("OK")
    return 0
