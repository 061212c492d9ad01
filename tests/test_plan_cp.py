"""The planner's memory model accounts for context parallelism: each CP rank holds 1/cp of every
sequence (activations and logits) and the distributed optimizer shards over DP x CP."""

from __future__ import annotations

import pytest

from megatron_dapo.plan import Assumptions, PlanInputs
from megatron_dapo.plan.models import ModelShape
from megatron_dapo.plan.planner import actor_stages

TINY = ModelShape("tiny", 64, 128, 4, 4, 2, 250, False, 16)


def _stage(cp: int):
    # Same DP (1) for both, so only the CP split differs.
    p = PlanInputs(
        model_path="tiny",
        cp=cp,
        actor_world_size=cp,
        max_prompt_length=512,
        max_response_length=3584,
        micro_batch_max_tokens=4096,
    )
    stages, _ = actor_stages(p, TINY, Assumptions(), mean_seq=2048.0)
    return stages[0]


def test_cp2_halves_activations_logits_and_optimizer_state_per_rank():
    one, two = _stage(1), _stage(2)
    assert two.params == one.params  # CP does not shard weights
    assert two.activations == pytest.approx(one.activations / 2)
    assert two.activations_other == pytest.approx(one.activations_other / 2)
    assert two.logits == pytest.approx(one.logits / 2)
    assert two.state.total < one.state.total  # optimizer shards over dp*cp = 2
