"""A checkpoint save that fails (a full disk on any rank) or is killed (SIGKILL mid-save) leaves
the previous checkpoint and `latest` intact, and the next resume uses it."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_dapo.actor.spawn import run_ranks

MODEL = dict(family="llama", tie_word_embeddings=True, num_layers=2, vocab=200, seed=9)
TESTS = Path(__file__).resolve().parent


def _actor(hf_dir):
    from megatron_dapo.actor.actor import ActorConfig, build_actor
    from megatron_dapo.actor.optimizer import OptimizerSettings

    cfg = ActorConfig(ppo_mini_batch_size=2, micro_batch_max_tokens=24, seed=3)
    return build_actor(hf_dir, cfg, OptimizerSettings(lr=1e-2, lr_warmup_steps=0), total_updates=4)


def _save_with_failure(rank, world, hf_dir, root, failing_rank, where):
    """Save step 1, then step 2 with ENOSPC on `failing_rank` at `where`; return what each saw."""
    import megatron_dapo.actor.checkpoint as ckpt
    from megatron_dapo.actor.parallel import init_parallel

    init_parallel(tp=2, pp=1)
    actor = _actor(hf_dir)
    ckpt.save_checkpoint(root, 1, actor, trainer_state={"step": 1}, hf_dir=hf_dir)
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if rank == failing_rank and where == "writer":
        original = ckpt.save_model_checkpoint  # weights.dist_ckpt's, as the checkpoint calls it

        def writer(*args, **kwargs):  # the collective part completes, this rank's flush fails
            original(*args, **kwargs)
            raise full

        ckpt.save_model_checkpoint = writer
    if rank == failing_rank and where == "manifest":

        def manifest(path, *args, **kwargs):
            (Path(path) / "megatron_dapo_manifest.json.tmp").write_text("{")
            raise full

        ckpt.write_manifest = manifest
    try:
        ckpt.save_checkpoint(root, 2, actor, trainer_state={"step": 2}, hf_dir=hf_dir)
    except ckpt.CheckpointError as e:
        return str(e)
    return None


@pytest.mark.parametrize("failing_rank,where", [(1, "writer"), (0, "writer"), (0, "manifest")])
def test_full_disk_keeps_the_previous_checkpoint(tiny_hf_checkpoint, tmp_path, failing_rank, where):
    from megatron_dapo.actor.checkpoint import find_resume_checkpoint

    hf_dir = str(tiny_hf_checkpoint(**MODEL))
    root = tmp_path / "ckpt"
    errors = run_ranks(_save_with_failure, 2, hf_dir, str(root), failing_rank, where, timeout_s=600)
    for message in errors:  # every rank stops, none hangs in a collective the other left
        assert message is not None and "No space left on device" in message, errors
        assert "step_00000002" in message and "step_00000001 is intact" in message
    assert (root / "latest").read_text().strip() == "step_00000001"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"], (
        "the partial copy is removed"
    )
    assert find_resume_checkpoint(root, "auto", strict=True) == root / "step_00000001"


def _save_then_hang(rank, world, hf_dir, root, marker):
    import megatron_dapo.actor.checkpoint as ckpt
    from megatron_dapo.actor.parallel import init_parallel

    init_parallel(tp=1, pp=1)
    actor = _actor(hf_dir)
    ckpt.save_checkpoint(root, 1, actor, trainer_state={"step": 1}, hf_dir=hf_dir)
    original = ckpt.write_manifest

    def slow_manifest(path, *args, **kwargs):  # the files are written; SIGKILL lands before the manifest
        Path(marker).write_text(str(os.getpid()))
        time.sleep(600)
        original(path, *args, **kwargs)

    ckpt.write_manifest = slow_manifest
    ckpt.save_checkpoint(root, 2, actor, trainer_state={"step": 2}, hf_dir=hf_dir)


def kill_target(hf_dir: str, root: str, marker: str) -> None:
    run_ranks(_save_then_hang, 1, hf_dir, root, marker, timeout_s=900)


def test_sigkill_mid_save_keeps_the_previous_checkpoint(tiny_hf_checkpoint, tmp_path):
    from megatron_dapo.actor.checkpoint import find_resume_checkpoint

    hf_dir = str(tiny_hf_checkpoint(**MODEL))
    root, marker = tmp_path / "ckpt", tmp_path / "saving"
    code = (
        f"import sys; sys.path.insert(0, {str(TESTS)!r}); from test_checkpoint_failures import kill_target; "
        f"kill_target({hf_dir!r}, {str(root)!r}, {str(marker)!r})"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert proc.poll() is None, "the saving process ended before it could be killed"
            assert time.monotonic() < deadline, "the second save never started"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert (root / ".step_00000002.tmp").is_dir(), "the kill should have landed mid-save"
    assert (root / "latest").read_text().strip() == "step_00000001"
    assert find_resume_checkpoint(root, "auto", strict=True) == root / "step_00000001"
