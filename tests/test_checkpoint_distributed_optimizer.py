"""Checkpoints under megatron's distributed optimizer (the GPU default), run on CPU with gloo.

megatron-core 0.16.1's DistributedOptimizer writes its state by default with flattened ranges
that its own dist-checkpointing refuses ("ShardedTensor.flattened_range is not supported"): every
save of a GPU run failed. Here the optimizer runs for real on two gloo ranks (DP=2):

- its training, in either format, equals the non-distributed optimizer's on the same batches (an
  independent reference for the CPU distributed optimizer itself);
- a load of the step-1 checkpoint into a freshly built actor (random weights of another seed, no
  Adam state) restores, on every rank, the optimizer state the saving run held when it saved
  (the shards of exp_avg, exp_avg_sq and the fp32 main params, Adam's step, the schedule's
  count), in each format;
- the update after that load reproduces the uninterrupted run bitwise, in each format;
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


def _optimizer_state(actor) -> dict:
    """This rank's distributed-optimizer state by parameter name: its shards of the fp32 main
    param, exp_avg and exp_avg_sq, Adam's step, and the schedule's update count."""
    from megatron_dapo.weights.model_io import unwrap

    (inner,) = actor.optimizer.chained_optimizers
    names = {param: name for name, param in unwrap(actor.model[0]).named_parameters()}
    out = {}
    for param in inner.model_param_group_index_map:
        tensors = inner._get_main_param_and_optimizer_states(param)
        out[names[param]] = {key: value.detach().clone() for key, value in tensors.items()}
    out["scheduler updates"] = actor.scheduler.num_steps
    return out


def _train(rank, world, hf_dir, root):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_dapo.actor.checkpoint import save_checkpoint
    from megatron_dapo.actor.parallel import init_parallel

    out = {"saved_optimizer": {}}
    for fmt in FORMATS:
        init_parallel(tp=1, pp=1)
        actor = _actor(hf_dir, fmt)
        assert isinstance(actor.optimizer.chained_optimizers[0], DistributedOptimizer)
        for step in range(3):
            actor.update(_batch(step))
            save_checkpoint(Path(root) / fmt, step, actor, trainer_state={"step": step}, hf_dir=hf_dir)
            if step == 1:  # what the resumes below load
                out["saved_optimizer"][fmt] = _optimizer_state(actor)
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
    same_layout = (world, tp) == (2, 1)
    if same_layout:  # random weights of another seed, no Adam state yet: nothing the saved run holds
        before = _optimizer_state(actor)
    try:
        record = load_checkpoint(actor, Path(root) / fmt, resume=str(Path(root) / fmt / "step_00000001"))
    except CheckpointError as e:
        return as_bytes({"error": str(e)})
    out = {"step": record["step"]}
    if same_layout:
        out.update(before_load=before, loaded_optimizer=_optimizer_state(actor))
    actor.update(_batch(record["step"] + 1))
    out["state"] = hf_state(actor)
    return as_bytes(out)


@pytest.fixture(scope="module")
def runs(tiny_hf_checkpoint, tmp_path_factory):
    hf_dir = str(tiny_hf_checkpoint(**MODEL))
    root = str(tmp_path_factory.mktemp("distopt"))
    full = [from_bytes(r) for r in run_ranks(_train, 2, hf_dir, root, timeout_s=600)]
    resumed = {
        (fmt, world, tp): [
            from_bytes(r) for r in run_ranks(_resume, world, hf_dir, root, fmt, tp, timeout_s=600)
        ]
        for fmt, world, tp in (
            ("dp_reshardable", 2, 1),
            ("fully_reshardable", 2, 1),
            ("dp_reshardable", 1, 1),
            ("dp_reshardable", 2, 2),
            ("fully_reshardable", 2, 2),
        )
    }
    # rank 0's weights (gathered, the same on every rank) and every rank's optimizer shards
    return dict(
        full=full[0],
        saved_optimizer=[r["saved_optimizer"] for r in full],
        resumed={key: ranks[0] for key, ranks in resumed.items()},
        resumed_ranks=resumed,
    )


def _close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for name, w in a.items():
        torch.testing.assert_close(w, b[name], atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize("fmt", FORMATS)
def test_distributed_optimizer_trains_like_the_non_distributed_one(runs, fmt):
    _close(runs["full"][fmt], runs["full"]["non_distributed"], atol=1e-6)


@pytest.mark.parametrize("fmt", FORMATS)
def test_load_restores_the_saved_optimizer_state_on_every_rank(runs, fmt):
    for rank, saved_by_format in enumerate(runs["saved_optimizer"]):
        saved, res = saved_by_format[fmt], runs["resumed_ranks"][(fmt, 2, 1)][rank]
        assert "error" not in res, res.get("error")
        loaded, before = res["loaded_optimizer"], res["before_load"]
        assert loaded.keys() == saved.keys() == before.keys()
        assert loaded["scheduler updates"] == saved["scheduler updates"] > before["scheduler updates"] == 0
        params = [name for name in saved if name != "scheduler updates"]
        assert params and all(
            saved[name].keys() == {"param", "exp_avg", "exp_avg_sq", "step"} for name in params
        )
        for name in params:
            for key, want in saved[name].items():
                # the fresh optimizer held other values (or none), so an equality is the load's work
                held = before[name].get(key)
                assert held is None or not torch.equal(held, want), (
                    f"rank {rank} {name} {key} held it already"
                )
                got = loaded[name][key]
                assert torch.equal(got, want), f"rank {rank} {name} {key}: not the saved value after the load"


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
