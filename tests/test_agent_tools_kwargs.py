"""verl's per-sample tool arguments: a dataset row's ``extra_info.tools_kwargs`` reaches each verl
class tool's ``create`` (the ground truth a gsm8k-style tool checks answers against), through the
rollout manager's requests, the episode runner and the tool process; and a continued episode
keeps them."""

from __future__ import annotations

from test_agent_partial import _Scorer
from test_agent_runner import EOT, BracketCalls, CharChat, CharTokenizer, Scripted, toks

from megatron_dapo.agent.runner import AppendOnly, MultiTurn, MultiTurnSettings
from megatron_dapo.agent.tools.host import ToolHost
from megatron_dapo.agent.tools.spec import ToolSpec, check_schema
from megatron_dapo.data.types import PromptSample
from megatron_dapo.rollout.manager import RolloutManager, RolloutManagerConfig
from megatron_dapo.rollout.partial import PartialSample, continuation
from megatron_dapo.rollout.types import SamplingParams

SCHEMA = {
    "type": "function",
    "function": {
        "name": "answer_key",
        "description": "Checks an answer.",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
    },
}
KEYS = {0: "42", 1: "7"}


class _Prompts:
    def next_batch(self, n):
        assert n == 2
        return [
            PromptSample(
                i,
                "none",
                [],
                f"p{i}",
                toks("Q?"),
                KEYS[i],
                {"tools_kwargs": {"answer_key": {"create_kwargs": {"ground_truth": KEYS[i]}}}},
            )
            for i in range(2)
        ]


def _config():
    return RolloutManagerConfig(
        n=1,
        gen_batch_size=2,
        train_batch_size=2,
        max_num_gen_batches=1,
        filter_groups_enable=False,
        filter_metric="acc",
        allow_partial_batch=False,
        overlong_buffer_enable=False,
        overlong_buffer_len=4,
        overlong_penalty_factor=1.0,
        max_response_length=100,
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        stop_token_ids=[EOT],
        seed=5,
        over_sample=False,
        max_over_sample_factor=1.0,
        max_concurrency_per_engine=64,
        groups_per_call=2,
        request_timeout_s=600.0,
        max_retries=2,
        partial=False,
        health_probe_interval_s=600.0,
    )


def _spec():
    return ToolSpec(
        "answer_key",
        check_schema(SCHEMA, "test"),
        "verl_class",
        "tests.fixtures.agent_tools.verl_answer_key.AnswerKeyTool",
        {},
    )


def test_a_rows_tools_kwargs_reach_the_verl_tools_create():
    spec = _spec()
    settings = MultiTurnSettings(3, None, 100, "right", 1)
    script = {"v0-g0-s0": ["[answer_key:42]$", "ok$"], "v0-g1-s0": ["[answer_key:42]$", "ok$"]}
    with ToolHost([spec], timeout_s=30, workers=1, memory_mb=1024) as host:
        runner = MultiTurn(settings, AppendOnly(CharChat()), host, BracketCalls(), CharTokenizer())
        manager = RolloutManager([Scripted(script)], _Scorer(), _config(), CharTokenizer(), episodes=runner)
        batch = manager.collect(_Prompts(), weight_version=0)
    answers = {}
    for s in batch.samples:
        tool = next(t for t in s.episode["turns"] if t["role"] == "tool")
        answers[s.prompt.index] = CharTokenizer().decode(s.response_ids[tool["start"] : tool["end"]])
    assert answers == {0: "\n<42 vs key 42>\n", 1: "\n<42 vs key 7>\n"}


def test_validation_hands_a_problems_tools_kwargs_to_the_tools():
    from megatron_dapo.driver.validation import engine_generator
    from megatron_dapo.eval.runner import EvalProblem

    problems = [
        EvalProblem(
            f"q{i}",
            "Q?",
            toks("Q?"),
            "none",
            KEYS[i],
            {"tools_kwargs": {"answer_key": {"create_kwargs": {"ground_truth": KEYS[i]}}}},
        )
        for i in range(2)
    ]
    script = {f"val-q{i}-0": ["[answer_key:7]$", "ok$"] for i in range(2)}
    with ToolHost([_spec()], timeout_s=30, workers=1, memory_mb=1024) as host:
        runner = MultiTurn(
            MultiTurnSettings(3, None, 100, "right", 1),
            AppendOnly(CharChat()),
            host,
            BracketCalls(),
            CharTokenizer(),
        )
        generate = engine_generator(
            [Scripted(script)],
            CharTokenizer(),
            SamplingParams(max_new_tokens=100, stop_token_ids=[EOT]),
            seed=0,
            episodes=runner,
        )
        rows = generate(problems, 1)
    tools = [row[0].extra_info["turns"][1]["content"] for row in rows]
    assert tools == ["\n<7 vs key 42>\n", "\n<7 vs key 7>\n"]


def test_a_continued_episode_keeps_its_tools_kwargs():
    kwargs = {"answer_key": {"create_kwargs": {"ground_truth": "42"}}}
    sample = PartialSample(output_ids=toks("[ans"), logprobs=[0.0] * 4, token_versions=[0] * 4)
    again = continuation("r", toks("Q?"), sample, SamplingParams(max_new_tokens=10), tools_kwargs=kwargs)
    assert again.tools_kwargs == kwargs and again.prompt_ids == toks("Q?[ans")
