"""Training checkpoints: a resumed run reproduces the uninterrupted one; bad files are caught.

Spawn 1 (TP=2) trains rollout steps 0, 1, 2 (two optimizer updates each, pi_old recomputed,
cosine LR with warmup), saving after every step with keep_last=2. Spawn 2 is a fresh pair of
processes: it resumes from the step-1 checkpoint, trains step 2, and must end bitwise equal to
spawn 1; then it resumes the same checkpoint into TP=1 x PP=2 (model and optimizer resharded)
and must match within fp32 noise. The file checks (latest pointer, pruning, truncated and
corrupted files, resume="auto" fallback) run on copies of the real checkpoint directory.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import as_bytes, from_bytes, hf_state

from megatron_dapo.actor.spawn import run_ranks

MODEL = dict(family="llama", tie_word_embeddings=True, num_layers=2, vocab=200, seed=9)


def _batch(step: int):
    from megatron_dapo.actor.batch import make_actor_batch

    gen = torch.Generator().manual_seed(100 + step)
    prompts = [
        torch.randint(0, 200, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen)
        for _ in range(8)
    ]
    responses = [
        torch.randint(0, 200, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen)
        for _ in range(8)
    ]
    return make_actor_batch(
        [p.tolist() for p in prompts],
        [r.tolist() for r in responses],
        advantages=torch.randn(8, generator=gen),
        group_index=[0, 0, 1, 1, 2, 2, 3, 3],
    )


def _actor(hf_dir, load_weights=True):
    from megatron_dapo.actor.actor import ActorConfig, build_actor
    from megatron_dapo.actor.optimizer import OptimizerSettings

    cfg = ActorConfig(ppo_mini_batch_size=2, micro_batch_max_tokens=24, shuffle=True, seed=3)
    # fully_reshardable: the resume below changes TP/PP (dp_reshardable refuses that;
    # test_checkpoint_distributed_optimizer covers it).
    optim = OptimizerSettings(
        lr=1e-2,
        lr_warmup_steps=2,
        lr_scheduler="cosine",
        min_lr=1e-3,
        weight_decay=0.1,
        adam_eps=1e-3,
        checkpoint_format="fully_reshardable",
    )
    return build_actor(hf_dir, cfg, optim, total_updates=12, load_weights=load_weights)


def _carried_batch():
    from megatron_dapo.data.types import PromptSample
    from megatron_dapo.rollout.types import RolloutBatch, RolloutSample

    prompt = PromptSample(3, "math_dapo", [], "q", [1, 2], "3", {})
    sample = RolloutSample(
        0, prompt, [4, 5], [-0.1, -2.5e-7], "45", "stop", 1.0, True, "3", 0.0, 1.0, 1, False
    )
    return RolloutBatch([sample], {"rollout/prompts_drawn": 1.0})


def _train(rank, world, hf_dir, root):
    from megatron_dapo.actor.checkpoint import save_checkpoint
    from megatron_dapo.actor.parallel import init_parallel
    from megatron_dapo.driver.carried import CARRIED_FILE, write_carried

    init_parallel(tp=2, pp=1)
    actor = _actor(hf_dir)
    lrs, rngs = [], []
    for step in range(3):
        actor.update(_batch(step))
        lrs.append(actor.optimizer.param_groups[0]["lr"])
        rngs.append(torch.get_rng_state())
        trainer = {"cursor": {"epoch": 0, "index": 4 * (step + 1)}, "metrics_lines": step + 1}
        extra = None
        if step == 2:  # as the async driver does: the carried batches, staged beside the root
            staged = Path(root) / ".carried.staging"
            if rank == 0:
                write_carried(staged, [_carried_batch()])
            extra = {CARRIED_FILE: str(staged)}
        save_checkpoint(
            root, step, actor, trainer_state=trainer, hf_dir=hf_dir, keep_last=2, extra_files=extra
        )
    return as_bytes(dict(state=hf_state(actor), lrs=lrs, rngs=rngs, actor_state=actor.state))


def _resume(rank, world, hf_dir, root):
    from megatron_dapo.actor.checkpoint import load_checkpoint
    from megatron_dapo.actor.parallel import init_parallel

    out = {}
    for tp, pp in ((2, 1), (1, 2)):
        init_parallel(tp=tp, pp=pp, seed=999)  # a different seed: the checkpoint's RNG must win
        actor = _actor(hf_dir, load_weights=False)
        record = load_checkpoint(actor, root, resume=str(Path(root) / "step_00000001"))
        rng_after_load = torch.get_rng_state()
        actor.update(_batch(record["step"] + 1))
        out[(tp, pp)] = dict(
            state=hf_state(actor),
            record={k: v for k, v in record.items() if k != "path"},
            lr=actor.optimizer.param_groups[0]["lr"],
            actor_state=actor.state,
            rng=rng_after_load,
        )
    return as_bytes(out)


@pytest.fixture(scope="module")
def runs(tiny_hf_checkpoint, tmp_path_factory):
    hf_dir = str(tiny_hf_checkpoint(**MODEL))
    root = tmp_path_factory.mktemp("ckpt") / "run"
    full = [from_bytes(r) for r in run_ranks(_train, 2, hf_dir, str(root), timeout_s=600)]
    resumed = [from_bytes(r) for r in run_ranks(_resume, 2, hf_dir, str(root), timeout_s=600)]
    return dict(root=root, full=full[0], resumed=resumed[0], full_ranks=full, resumed_ranks=resumed)


def test_resume_same_layout_is_bitwise_identical(runs):
    full, res = runs["full"], runs["resumed"][(2, 1)]
    assert res["record"]["step"] == 1
    assert res["record"]["trainer_state"] == {"cursor": {"epoch": 0, "index": 8}, "metrics_lines": 2}
    assert res["lr"] == full["lrs"][2]
    assert full["lrs"][0] == pytest.approx(1e-2) and full["lrs"][0] > full["lrs"][1] > full["lrs"][2] > 1e-3
    assert res["actor_state"] == full["actor_state"]
    assert full["state"].keys() == res["state"].keys()
    for name, w in full["state"].items():
        assert torch.equal(w, res["state"][name]), name


def test_resume_restores_rng_of_each_rank(runs):
    for full, resumed in zip(runs["full_ranks"], runs["resumed_ranks"]):
        assert torch.equal(resumed[(2, 1)]["rng"], full["rngs"][1])


def test_resume_into_other_layout_reshards_model_and_optimizer(runs):
    full, res = runs["full"], runs["resumed"][(1, 2)]
    assert res["record"]["step"] == 1 and res["lr"] == full["lrs"][2]
    for name, w in full["state"].items():
        diff = (res["state"][name] - w).abs().max()
        assert diff <= 1e-5 * w.abs().max(), (name, float(diff))


def test_latest_pointer_and_keep_last(runs):
    root = runs["root"]
    assert (root / "latest").read_text().strip() == "step_00000002"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step_00000001", "step_00000002"]
    ckpt = root / "step_00000002"
    assert (ckpt / "config.json").is_file() and (ckpt / "megatron_dapo_manifest.json").is_file()


def _copy(root: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(root, dst)
    return dst


def _biggest_file(ckpt: Path) -> Path:
    return max((p for p in ckpt.rglob("*.distcp")), key=lambda p: p.stat().st_size)


def test_truncated_checkpoint_named_and_auto_falls_back(runs, tmp_path, caplog):
    from megatron_dapo.actor.checkpoint import CheckpointError, find_resume_checkpoint

    root = _copy(runs["root"], tmp_path)
    victim = _biggest_file(root / "step_00000002")
    victim.write_bytes(victim.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=f"{victim.name}.*truncated"):
        find_resume_checkpoint(root, str(root / "step_00000002"))
    assert find_resume_checkpoint(root, "auto") == root / "step_00000001"
    assert "skipping checkpoint" in caplog.text


def test_carried_batches_are_adopted_into_the_checkpoint_and_covered_by_its_manifest(runs, tmp_path, caplog):
    """Rank 0 moved the staged file in before the manifest: it is listed (size, CRC), reads back
    equal, and a torn copy rejects the checkpoint in one line naming it, like any corrupt file."""
    import json

    from megatron_dapo.actor.checkpoint import MANIFEST, CheckpointError, find_resume_checkpoint
    from megatron_dapo.driver.carried import CARRIED_FILE, read_carried

    root = _copy(runs["root"], tmp_path)
    ckpt = root / "step_00000002"
    files = json.loads((ckpt / MANIFEST).read_text())["files"]
    assert files[CARRIED_FILE]["size"] == (ckpt / CARRIED_FILE).stat().st_size
    assert not (root / ".carried.staging").exists() and not (root / "step_00000001" / CARRIED_FILE).exists()
    assert read_carried(ckpt / CARRIED_FILE) == [_carried_batch()]
    victim = ckpt / CARRIED_FILE
    victim.write_bytes(victim.read_bytes()[:-1])
    with pytest.raises(CheckpointError) as e:
        find_resume_checkpoint(root, str(ckpt))
    assert f"{victim} is truncated" in str(e.value) and "\n" not in str(e.value)
    assert find_resume_checkpoint(root, "auto") == root / "step_00000001"
    assert CARRIED_FILE in caplog.text


def test_corrupt_bytes_detected_by_checksum(runs, tmp_path):
    from megatron_dapo.actor.checkpoint import CheckpointError, verify_checkpoint

    root = _copy(runs["root"], tmp_path)
    victim = _biggest_file(root / "step_00000001")
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{victim.name}.*CRC"):
        verify_checkpoint(root / "step_00000001")
    verify_checkpoint(root / "step_00000001", verify_checksums=False)  # same size: only the CRC sees it


def test_interrupted_save_is_ignored(runs, tmp_path):
    from megatron_dapo.actor.checkpoint import find_resume_checkpoint

    root = _copy(runs["root"], tmp_path)
    (root / "step_00000002" / "megatron_dapo_manifest.json").unlink()  # as if the save died
    (root / ".step_00000003.tmp").mkdir()
    assert find_resume_checkpoint(root, "auto") == root / "step_00000001"
    assert find_resume_checkpoint(tmp_path / "nothing", "auto") is None
    assert find_resume_checkpoint(root, "never") is None
