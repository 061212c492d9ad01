"""The trainer reaches the rollout manager only through `ManagerProtocol`: the real manager and
the tests' full fake both provide every member of it (the trainer probes for none)."""

from __future__ import annotations

import inspect

from rollout_fakes import Scorer, ScriptedEngine, Tokenizer, manager_config
from trainer_fakes import FakeManager

from megatron_dapo.rollout.manager import RolloutManager
from megatron_dapo.rollout.manager_protocol import ManagerProtocol


def _members() -> set[str]:
    names = {n for n, _ in inspect.getmembers(ManagerProtocol, inspect.isfunction) if not n.startswith("_")}
    return names | set(ManagerProtocol.__annotations__)


def test_the_manager_and_the_fake_have_every_member_of_the_protocol():
    assert _members() == {
        "pool",
        "should_stop",
        "collect",
        "state_dict",
        "load_state_dict",
        "partial_groups",
        "load_partial_groups",
        "pause",
        "resume",
    }
    real = RolloutManager([ScriptedEngine("e0")], Scorer(), manager_config(), Tokenizer())
    for manager in (real, FakeManager()):
        missing = [n for n in _members() if not hasattr(manager, n)]
        assert missing == [], f"{type(manager).__name__} lacks {missing}"
