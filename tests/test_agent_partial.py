"""A multi-turn episode interrupted and continued equals the uninterrupted one (HF engine, seeded,
sampled at T=1): the runner resumes it mid-turn from its exact tokens, skips the draws the turn
already spent (``seed_offset``), and the tool answers and later turns follow as they would have.
Interrupted once by the engine's own abort inside a turn (at each decode step of the first two
turns in turn), and once by a real weight-sync pause of the rollout manager."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import tiny_hf_config

from megatron_dapo.agent.calls import ToolCall
from megatron_dapo.agent.runner import AppendOnly, MultiTurn, MultiTurnSettings
from megatron_dapo.agent.tools.host import ToolHost
from megatron_dapo.agent.tools.spec import builtin_spec
from megatron_dapo.data.types import PromptSample
from megatron_dapo.rollout.hf_engine import HFEngine
from megatron_dapo.rollout.manager import RolloutManager, RolloutManagerConfig
from megatron_dapo.rollout.partial import continuation, from_result, join
from megatron_dapo.rollout.types import GenerationRequest, SamplingParams

VOCAB = 128
# a third of the vocabulary ends a turn: turns of a few tokens, several per episode
STOPS = list(range(0, 40))


class AddCalls:
    """Every turn asks the calculator for 2+3 (the call's answer is the same text every time)."""

    def parse(self, text):
        return [ToolCall("calculator", {"expression": "2+3"})]


class DigitChat:
    """The environment's answer as token ids: a header, its characters, a footer."""

    end_of_turn_ids = [0]

    def env_ids(self, messages, *, ended_with_eot=True):
        body = [100 + (ord(c) % 20) for m in messages for c in m["content"]]
        return [120, *body, 121]

    def truncate(self, text, max_tokens, side):
        return text[:max_tokens]

    def rerender(self, turns):
        """Every turn as the episode holds it: this template renders nothing around them."""
        ids = []
        for role, value in turns:
            ids += list(value) if role == "assistant" else self.env_ids([{"content": c} for c in value])
        return [], ids


class IdTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    m = AutoModelForCausalLM.from_config(
        tiny_hf_config(vocab=VOCAB, hidden=32, heads=4, kv_heads=2), dtype=torch.float32
    )
    return m.eval()


@pytest.fixture(scope="module")
def tools():
    with ToolHost([builtin_spec("calculator")], timeout_s=10, workers=1, memory_mb=1024) as host:
        yield host


def _runner(tools):
    settings = MultiTurnSettings(
        max_assistant_turns=3,
        max_turn_tokens=None,
        max_tool_response_tokens=8,
        tool_response_truncate_side="right",
        max_parallel_calls=1,
    )
    return MultiTurn(settings, AppendOnly(DigitChat()), tools, AddCalls(), IdTokenizer())


def _requests():
    return [
        GenerationRequest(
            f"e{i}",
            [7 + i, 50 + i, 9],
            SamplingParams(temperature=1.0, max_new_tokens=40, seed=1000 + i, stop_token_ids=STOPS),
        )
        for i in range(3)
    ]


def _same(a, b):
    assert a.output_ids == b.output_ids
    assert a.loss_mask == b.loss_mask
    assert a.episode.as_dict() == b.episode.as_dict()
    assert a.finish_reason == b.finish_reason
    torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)


