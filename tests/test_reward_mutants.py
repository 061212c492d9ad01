"""Checks that once let a wrong implementation pass: a served copy reused although its original's
weights changed (a fingerprint of nothing), a response scored early taken as the final one though
its episode differs (only the token half compared), and supervision's thread that never restarts."""

from __future__ import annotations

import json
import threading
import time

import torch
from reward_model_fixtures import make_tiny_classifier, served_settings
from test_reward_server_supervision import Events, Process

from megatron_dapo.rewards.served import prepare_served_checkpoint
from megatron_dapo.rewards.served.checkpoint import MANIFEST
from megatron_dapo.rollout.manager import _same_response
from megatron_dapo.rollout.types import EpisodeInfo, EpisodeTurn, GenerationResult
from megatron_dapo.sglang.reward_servers import RewardServer, RewardServers


def test_a_served_copy_is_rebuilt_when_the_original_s_weights_change(tmp_path):
    rm = make_tiny_classifier(tmp_path / "rm")
    first = json.loads((prepare_served_checkpoint(rm, tmp_path / "served").path / MANIFEST).read_text())
    time.sleep(0.01)
    make_tiny_classifier(rm, seed=1, dtype=torch.bfloat16)  # new weights, same file names
    copy = prepare_served_checkpoint(rm, tmp_path / "served")
    second = json.loads((copy.path / MANIFEST).read_text())
    assert second["fingerprint"] != first["fingerprint"]
    assert prepare_served_checkpoint(rm, tmp_path / "served") == copy  # and reused while unchanged


def _result(ids, episode):
    return GenerationResult("r0", list(ids), [0.0] * len(ids), "stop", episode=episode)


def test_a_response_with_the_same_tokens_but_another_episode_is_not_the_same_response():
    one = EpisodeInfo([EpisodeTurn("assistant", 0, 2, "stop", calls=1), EpisodeTurn("tool", 2, 3)], "stop")
    other = EpisodeInfo([EpisodeTurn("assistant", 0, 1, "stop", calls=1), EpisodeTurn("tool", 1, 3)], "stop")
    assert _same_response(_result([1, 2, 3], one), _result([1, 2, 3], EpisodeInfo.from_dict(one.as_dict())))
    assert not _same_response(_result([1, 2, 3], one), _result([1, 2, 3], other))
    assert not _same_response(_result([1, 2, 3], one), _result([1, 2, 3], None))
    assert not _same_response(_result([1, 2, 3], None), _result([1, 2, 4], None))


def test_the_watch_thread_restarts_a_dead_server_and_tells_the_client():
    proc = Process(dead=True)
    servers = RewardServers(
        served_settings(kind="judge", path="/judge"), [RewardServer("http://h:3", "/log", proc)], None
    )
    servers.poll_s = 0.05
    events = Events()
    back = threading.Event()
    events.server_back = lambda url: (Events.server_back(events, url), back.set())
    servers.watch(events)
    try:
        assert back.wait(10), "the watch thread never restarted the dead server"
    finally:
        servers.stop()
    assert proc.restarts == 1 and events.back == ["http://h:3"] and proc.stops == 1  # stop() stops it
