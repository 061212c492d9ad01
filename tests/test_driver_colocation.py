"""The step loop's memory hand-over when engines share the actor's GPUs: engines give memory
back before the update, the actor's grads and optimizer state leave before the engines return
for the sync, its parameters after the sync, and nothing of this happens when not colocated."""

from trainer_fakes import EmptyDataState, Log, LoggingEngine, LoggingRanks, OneGroupManager

from megatron_dapo.config import load_config
from megatron_dapo.driver.run_dir import RunDir
from megatron_dapo.driver.trainer import DAPOTrainer


def _run(tmp_path, colocated):
    log = Log()
    cfg = load_config(
        None,
        [
            "model.path=/m",
            f"trainer.runs_dir={tmp_path}",
            "trainer.total_steps=2",
            "trainer.train_batch_size=1",
            "actor.ppo_mini_batch_size=1",
            "rollout.n=2",
            "trainer.save_freq=0",
            "trainer.resume=never",
            "logging.progress=false",
            "logging.tensorboard=false",
        ],
    )
    trainer = DAPOTrainer(
        cfg,
        run=RunDir.create(tmp_path, "r"),
        ranks=LoggingRanks(log),
        manager=OneGroupManager(log),
        dataset=EmptyDataState(),
        transport_sync=lambda v: log.append(f"sync{v}") or {},
        colocated_engines=[LoggingEngine(log)] if colocated else [],
    )
    trainer.fit()
    return log


def test_colocated_hand_over_order(tmp_path):
    step = [
        "rollout",
        "engine.release",
        "actor.onload",
        "actor.train_step",
        "actor.offload(False,)",
        "engine.resume",
        "sync{}",
        "actor.offload()",
    ]
    expected = ["actor.offload()"]
    for v in (1, 2):
        expected += [x.format(v) for x in step]
    expected.insert(-1, "actor.save_checkpoint")  # the last step saves before parking the actor
    log = _run(tmp_path, colocated=True)
    assert log == expected


def test_no_hand_over_when_not_colocated(tmp_path):
    log = _run(tmp_path, colocated=False)
    assert not [x for x in log if "offload" in x or "onload" in x or x.startswith("engine.")]
    assert log == [
        "rollout",
        "actor.train_step",
        "sync1",
        "rollout",
        "actor.train_step",
        "sync2",
        "actor.save_checkpoint",
    ]
