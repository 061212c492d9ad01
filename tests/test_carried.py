"""Issue 13: the batches an async checkpoint carries live in their own file (driver/run_state.py).

The reference is the items themselves: what comes back equals what went in, floats and tensors
bit for bit (NaN, -0.0, infinities, subnormals included), in order, with other carried kinds
(the slot partial rollouts use) interleaved; a torn file is refused in one line naming it.
"""

from __future__ import annotations

import dataclasses
import math
import struct

import pytest
import torch

from megatron_dapo.data.types import PromptSample
from megatron_dapo.driver.run_state import read_carried, register_carried_type, write_carried
from megatron_dapo.rollout.partial import CarriedGroup, PartialSample, carry_from_items, carry_to_items
from megatron_dapo.rollout.types import RolloutBatch, RolloutSample
from megatron_dapo.weights.hf_io import CheckpointError


@dataclasses.dataclass
class PartialStandIn:
    """A stand-in for another kind of carried item (a generation paused mid-response)."""

    request_id: str
    prompt: PromptSample
    output_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]


register_carried_type("test_partial", PartialStandIn)


def _prompt(i: int) -> PromptSample:
    return PromptSample(
        index=i,
        data_source="math_dapo",
        messages=[{"role": "user", "content": f"Compute {i} + 1. ✓"}],
        prompt_text=f"Compute {i} + 1.",
        prompt_ids=[7, i, 2**20],
        ground_truth=str(i + 1),
        extra_info={"split": "train", "weights": [0.5, 1.0]},
    )


