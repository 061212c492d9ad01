"""Stand-ins for the trainer loop's tests (no Ray, no Megatron): ranks that only write checkpoint
directories the way the real ones lay them out, a dataset that is a cursor, a small config, and
the trainer built on them."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from megatron_dapo.config import load_config
from megatron_dapo.data.types import PromptSample
from megatron_dapo.driver.run_dir import RunDir
from megatron_dapo.driver.trainer import DAPOTrainer
from megatron_dapo.rollout.engine_pool import EnginePool
from megatron_dapo.rollout.types import RolloutBatch, RolloutSample


class FakeRanks:
    def __init__(self):
        self.calls = []

    def call(self, method, *args, **kwargs):
        self.calls.append((method, args))
        if method == "save_checkpoint":
            root, step, state, _keep = args
            path = Path(root) / f"step_{step:08d}"
            shutil.rmtree(path, ignore_errors=True)  # a re-save of a step replaces it, as the real one
            path.mkdir(parents=True)
            (path / "state.json").write_text(json.dumps(state))
            for name, src in kwargs.get("extra_files", {}).items():  # as rank 0 adopts them
                os.replace(src, path / name)
            (Path(root) / "latest").write_text(path.name + "\n")
            return [str(path)]
        return [None]


class FakeDataset:
    def __init__(self):
        self.index = 0

    def next_batch(self, n):
        """The positions drawn: the cursor's next ``n``."""
        self.index += n
        return list(range(self.index - n, self.index))

    def state_dict(self):
        return {"index": self.index}

    def load_state_dict(self, state):
        self.index = state["index"]


def trainer_config(tmp_path, **over):
    """A 5-step config under ``tmp_path`` (4 prompts x 2 samples); ``over`` wins."""
    base = {
        "model.path": str(tmp_path / "no_model"),
        "trainer.runs_dir": str(tmp_path),
        "trainer.run_name": "r",
        "trainer.total_steps": 5,
        "trainer.train_batch_size": 4,
        "rollout.gen_batch_size": 4,
        "rollout.n": 2,
        "actor.ppo_mini_batch_size": 4,
        "trainer.val_before_train": "false",
        "logging.progress": "false",
    }
    base.update(over)
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


def make_trainer(cfg, ranks, manager, dataset, stop):
    run = RunDir.create(cfg.trainer.runs_dir, cfg.trainer.run_name)
    return DAPOTrainer(
        cfg, run=run, ranks=ranks, manager=manager, dataset=dataset, transport_sync=lambda v: {}, stop=stop
    )


class Log(list):
    """The order of calls across ranks, engines and the manager."""


class LoggingRanks:
    """Ranks that log every call (with offload's argument) and answer like the real ones."""

    def __init__(self, log):
        self.log = log

    def call(self, method, *args, **kwargs):
        self.log.append(f"actor.{method}{args if method == 'offload' else ''}")
        return [
            {"load_checkpoint": None, "train_step": {"loss": 0.0}, "save_checkpoint": "ckpt"}.get(
                method, True
            )
        ]


class LoggingEngine:
    """An engine that logs the memory hand-over calls only."""

    def __init__(self, log):
        self.log = log

    def release_memory(self):
        self.log.append("engine.release")

    def resume_memory(self):
        self.log.append("engine.resume")


class FakeManager:
    """The whole rollout-manager protocol (rollout/manager_protocol.py) with nothing behind it: no
    engines, no state to checkpoint (``state_dict`` None), a partial tail only when one is loaded,
    and a pause that settles at once. A test's manager subclasses it and writes ``collect`` (and
    whatever else it observes)."""

    def __init__(self):
        self.pool = EnginePool([])
        self.should_stop = None
        self.carried_groups = []

    def collect(self, dataset, weight_version):
        raise AssertionError(f"{type(self).__name__} must define collect")

    def state_dict(self):
        return None

    def load_state_dict(self, state):
        pass

    def partial_groups(self):
        return list(self.carried_groups)

    def load_partial_groups(self, groups):
        self.carried_groups = list(groups)

    def pause(self, timeout_s):
        return True

    def resume(self):
        pass


class OneGroupManager(FakeManager):
    """A rollout manager that returns one group of two samples (rewards +1 and -1) per step."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def collect(self, dataset, version):
        self.log.append("rollout")
        prompt = PromptSample(0, "math_dapo", [], "q", [1, 2], "3", {})
        samples = [
            RolloutSample(0, prompt, [4, 5], [-0.1, -0.2], "", "stop", r, r > 0, "", 0.0, r, version, False)
            for r in (1.0, -1.0)
        ]
        return RolloutBatch(samples, {"rollout/prompts_drawn": 1})


class EmptyDataState:
    """A dataset whose only duty is to be checkpointed."""

    def state_dict(self):
        return {}

    def load_state_dict(self, d):
        pass


def fake_sample(
    group: int,
    j: int,
    token_versions: list[int],
    prompt_ids: list[int] | None = None,
    logprobs: list[float] | None = None,
    prompt_index: int | None = None,
):
    """A scored RolloutSample of prompt ``group``, response ``j`` (score and reward ``j``), one
    response token per entry of ``token_versions``, its weight version the oldest of them.
    ``prompt_index``: the prompt's dataset position (``PromptSample.index``), default ``group``."""
    from megatron_dapo.data.types import PromptSample
    from megatron_dapo.rollout.types import RolloutSample

    prompt = PromptSample(
        index=group if prompt_index is None else prompt_index,
        data_source="d",
        messages=[],
        prompt_text="p",
        prompt_ids=prompt_ids or [1],
        ground_truth="1",
    )
    return RolloutSample(
        group_id=group,
        prompt=prompt,
        response_ids=[3] * len(token_versions),
        rollout_logprobs=logprobs or [-0.5] * len(token_versions),
        response_text="r",
        finish_reason="stop",
        score=float(j),
        acc=bool(j),
        pred="",
        overlong_penalty=0.0,
        final_reward=float(j),
        weight_version=min(token_versions),
        truncated=False,
        token_versions=token_versions,
    )
