"""`megatron-dapo demo --task calculator`: the task and its split, the compact call format and how a
config names it, the tokenizer variant, the lazy teacher's episodes (the tokens the RL episodes
get, loss on the model's tokens only), the warm start's tool-call rate, and two DAPO steps of
multi-turn episodes through Ray with the HF engine. The template's contract with the bridge is
tests/test_agent_bridge.py's (CONTRACT_CASES["demo-calculator"])."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import pytest

from megatron_dapo.agent.calls import get_call_format
from megatron_dapo.agent.from_config import call_format
from megatron_dapo.agent.runner import AppendOnly, MultiTurn
from megatron_dapo.config import ConfigError
from megatron_dapo.demo.calculator.assets import episode_settings
from megatron_dapo.demo.calculator.calls import FORMAT, CompactCalls
from megatron_dapo.demo.calculator.recipe import CALCULATOR_RECIPE
from megatron_dapo.demo.calculator.task import MIN_PRODUCT, make_products, split_pairs
from megatron_dapo.demo.calculator.teacher import Teacher, calculator, sampled_episodes, tools_of
from megatron_dapo.demo.sft import _collate
from megatron_dapo.demo.task import to_rows
from megatron_dapo.demo.tokenizer import build_calculator_tokenizer, build_tokenizer
from megatron_dapo.rewards.math_dapo import compute_score
from megatron_dapo.rollout.types import GenerationRequest, GenerationResult, SamplingParams

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "configs" / "tools" / "calculator.yaml"
SCHEMA = [{"type": "function", "function": {"name": "calculator", "description": "", "parameters": {}}}]


def product_of(expression: str) -> str:
    a, b = expression.split(" * ")
    return str(int(a) * int(b))


# -- the task ------------------------------------------------------------------------------------


def test_split_is_disjoint_in_a_b_and_every_product_has_five_digits():
    train, val = split_pairs(seed=0, num_val=200)
    assert len(val) == 200 and not set(train) & set(val)
    assert all(100 <= a <= 999 and 10 <= b <= 99 and a * b >= MIN_PRODUCT for a, b in train + val)
    tr, va = make_products(seed=0, num_train=4000, num_val=200)
    assert make_products(seed=0, num_train=4000, num_val=200) == (tr, va)
    assert len({(p.a, p.b) for p in tr}) == 4000 and not {(p.a, p.b) for p in tr} & {(p.a, p.b) for p in va}
    assert make_products(seed=1, num_train=4000, num_val=200)[1] != va


def test_rows_are_math_dapo_and_the_reply_scores_on_its_answer_line():
    _, val = make_products(seed=0, num_train=10, num_val=20)
    row = to_rows(val, "test")[3]
    p = val[3]
    assert row["prompt"] == [{"role": "user", "content": f"Compute {p.a} * {p.b}."}]
    assert row["data_source"] == "math_dapo" and row["reward_model"]["ground_truth"] == str(p.a * p.b)
    assert compute_score(f"Answer: {p.a * p.b}", str(p.answer))["score"] == 1.0
    assert compute_score(f"[{p.expression}]", str(p.answer))["score"] == -1.0  # a call is not an answer


def test_the_config_holds_the_recipe_the_warm_start_was_built_for():
    from megatron_dapo.config import load_config

    cfg = load_config(REPO / "configs" / "demo_calculator.yaml")
    r, mt = CALCULATOR_RECIPE, cfg.rollout.multi_turn
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (
        r.max_prompt_length,
        r.max_response_length,
    )
    assert (mt.max_assistant_turns, mt.max_turn_tokens) == (r.max_assistant_turns, r.max_turn_tokens)
    settings = episode_settings(r, 256)
    assert (mt.max_tool_response_tokens, mt.max_parallel_calls) == (
        settings.max_tool_response_tokens,
        settings.max_parallel_calls,
    )
    assert mt.enable and mt.format == FORMAT and Path(mt.tool_config_path) == TOOLS.relative_to(REPO)
    assert (cfg.rollout.val.n, cfg.rollout.val.temperature, cfg.rollout.val.top_p) == (
        r.val_k,
        r.val_temperature,
        r.val_top_p,
    )


# -- the call format -----------------------------------------------------------------------------


def test_compact_calls_parse_the_calculator_shorthand_named_calls_and_malformed_ones():
    parse = CompactCalls().parse
    (call,) = parse("[347 * 48]<|end|>")
    assert (call.name, call.arguments, call.error) == ("calculator", {"expression": "347 * 48"}, None)
    assert parse("Answer: 16656<|end|>") == []
    (named,) = parse('[get_weather:{"city": "Rome [centre]"}]')
    assert (named.name, named.arguments, named.error) == ("get_weather", {"city": "Rome [centre]"}, None)
    assert [c.arguments["expression"] for c in parse("[1 + 2] then [3 * 4]")] == ["1 + 2", "3 * 4"]
    (open_call,) = parse("[347 * 4")
    assert open_call.error and "not closed with ']'" in open_call.error
    (bad_json,) = parse("[f:{nope}]")
    assert bad_json.name == "f" and "not JSON" in bad_json.error


def test_a_config_names_a_format_by_its_module_or_file(tmp_path):
    assert isinstance(call_format(FORMAT), CompactCalls)
    assert isinstance(get_call_format("demo_calc"), CompactCalls)  # registered beside hermes
    user = tmp_path / "my_format.py"
    user.write_text(
        "from megatron_dapo.agent.calls import register_call_format\n"
        "class Mine:\n"
        "    name = 'mine_from_file'\n"
        "    def parse(self, text):\n"
        "        return []\n"
        "register_call_format(Mine())\n"
    )
    assert type(call_format(f"{user}:mine_from_file")).__name__ == "Mine"
    with pytest.raises(ConfigError, match=r"rollout\.multi_turn\.format=.*did not register 'other'"):
        call_format(f"{user}:other")
    with pytest.raises(
        ConfigError, match=r"format='no_such_module_x:fmt': importing 'no_such_module_x' failed"
    ):
        call_format("no_such_module_x:fmt")


# -- the tokenizer and template --------------------------------------------------------------------


def test_calculator_tokenizer_keeps_every_id_of_the_arithmetic_demo():
    plain, calc = build_tokenizer(), build_calculator_tokenizer()
    plain_vocab, calc_vocab = plain.get_vocab(), calc.get_vocab()
    assert len(plain) == len(calc) == 128
    assert calc_vocab["<|tool|>"] == plain_vocab["<|reserved_0|>"]
    assert {t: i for t, i in calc_vocab.items() if t != "<|tool|>"} == {
        t: i for t, i in plain_vocab.items() if t != "<|reserved_0|>"
    }
    assert "<|tool|>" in calc.all_special_tokens and "<|tool|>" not in plain.all_special_tokens
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "347 * 48"}}}
    text = calc.apply_chat_template(
        [
            {"role": "user", "content": "Compute 347 * 48."},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "16656"},
        ],
        tools=SCHEMA,
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = "<|bos|><|tool|>calculator<|user|>Compute 347 * 48.<|assistant|>"
    assert text == prompt + "[347 * 48]<|end|><|tool|>16656<|assistant|>"
    assert calc.decode(calc.encode(text, add_special_tokens=False), skip_special_tokens=True) == (
        "calculatorCompute 347 * 48.[347 * 48]16656"
    )


# -- the lazy teacher's episodes -----------------------------------------------------------------


def test_teacher_episode_masks_the_tool_answer_and_trains_on_the_model_turns():
    tok = build_calculator_tokenizer()
    teacher = Teacher(tok, SCHEMA, product_of, seed=0)
    train, _ = make_products(seed=0, num_train=50, num_val=10)
    p = train[0]
    prompt, response, mask = teacher.encode(p, lazy=False)
    assert len(prompt) == 31 <= CALCULATOR_RECIPE.max_prompt_length
    assert len(response) == 32 <= CALCULATOR_RECIPE.max_response_length
    sampled = tok.decode([t for t, m in zip(response, mask) if m])
    environment = tok.decode([t for t, m in zip(response, mask) if not m])
    assert sampled == f"[{p.a} * {p.b}]<|end|>Answer: {p.answer}<|end|>"
    assert environment == f"<|tool|>{p.answer}<|assistant|>"
    assert mask == [1] * 11 + [0] * 7 + [1] * 14
    _, labels_of = _collate_labels(prompt, response, mask)
    assert labels_of == [t if m else -100 for t, m in zip(response, mask)]

    prompt2, guess, guess_mask = teacher.encode(p, lazy=True)
    assert prompt2 == prompt and guess_mask == [1] * len(guess)
    text = tok.decode(guess, skip_special_tokens=True)
    assert text.startswith("Answer: ") and len(text) == len("Answer: ") + 5
    assert compute_score(text, str(p.answer))["score"] == -1.0
    assert teacher.encode(p, lazy=True) == (prompt, guess, guess_mask)  # the same guess every time


def _collate_labels(prompt, response, mask):
    ids, _, labels = _collate([(prompt, response, mask)], pad_id=0)
    return ids[0].tolist(), labels[0, len(prompt) :].tolist()


class ScriptedEngine:
    """Answers each turn with the teacher's tokens for it, as a model that learnt them would."""

    name = "scripted"

    def __init__(self, episodes):
        self.turns = {}
        for ep in episodes:
            self.turns[tuple(ep.prompt)] = ep.call
            self.turns[tuple(ep.prompt + ep.call + ep.tool)] = ep.reply

    def generate(self, requests, on_result=None):
        out = []
        for r in requests:
            ids = self.turns[tuple(r.prompt_ids)]
            out.append(GenerationResult(r.request_id, list(ids), [-0.5] * len(ids), "stop", 0))
        return out


