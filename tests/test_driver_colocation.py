"""The step loop's memory hand-over when engines share the actor's GPUs: engines give memory
back before the update, the actor's grads and optimizer state leave before the engines return
for the sync, its parameters after the sync, and nothing of this happens when not colocated."""

from megatron_dapo.config import load_config
from megatron_dapo.data.types import PromptSample
from megatron_dapo.driver.run_dir import RunDir
from megatron_dapo.driver.trainer import DAPOTrainer
from megatron_dapo.rollout.types import RolloutBatch, RolloutSample


class Log(list):
    pass


class FakeRanks:
    def __init__(self, log):
        self.log = log

    def call(self, method, *args, **kwargs):
        self.log.append(f"actor.{method}{args if method == 'offload' else ''}")
        return [
            {"load_checkpoint": None, "train_step": {"loss": 0.0}, "save_checkpoint": "ckpt"}.get(
                method, True
            )
        ]


class FakeEngine:
    def __init__(self, log):
        self.log = log

    def release_memory(self):
        self.log.append("engine.release")

    def resume_memory(self):
        self.log.append("engine.resume")


class FakeManager:
    def __init__(self, log):
        self.log = log

    def collect(self, dataset, version):
        self.log.append("rollout")
        prompt = PromptSample(0, "math_dapo", [], "q", [1, 2], "3", {})
        samples = [
            RolloutSample(0, prompt, [4, 5], [-0.1, -0.2], "", "stop", r, r > 0, "", 0.0, r, version, False)
            for r in (1.0, -1.0)
        ]
        return RolloutBatch(samples, {"rollout/prompts_drawn": 1})


class FakeData:
    def state_dict(self):
        return {}

    def load_state_dict(self, d):
        pass


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
        ranks=FakeRanks(log),
        manager=FakeManager(log),
        dataset=FakeData(),
        transport_sync=lambda v: log.append(f"sync{v}") or {},
        colocated_engines=[FakeEngine(log)] if colocated else [],
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
