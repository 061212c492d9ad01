"""Benchmark: what the reference policy (actor.use_kl_loss / algorithm.use_kl_in_reward) costs.

    python tools/bench_reference.py --shape tiny        # CPU, seconds (nothing is offloaded there)
    python tools/bench_reference.py --shape 1.5b        # CUDA: Qwen2.5-1.5B dims, random weights, bf16

One process builds the actor with a reference model as the trainer does (tools/bench_actor.py's
shapes and batch) and times, after one warm-up of each, the median of ``--repeats`` calls of:

- the pi_old pass (``compute_logprobs``): the baseline of the same size;
- the reference's pass as the trainer runs it (``compute_ref_logprobs``): on CUDA its parameters
  come from pinned host memory for the pass and go back after it;
- the same pass with the reference kept on the device (no offload);
- ``actor.update`` with the KL loss, against the same update without a reference.

It prints each ratio against the pi_old pass or the plain update, the bytes the offload moves, the
device memory the reference holds when resident, and the transfer rate. On CPU the reference never
moves (there is no device memory to give back), so its two passes are the same. The 1.5b figures
have not been measured with this tool (no GPU on the machine that wrote it).

The last line is ``RESULT {json}`` with every figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench_actor import SHAPES, _batch, _timed, _write_hf_config


def _actor(hf_dir: str, shape, dtype, kl: bool):
    from megatron_dapo.actor.actor import ActorConfig, build_actor
    from megatron_dapo.actor.optimizer import OptimizerSettings

    cfg = ActorConfig(
        ppo_mini_batch_size=shape.mini_batch_groups,
        micro_batch_max_tokens=shape.micro_batch_tokens,
        use_kl_loss=kl,
    )
    return build_actor(
        hf_dir, cfg, OptimizerSettings(), total_updates=100, params_dtype=dtype, load_weights=False
    )


def _timed_update(actor, batch, cuda: bool, repeats: int) -> float:
    actor.update(batch)
    return _timed(lambda: actor.update(batch), cuda, repeats)


def run(args) -> dict:
    import torch

    from megatron_dapo.actor import compat
    from megatron_dapo.actor.parallel import init_parallel
    from megatron_dapo.actor.reference import move_parameters

    shape = SHAPES[args.shape]
    cuda = not compat.on_cpu()
    if shape.dtype == "bf16" and not cuda:
        raise SystemExit(f"--shape {args.shape} needs CUDA (bf16 at this size); use --shape tiny on CPU")
    init_parallel()
    hf_dir = _write_hf_config(Path(tempfile.mkdtemp(prefix="bench_reference_")) / "hf", shape.hf_size)
    dtype = torch.bfloat16 if shape.dtype == "bf16" else torch.float32
    batch = _batch(shape, args.seed)
    tokens = int(batch.seq_lens.sum())

    t_plain = _timed_update(_actor(hf_dir, shape, dtype, kl=False), batch, cuda, args.repeats)
    if cuda:
        torch.cuda.empty_cache()  # the plain actor is gone: its memory is free for the next
    actor = _actor(hf_dir, shape, dtype, kl=True)
    ref = actor.reference
    actor.compute_logprobs(batch)
    actor.compute_ref_logprobs(batch)
    actor.update(batch)
    t_old = _timed(lambda: actor.compute_logprobs(batch), cuda, args.repeats)
    t_ref = _timed(lambda: actor.compute_ref_logprobs(batch), cuda, args.repeats)
    t_kl_update = _timed(lambda: actor.update(batch), cuda, args.repeats)
    offload, before = ref.offload, torch.cuda.memory_allocated() if cuda else 0
    if offload:
        move_parameters(ref.chunks, compat.device())
        ref.offload = False
    resident = (torch.cuda.memory_allocated() - before) if cuda else 0
    t_ref_resident = _timed(lambda: actor.compute_ref_logprobs(batch), cuda, args.repeats)
    return dict(
        shape=args.shape,
        device=str(compat.device()),
        dtype=shape.dtype,
        tokens=tokens,
        repeats=args.repeats,
        offloaded=offload,
        reference_param_bytes=ref.param_bytes,
        resident_device_bytes=resident,
        seconds=dict(
            pi_old_pass=t_old,
            reference_pass=t_ref,
            reference_pass_resident=t_ref_resident,
            update_with_kl=t_kl_update,
            update_plain=t_plain,
        ),
        ratios=dict(
            reference_pass_over_pi_old=t_ref / t_old,
            reference_resident_over_pi_old=t_ref_resident / t_old,
            update_with_kl_over_plain=t_kl_update / t_plain,
        ),
        # both ways, from the time the offload adds to the pass
        transfer_gb_per_s=(2 * ref.param_bytes / (t_ref - t_ref_resident) / 1e9)
        if offload and t_ref > t_ref_resident
        else None,
    )


def report(r: dict) -> None:
    s, q = r["seconds"], r["ratios"]
    print(
        f"shape {r['shape']} on {r['device']} ({r['dtype']}): {r['tokens']} tokens, reference "
        f"{r['reference_param_bytes'] / 2**30:.3f} GiB of parameters, "
        + ("offloaded to pinned host memory between uses" if r["offloaded"] else "not offloaded (CPU)")
    )
    print(f"  median of {r['repeats']} calls after one warm-up")
    print(f"  pi_old pass                 {s['pi_old_pass']:.4f} s")
    print(
        f"  reference pass (trainer)    {s['reference_pass']:.4f} s   x{q['reference_pass_over_pi_old']:.3f} pi_old"
    )
    print(
        f"  reference pass (resident)   {s['reference_pass_resident']:.4f} s   "
        f"x{q['reference_resident_over_pi_old']:.3f} pi_old"
    )
    print(
        f"  update with the KL loss     {s['update_with_kl']:.4f} s   x{q['update_with_kl_over_plain']:.3f} "
        f"the update without a reference ({s['update_plain']:.4f} s)"
    )
    if r["offloaded"]:
        rate = r["transfer_gb_per_s"]
        print(
            f"  device memory held when resident: {r['resident_device_bytes'] / 2**30:.3f} GiB; "
            "transfer " + (f"{rate:.1f} GB/s" if rate else "not resolved (the pass with it was not slower)")
        )
    print("RESULT " + json.dumps(r))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="timed calls of each (median)")
    report(run(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