def test_the_teacher_episode_is_the_one_the_episode_loop_builds():
    """The warm start trains on the token sequence a rollout of the same turns produces: the
    runner, the bridge and the real calculator tool (a tool process) in the loop."""
    tok = build_calculator_tokenizer()
    train, _ = make_products(seed=0, num_train=20, num_val=10)
    with tools_of(TOOLS) as tools:
        teacher = Teacher(tok, SCHEMA, calculator(tools), seed=0)
        episodes = [teacher.calling(p) for p in train[:4]]
        runner = MultiTurn(
            episode_settings(CALCULATOR_RECIPE, 256), AppendOnly(teacher.bridge), tools, CompactCalls(), tok
        )
        budget = SamplingParams(max_new_tokens=CALCULATOR_RECIPE.max_response_length)
        requests = [GenerationRequest(str(i), ep.prompt, budget) for i, ep in enumerate(episodes)]
        results = runner.run(ScriptedEngine(episodes), requests, threading.Event())
        for p, result in zip(train, results):
            prompt, response, mask = teacher.encode(p, lazy=False)
            assert (result.output_ids, result.loss_mask) == (response, mask)
            assert result.episode.end == "stop" and not result.episode.broken
            assert result.episode.rerender_mismatches == 0 and result.episode.prefix_breaks == 0