def test_an_episode_aborted_mid_turn_and_continued_equals_the_uninterrupted_one(model, tools):
    engine = HFEngine(model=model)
    whole = _runner(tools).run(engine, _requests(), threading.Event())
    assert all(len(r.episode.assistant_turns()) >= 2 for r in whole), "episodes of several turns"
    assert any(0 in r.loss_mask for r in whole), "tool answers inside the responses"
    first_turn = max(t.end - t.start for r in whole for t in r.episode.turns[:1])
    where = set()  # (assistant turn, tokens into it) at which an episode was cut
    cuts = 0
    for abort_at in range(2, first_turn + 12):  # forwards: inside turn 0, then inside turn 1
        forwards = []

        def hook(*_, at=abort_at, forwards=forwards):
            forwards.append(1)
            if len(forwards) == at:
                engine.abort()

        handle = model.register_forward_hook(hook)
        cut = _runner(tools).run(engine, _requests(), threading.Event())
        handle.remove()
        # an abort reaches the turns in flight; one that lands on the forward in which the last
        # of them stops (the others waiting for their tools) cuts nothing, and the run goes on
        cuts += any(r.finish_reason == "abort" for r in cut)
        for r in cut:
            if r.finish_reason == "abort" and r.episode.turns[-1].role == "assistant":
                turn = r.episode.turns[-1]
                where.add((len(r.episode.assistant_turns()) - 1, turn.end - turn.start))
        kept = [from_result(r, None) for r in cut]
        again = [
            continuation(q.request_id, q.prompt_ids, k, q.sampling) if not k.finished else None
            for q, k in zip(_requests(), kept)
        ]
        rest = _runner(tools).run(engine, [q for q in again if q is not None], threading.Event())
        rest_by_id = {r.request_id: r for r in rest}
        for w, c, k in zip(whole, cut, kept):
            joined = c if k.finished else join(k, rest_by_id[w.request_id])
            _same(joined, w)
    # cut inside the first and the second model turn, after some of the turn's tokens
    assert {t for t, n in where if n > 0} >= {0, 1}, where
    assert cuts >= 3, cuts


class _Prompts:
    def __init__(self):
        self.cursor = 0

    def next_batch(self, n):
        out = [
            PromptSample(i, "none", [], f"p{i}", [7 + i, 50 + i, 9], "1", {})
            for i in range(self.cursor, self.cursor + n)
        ]
        self.cursor += n
        return out


class _Scorer:
    def score_many(self, items):
        class R:
            score, acc, pred, error = 0.0, False, "", None

        return [R() for _ in items]


def _manager(engine, tools):
    cfg = RolloutManagerConfig(
        n=2,
        gen_batch_size=3,
        train_batch_size=3,
        max_num_gen_batches=1,
        filter_groups_enable=False,
        filter_metric="acc",
        allow_partial_batch=False,
        overlong_buffer_enable=False,
        overlong_buffer_len=4,
        overlong_penalty_factor=1.0,
        max_response_length=40,
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        stop_token_ids=STOPS,
        seed=5,
        over_sample=False,
        max_over_sample_factor=1.0,
        max_concurrency_per_engine=64,
        groups_per_call=3,
        request_timeout_s=600.0,
        max_retries=2,
        partial=True,
        health_probe_interval_s=600.0,
    )
    return RolloutManager([engine], _Scorer(), cfg, IdTokenizer(), episodes=_runner(tools))


def test_a_weight_sync_pause_mid_episode_continues_it_exactly(model, tools):
    """The manager pauses the rollout (rollout.partial, as one_step_off does for a sync) while the
    episodes are in their second model turn, and resumes with the same weights: the batch equals
    an uninterrupted rollout's."""
    whole = _manager(HFEngine(model=model), tools).collect(_Prompts(), weight_version=0)

    engine = HFEngine(model=model)
    manager = _manager(engine, tools)
    forwards, paused = [], []

    def pause_in_turn_two(*_):
        forwards.append(1)
        if len(forwards) == 12 and not paused:  # prefill + decode of turn 0, then turn 1's
            paused.append(threading.Thread(target=lambda: (manager.pause(60), manager.resume())))
            paused[0].start()
            paused[0].join(0.2)  # the abort lands before this forward's token is sampled

    handle = model.register_forward_hook(pause_in_turn_two)
    batch = manager.collect(_Prompts(), weight_version=0)
    handle.remove()
    paused[0].join(60)
    assert sum(s.interrupted for s in batch.samples) > 0, "the pause must have hit the episodes"
    # a pause's abort is no failure: nothing retried (a retry counts towards max_retries)
    assert batch.metrics["rollout/retries"] == 0
    for got, want in zip(batch.samples, whole.samples):
        assert got.response_ids == want.response_ids and got.loss_mask == want.loss_mask
        assert got.episode == want.episode
        torch.testing.assert_close(
            torch.tensor(got.rollout_logprobs), torch.tensor(want.rollout_logprobs), rtol=0, atol=1e-5
        )
