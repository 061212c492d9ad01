"""Checkpoints under megatron's distributed optimizer (the GPU default), run on CPU with gloo.

megatron-core 0.16.1's DistributedOptimizer writes its state by default with flattened ranges
that its own dist-checkpointing refuses ("ShardedTensor.flattened_range is not supported"): every
save of a GPU run failed. Here the optimizer runs for real on two gloo ranks (DP=2):

- its training equals the non-distributed optimizer's on the same batches (an independent
  reference for the CPU distributed optimizer itself);
- a resume from the step-1 checkpoint reproduces the uninterrupted run bitwise, in each format;
- dp_reshardable resumes at another DP size (DP=1) within fp32 noise, and refuses another
  model-parallel layout (TP=2) with one line naming both layouts;
- fully_reshardable resumes into TP=2 within fp32 noise.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import as_bytes, from_bytes, hf_state
from test_checkpoint_resume import MODEL, _batch

from megatron_dapo.actor.spawn import run_ranks

FORMATS = ("dp_reshardable", "fully_reshardable")


def _actor(hf_dir, fmt="dp_reshardable", distributed=True, load_weights=True):
    from megatron_dapo.actor.actor import ActorConfig, build_actor
    from megatron_dapo.actor.optimizer import OptimizerSettings

    cfg = ActorConfig(ppo_mini_batch_size=2, micro_batch_max_tokens=24, shuffle=True, seed=3)
    optim = OptimizerSettings(
        lr=1e-2,
        lr_warmup_steps=2,
        lr_scheduler="cosine",
        min_lr=1e-3,
        weight_decay=0.1,
        adam_eps=1e-3,
        use_distributed_optimizer=distributed,
        checkpoint_format=fmt,
    )
    return build_actor(hf_dir, cfg, optim, total_updates=12, load_weights=load_weights)


def _train(rank, world, hf_dir, root):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_dapo.actor.checkpoint import save_checkpoint
    from megatron_dapo.actor.parallel import init_parallel

    out = {}
    for fmt in FORMATS:
        init_parallel(tp=1, pp=1)
        actor = _actor(hf_dir, fmt)
        assert isinstance(actor.optimizer.chained_optimizers[0], DistributedOptimizer)
        for step in range(3):
            actor.update(_batch(step))
            save_checkpoint(Path(root) / fmt, step, actor, trainer_state={"step": step}, hf_dir=hf_dir)
        out[fmt] = hf_state(actor)
    init_parallel(tp=1, pp=1)
    plain = _actor(hf_dir, distributed=False)
    for step in range(3):
        plain.update(_batch(step))
    out["non_distributed"] = hf_state(plain)
    return as_bytes(out)


def _resume(rank, world, hf_dir, root, fmt, tp):
    from megatron_dapo.actor.checkpoint import load_checkpoint
    from megatron_dapo.actor.parallel import init_parallel
    from megatron_dapo.weights.hf_io import CheckpointError

    init_parallel(tp=tp, pp=1, seed=999)
    actor = _actor(hf_dir, fmt, load_weights=False)
    try:
        record = load_checkpoint(actor, Path(root) / fmt, resume=str(Path(root) / fmt / "step_00000001"))
    except CheckpointError as e:
        return as_bytes({"error": str(e)})
    actor.update(_batch(record["step"] + 1))
    return as_bytes({"state": hf_state(actor), "step": record["step"]})


@pytest.fixture(scope="module")
def runs(tiny_hf_checkpoint, tmp_path_factory):
    hf_dir = str(tiny_hf_checkpoint(**MODEL))
    root = str(tmp_path_factory.mktemp("distopt"))
    full = from_bytes(run_ranks(_train, 2, hf_dir, root, timeout_s=600)[0])
    resumed = {
        (fmt, world, tp): from_bytes(run_ranks(_resume, world, hf_dir, root, fmt, tp, timeout_s=600)[0])
        for fmt, world, tp in (
            ("dp_reshardable", 2, 1),
            ("fully_reshardable", 2, 1),
            ("dp_reshardable", 1, 1),
            ("dp_reshardable", 2, 2),
            ("fully_reshardable", 2, 2),
        )
    }
    return dict(full=full, resumed=resumed)


def _close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for name, w in a.items():
        torch.testing.assert_close(w, b[name], atol=atol, rtol=0, msg=name)


def test_distributed_optimizer_trains_like_the_non_distributed_one(runs):
    full = runs["full"]
    start = {k: v for k, v in full["dp_reshardable"].items()}
    _close(start, full["non_distributed"], atol=1e-6)
    _close(full["fully_reshardable"], full["dp_reshardable"], atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_resume_at_the_same_layout_is_bitwise(runs, fmt):
    res = runs["resumed"][(fmt, 2, 1)]
    assert "error" not in res, res.get("error")
    assert res["step"] == 1
    for name, w in runs["full"][fmt].items():
        assert torch.equal(w, res["state"][name]), name


def test_dp_reshardable_resumes_at_another_dp_size(runs):
    res = runs["resumed"][("dp_reshardable", 1, 1)]
    assert "error" not in res, res.get("error")
    _close(res["state"], runs["full"]["dp_reshardable"], atol=1e-6)


def test_dp_reshardable_refuses_another_model_parallel_layout_in_one_line(runs):
    res = runs["resumed"][("dp_reshardable", 2, 2)]
    assert "state" not in res
    error = res["error"]
    assert "\n" not in error
    assert "dp_reshardable at TP=1 PP=1 CP=1 EP=1 DP=2" in error
    assert "this run is TP=2 PP=1 CP=1 EP=1 DP=1" in error
    assert "parallel.optimizer_checkpoint_format=fully_reshardable" in error


def test_fully_reshardable_resumes_into_tensor_parallel(runs):
    res = runs["resumed"][("fully_reshardable", 2, 2)]
    assert "error" not in res, res.get("error")
    _close(res["state"], runs["full"]["fully_reshardable"], atol=1e-6)