def _sample(i: int, n: int, experts_shape=(2, 3), version: int | None = 1) -> RolloutSample:
    g = torch.Generator().manual_seed(i)
    logprobs = (-torch.rand(n, generator=g, dtype=torch.float64) * 7).tolist()
    special = [-0.0, float("-inf"), float("nan"), -5e-324, -1.7976931348623157e308]
    logprobs[: min(n, len(special))] = special[:n]
    tokens = len(_prompt(i).prompt_ids) + n - 1
    return RolloutSample(
        group_id=i // 2,
        prompt=_prompt(i),
        response_ids=torch.randint(0, 151_000, (n,), generator=g).tolist(),
        rollout_logprobs=logprobs,
        response_text=f"{i} + 1 = {i + 1} — Answer: {i + 1}" if n else "",
        finish_reason="stop" if n % 2 else "length",
        score=1.0 if i % 2 else -1.0,
        acc=bool(i % 2),
        pred=str(i + 1),
        overlong_penalty=-0.25 * (i % 3),
        final_reward=0.1 + 0.2,  # a float that is not its short decimal
        weight_version=version,
        truncated=not n % 2,
        reward_error=None if i % 3 else "timed out",
        token_versions=None if version is None else [version] * n,
        routed_experts=None
        if experts_shape is None
        else torch.randint(0, 8, (tokens, *experts_shape), generator=g, dtype=torch.int32),
    )


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def assert_same(a, b, where="item"):
    """Equal, with floats compared by their bits and tensors by dtype, shape and bytes."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, float):
        assert _bits(a) == _bits(b), (where, a, b)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    else:
        assert a == b, (where, a, b)


def _items():
    batch = RolloutBatch(
        [_sample(0, 5), _sample(1, 0), _sample(2, 3, version=None), _sample(3, 1, experts_shape=None)],
        {"rollout/prompts_drawn": 12.0, "rollout/reward/mean": 1 / 3},
    )
    # routed experts of different shapes (another model) are stored one tensor per row, here one
    # tensor held by two rows (safetensors refuses to save shared memory as such); a lone
    # surrogate in a response text
    mixed = RolloutBatch([_sample(4, 2, (2, 3)), _sample(5, 2, (2, 3)), _sample(7, 1, (4, 2))], {})
    mixed.samples[1].routed_experts = mixed.samples[0].routed_experts
    mixed.samples[2].response_text = "half a character: \ud83d"
    partials = [
        PartialStandIn(f"r{i}", _prompt(i), [3, 4, i], [-0.5, -0.0, -1e-9], [0, 0, 1]) for i in range(3)
    ]
    empty_text = RolloutBatch([_sample(6, 0)], {})  # a column of empty strings only
    tail, _ = carry_to_items(_tail())  # rollout.partial's tail goes after the batches
    return [batch, partials[0], partials[1], RolloutBatch([], {}), mixed, partials[2], empty_text, *tail]


def _tail() -> list[CarriedGroup]:
    """rollout.partial's carried groups: responses unfinished (tokens of two versions), finished
    (with routed experts), unstarted (aborted before a token), and with versions unknown."""
    special = [-0.0, float("nan"), float("-inf"), -5e-324, -(0.1 + 0.2)]
    experts = torch.randint(0, 8, (6, 2, 3), generator=torch.Generator().manual_seed(9), dtype=torch.int16)
    return [
        CarriedGroup(
            _prompt(10),
            [
                PartialSample([5, 2**31 + 1, 0], special[:3], [3, 3, 4], None, 4, None, 1),
                PartialSample([9, 8], special[3:], [4, 4], "stop", 4, experts, 0),
            ],
        ),
        CarriedGroup(
            _prompt(11),
            [
                PartialSample([], [], [], None, None, None, 2),
                PartialSample([1, 2, 3], [-1.5] * 3, None, None, 3),
            ],
        ),
    ]


def test_carried_items_round_trip_bit_for_bit_in_order(tmp_path):
    items = _items()
    path = tmp_path / "carried.safetensors"
    size = write_carried(path, items)
    assert size == path.stat().st_size
    back = read_carried(path)
    assert_same(items, back)
    assert math.isnan(back[0].samples[0].rollout_logprobs[2])
    assert back[0].samples[0].routed_experts.dtype == torch.int32
    assert (
        write_carried(tmp_path / "none.safetensors", []) > 0
        and read_carried(tmp_path / "none.safetensors") == []
    )


def test_the_partial_tail_round_trips_bit_for_bit_behind_the_batches(tmp_path):
    # the trainer writes the carried batches, then the tail's items, and reads the tail back as
    # the items past the batches with the index the trainer state keeps
    batches = [RolloutBatch([_sample(0, 3)], {}), RolloutBatch([_sample(1, 2)], {})]
    tail = _tail()
    items, index = carry_to_items(tail)
    assert index == {"groups": 2, "samples": [2, 2]}
    write_carried(tmp_path / "c", batches + items)
    back = read_carried(tmp_path / "c")
    assert_same(batches, back[:2])
    groups = carry_from_items(back[2:], index)
    assert_same(tail, groups)
    assert groups[0].samples[0].token_versions == [3, 3, 4] and groups[1].samples[1].token_versions is None
    assert groups[0].samples[1].routed_experts.dtype == torch.int16
    assert carry_to_items([]) == ([], {})
    with pytest.raises(ValueError, match="index says 2 groups of 5 responses"):
        carry_from_items(back[2:], {"samples": [2, 3]})


def test_an_int_beyond_int64_still_round_trips():
    import tempfile

    s = _sample(0, 2)
    s.response_ids = [1, 2**70]
    with tempfile.TemporaryDirectory() as d:
        write_carried(f"{d}/c", [RolloutBatch([s], {})])
        assert read_carried(f"{d}/c")[0].samples[0].response_ids == [1, 2**70]


def test_a_torn_or_foreign_carried_file_is_refused_in_one_line_naming_it(tmp_path):
    path = tmp_path / "carried.safetensors"
    write_carried(path, _items())
    data = path.read_bytes()
    for cut in (len(data) - 100, 40, 3):
        torn = tmp_path / f"torn_{cut}.safetensors"
        torn.write_bytes(data[:cut])
        with pytest.raises(CheckpointError) as e:
            read_carried(torn)
        assert str(torn) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="missing.safetensors"):
        read_carried(tmp_path / "missing.safetensors")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "model.safetensors"))  # a weights file
    with pytest.raises(CheckpointError, match="model.safetensors.*format None"):
        read_carried(tmp_path / "model.safetensors")


def test_an_unregistered_item_is_refused_naming_the_fix(tmp_path):
    @dataclasses.dataclass
    class Unknown:
        x: int

    with pytest.raises(TypeError, match="register_carried_type"):
        write_carried(tmp_path / "c", [Unknown(1)])


def _episode(turns):
    from megatron_dapo.rollout.types import EpisodeInfo, EpisodeTurn

    return EpisodeInfo([EpisodeTurn(*t) for t in turns], key="v3-g1-s0").as_dict()


def test_multi_turn_samples_and_episodes_round_trip(tmp_path):
    """A multi-turn response's loss mask and turns travel with a carried batch (one_step_off) and
    with an unfinished episode of the partial tail, beside single-turn rows without them."""
    episode = _sample(0, 5)
    episode.loss_mask = [1, 1, 0, 0, 1]
    episode.episode = _episode(
        [("assistant", 0, 2, "stop", 1), ("tool", 2, 4, None, 1, 1, 0), ("assistant", 4, 5, "stop")]
    )
    batch = RolloutBatch([episode, _sample(1, 3)], {})
    mid_turn = PartialSample([5, 6, 0, 7], [-0.5, -1.0, 0.0, -2.0], [3, 3, 3, 3], None, 3, None, 1)
    mid_turn.loss_mask = [1, 1, 0, 1]
    mid_turn.episode = _episode(
        [("assistant", 0, 2, "stop", 1), ("tool", 2, 3, None, 1), ("assistant", 3, 4)]
    )
    tail, index = carry_to_items([CarriedGroup(_prompt(3), [mid_turn, PartialSample()])])
    write_carried(tmp_path / "c", [batch, *tail])
    back = read_carried(tmp_path / "c")
    assert_same([batch, *tail], back)
    assert back[0].samples[0].episode["turns"][1]["role"] == "tool" and back[0].samples[1].loss_mask is None
    (group,) = carry_from_items(back[1:], index)
    assert group.samples[0].episode == mid_turn.episode and group.samples[0].loss_mask == [1, 1, 0, 1]


def test_a_file_written_before_the_multi_turn_fields_still_loads(tmp_path, monkeypatch):
    """Checkpoints written before loss_mask/episode existed hold no such columns: their rows load
    with the fields' defaults (single-turn)."""
    import megatron_dapo.driver.run_state as run_state

    original = run_state._flatten

    def without_new_fields(row, prefix=""):
        return {k: v for k, v in original(row, prefix).items() if k not in ("loss_mask", "episode")}

    monkeypatch.setattr(run_state, "_flatten", without_new_fields)
    write_carried(tmp_path / "old", [RolloutBatch([_sample(0, 3)], {}), *carry_to_items(_tail())[0]])
    monkeypatch.undo()
    back = read_carried(tmp_path / "old")
    assert back[0].samples[0].loss_mask is None and back[0].samples[0].episode is None
    assert all(s.loss_mask is None and s.episode is None for s in back[3:])