# -- the warm start ------------------------------------------------------------------------------


def test_warm_start_calls_the_tool_about_as_often_as_its_teacher_and_copies_its_answer(calculator_assets):
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_dapo.hf_tokenizer import load_tokenizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(calculator_assets.hf_dir))
    tok = load_tokenizer(calculator_assets.hf_dir)  # as the run loads it (AutoTokenizer drops the spaces)
    train, _ = make_products(0, CALCULATOR_RECIPE.num_train, CALCULATOR_RECIPE.num_val)
    probe = random.Random(1).sample(train, 64)
    with tools_of(TOOLS) as tools, torch.no_grad():
        teacher = Teacher(tok, SCHEMA, calculator(tools), seed=0)
        acc = sampled_episodes(
            model,
            teacher,
            tools,
            probe,
            k=4,
            temperature=CALCULATOR_RECIPE.val_temperature,
            top_p=CALCULATOR_RECIPE.val_top_p,
            max_response_length=CALCULATOR_RECIPE.max_response_length,
            settings=episode_settings(CALCULATOR_RECIPE, 256),
            seed=7,
        )
    # The teacher calls in 40% of its examples; 256 episodes put a binomial's 3 sigma at +-9 points.
    assert 0.28 <= acc.call_rate <= 0.55, acc
    # Under the evaluation's top_p nearly every call is copied right (the warm start stops at a 90%
    # greedy probe), and guesses never are: accuracy is the call rate times the copy rate. (At
    # top_p 1.0 about half the calls are copied right: the copy is what RL sharpens first.)
    assert acc.call_rate * 0.85 <= acc.mean <= acc.call_rate, acc


# -- two DAPO steps through Ray with the HF engine -----------------------------------------------


def test_two_steps_of_tool_episodes_through_ray(calculator_assets, tmp_path):
    from e2e_harness import read_metrics, train_overrides

    from megatron_dapo.driver.launch import load_for_cli, run_train

    overrides = train_overrides(
        calculator_assets,
        tmp_path,
        "calculator_e2e",
        2,
        **{
            "rollout.multi_turn.tool_config_path": TOOLS,
            "trainer.save_freq": 0,
            "logging.plots_at_end": "false",
            "trainer.hf_export_at_end": "false",
        },
    )
    cfg = load_for_cli(str(REPO / "configs/demo_calculator.yaml"), overrides)
    summary = run_train(cfg)
    records = read_metrics(Path(summary["run_dir"]))
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "val/avg@2" in records[0] and "val/avg@2" in records[2]
    for r in records[1:]:
        assert r["rollout/multiturn/tool_calls_mean"] > 0, r["step"]
        assert r["rollout/multiturn/prefix_breaks"] == 0, r["step"]
        assert r["rollout/multiturn/rerender_mismatches"] == 0, r["step"]
        assert r["rollout/multiturn/tool_errors"] == 0, r["step"]
        # the trainer's log-probs of the sampled tokens are the engine's (environment tokens are
        # masked out of the comparison)
        assert r["actor/rollout_logprob_abs_diff"] < 1e-4, (r["step"], r["actor/rollout_logprob_abs_diff"])
    # `eval --run` of the run's warm start measures what its step-0 validation measured: prompts
    # listing the tool, episodes through the same loop and tool, the run's protocol and seeds. The
    # HF engine seeds each request, so these are the same samples and the same metrics.
    from megatron_dapo.cli import main

    out = tmp_path / "eval.json"
    args = ["eval", "--run", summary["run_dir"], "--hf-dir", str(calculator_assets.hf_dir), "--pass-k", "1"]
    assert main([*args, "--out", str(out)]) == 0
    metrics = json.loads(out.read_text())
    step0 = {key.removeprefix("val/"): v for key, v in records[0].items() if key.startswith("val/")}
    assert {key: metrics.get(key) for key in step0} == step0
    assert metrics["multiturn/tool_calls_mean"] > 0 and metrics["multiturn/tool_errors"] == 0
