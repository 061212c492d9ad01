"""`megatron-dapo eval` with tools: a run trained with `rollout.multi_turn.enable` is evaluated
through episodes with its tools.

`--url` goes through the chat API: a stand-in OpenAI-compatible server (in this process) answers a
problem's first turn with a `tool_calls` entry asking the calculator for the product it reads in
the question, and a turn that follows a `tool` message with "Answer: " and that message's text. The
real calculator (the tool host's process, configs/tools/calculator.yaml) computes the product, so a
right answer is one the tool gave and the request carried back. The HF engine's episodes are
checked against the trainer's own validation in tests/test_demo_calculator.py (the same metrics
from `eval --run` as at the run's step 0).
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from megatron_dapo.cli import main
from megatron_dapo.config import load_config, to_yaml
from megatron_dapo.demo.calculator.task import Product
from megatron_dapo.demo.task import to_rows, write_parquet
from megatron_dapo.demo.tokenizer import build_calculator_tokenizer
from megatron_dapo.eval.chat_tools import parse_tool_call
from megatron_dapo.eval.runner import Completion, EpisodeCounts, EvalProblem, evaluate
from megatron_dapo.hf_tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
CALCULATOR = REPO / "configs" / "tools" / "calculator.yaml"
PRODUCTS = [Product(347, 48), Product(512, 73), Product(999, 11)]
QUESTION = re.compile(r"Compute (\d+) \* (\d+)\.")


class ChatStandIn(BaseHTTPRequestHandler):
    """`/v1/models` and `/v1/chat/completions`; every request body is kept (``requests``).
    ``mode``: "calls" (a call, then the tool's answer copied), "bad_arguments" (a call whose
    arguments are not JSON, then "Answer: 0")."""

    requests: list[dict] = []
    mode = "calls"

    def log_message(self, *args):
        pass

    def _send(self, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802
        self._send({"data": [{"id": "calc", "max_model_len": 256}]})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        if not self.path.endswith("/chat/completions"):  # one turn, on token ids
            choices = [{"index": i, "text": "Answer: 1", "finish_reason": "stop"} for i in range(body["n"])]
            self._send({"choices": choices})
            return
        messages = body["messages"]
        if messages[-1]["role"] == "tool":
            message = {"role": "assistant", "content": f"Answer: {messages[-1]['content']}"}
            self._send(
                {
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": {"completion_tokens": 5},
                }
            )
            return
        a, b = QUESTION.search(messages[-1]["content"]).groups()
        arguments = (
            json.dumps({"expression": f"{a} * {b}"}) if type(self).mode == "calls" else "{expression: "
        )
        call = {
            "id": f"call-{a}-{b}",
            "type": "function",
            "function": {"name": "calculator", "arguments": arguments},
        }
        message = {"role": "assistant", "content": "", "tool_calls": [call]}
        self._send(
            {"choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}], "usage": {"completion_tokens": 7}}
        )  # fmt: skip


@pytest.fixture
def chat_server():
    ChatStandIn.requests = []
    ChatStandIn.mode = "calls"
    srv = ThreadingHTTPServer(("127.0.0.1", 0), ChatStandIn)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.fixture
def tool_run(tmp_path):
    """A run directory as `train` writes it for the calculator demo's config (its tools, call format
    and budgets), with the demo's tokenizer (no model: `--url` needs only the tokenizer)."""
    tok = tmp_path / "tokenizer"
    build_calculator_tokenizer().save_pretrained(str(tok))
    val = write_parquet(to_rows(PRODUCTS, "test"), tmp_path / "val.parquet")
    cfg = load_config(
        REPO / "configs" / "demo_calculator.yaml",
        [
            f"model.path={tok}",
            f"data.val_files=[{val}]",
            f"rollout.multi_turn.tool_config_path={CALCULATOR}",
            "rollout.val.n=2",
        ],
    )
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(cfg))
    return run


def run_eval(capsys, *args) -> tuple[int, dict | None, str]:
    status = main(["eval", *map(str, args)])
    out = capsys.readouterr()
    return status, (json.loads(out.out) if status == 0 else None), out.err


def test_url_eval_of_a_tool_run_runs_the_calls_on_the_tools_and_scores_the_final_turn(
    capsys, tmp_path, chat_server, tool_run
):
    dump = tmp_path / "dump.jsonl"
    status, metrics, err = run_eval(
        capsys, "--url", chat_server, "--run", tool_run, "--pass-k", 1, "--dump", dump
    )
    assert status == 0, err
    # the run's protocol: rollout.val.n=2 samples of each of the 3 problems, each an episode of a
    # call and a reply; every reply is the product (the calculator's, carried back to the server)
    assert metrics["avg@2"] == 1.0 and metrics["num_problems"] == 3
    assert metrics["multiturn/turns_mean"] == 2.0
    assert metrics["multiturn/tool_calls_mean"] == 1.0
    assert metrics["multiturn/tool_errors"] == 0.0 and metrics["multiturn/tool_timeouts"] == 0.0
    # the model's tokens only, as the server counted them (7 for the call, 5 for the reply)
    assert metrics["response_length/mean"] == 12.0
    firsts = [r for r in ChatStandIn.requests if r["messages"][-1]["role"] == "user"]
    seconds = [r for r in ChatStandIn.requests if r["messages"][-1]["role"] == "tool"]
    assert len(firsts) == len(seconds) == 6
    for r in ChatStandIn.requests:
        assert [t["function"]["name"] for t in r["tools"]] == ["calculator"]
        assert r["temperature"] == 1.0 and r["top_p"] == 0.7
    answers = {}
    for r in seconds:
        a, b = QUESTION.search(r["messages"][0]["content"]).groups()
        call, tool = r["messages"][-2], r["messages"][-1]
        assert (
            call["role"] == "assistant"
            and call["tool_calls"][0]["id"] == tool["tool_call_id"] == f"call-{a}-{b}"
        )
        answers[(int(a), int(b))] = tool["content"]
    assert answers == {(p.a, p.b): str(p.a * p.b) for p in PRODUCTS}
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    assert {r["response"] for r in rows} == {f"Answer: {p.a * p.b}" for p in PRODUCTS}
    assert all(r["turns"] == 2 and r["tool_calls"] == 1 for r in rows)


def test_url_eval_counts_a_malformed_call_as_a_tool_error(capsys, chat_server, tool_run):
    ChatStandIn.mode = "bad_arguments"
    # room in the response budget for the error's text (cut to 16 tokens and marked) and a reply
    status, metrics, err = run_eval(
        capsys, "--url", chat_server, "--run", tool_run, "--pass-k", 1, "--max-tokens", 100
    )
    assert status == 0, err
    assert metrics["avg@2"] == 0.0
    assert metrics["multiturn/tool_errors"] == 6.0 and metrics["multiturn/tool_calls_mean"] == 1.0
    # the model is shown the error (cut to the run's 16 tokens of its character tokenizer) and asked
    # for its next turn
    seconds = [r for r in ChatStandIn.requests if r["messages"][-1]["role"] == "tool"]
    assert len(seconds) == 6
    assert all(r["messages"][-1]["content"].startswith("Error: ") for r in seconds)


def test_tools_none_samples_one_turn_without_tools(capsys, chat_server, tool_run):
    """--tools none: one turn through the completions API on token ids, prompts without the tool
    list, no multiturn metrics."""
    status, metrics, err = run_eval(capsys, "--url", chat_server, "--run", tool_run, "--tools", "none")
    assert status == 0, err
    assert metrics["avg@2"] == 0.0 and not any(key.startswith("multiturn/") for key in metrics)
    assert len(ChatStandIn.requests) == len(PRODUCTS)
    tokenizer = load_tokenizer(tool_run.parent / "tokenizer")
    for r in ChatStandIn.requests:
        prompt = tokenizer.decode(r["prompt"], skip_special_tokens=False)
        assert "Compute" in prompt and "calculator" not in prompt, prompt


def test_a_missing_tool_yaml_is_one_line_naming_the_flag(capsys, tool_run, tmp_path):
    missing = tmp_path / "nowhere.yaml"
    status = main(["eval", "--hf-dir", str(tmp_path), "--run", str(tool_run), "--tools", str(missing)])
    err = capsys.readouterr().err
    assert status == 2
    assert f"--tools {missing}: no tool YAML at {missing}" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("item", "name", "arguments", "error"),
    [
        ({"function": {"name": "calc", "arguments": '{"x": 1}'}}, "calc", {"x": 1}, None),
        ({"function": {"name": "calc", "arguments": {"x": 1}}}, "calc", {"x": 1}, None),
        ({"function": {"name": "calc", "arguments": None}}, "calc", {}, None),
        ({"function": {"name": "calc"}}, "calc", {}, None),
        ({"function": {"name": "calc", "arguments": "[1]"}}, "calc", {}, "must be a JSON object"),
        ({"function": {"name": "calc", "arguments": "{x"}}, "calc", {}, "not JSON"),
        ({"function": {"arguments": "{}"}}, "", {}, "without a function name"),
    ],
)
def test_parse_tool_call(item, name, arguments, error):
    call = parse_tool_call(item)
    assert (call.name, call.arguments) == (name, arguments)
    assert (call.error is None) if error is None else (error in call.error)


def test_episode_metrics_are_means_and_totals_over_the_episodes():
    problem = EvalProblem("p", "q", [1], "math_dapo", "7", {})

    class Exact:
        def score(self, data_source, text, ground_truth, extra_info=None):
            from types import SimpleNamespace

            return SimpleNamespace(acc=text == ground_truth, pred=text)

    episodes = [EpisodeCounts(1, 0), EpisodeCounts(3, 2, tool_errors=1), EpisodeCounts(2, 1, tool_timeouts=1)]
    completions = [[Completion("7", 4, False, episode=e) for e in episodes]]
    m = evaluate([problem], lambda probs, k: completions, Exact(), k=3, prefix="val/")
    assert m["val/multiturn/turns_mean"] == 2.0
    assert m["val/multiturn/tool_calls_mean"] == 1.0
    assert m["val/multiturn/tool_errors"] == 1.0 and m["val/multiturn/tool_timeouts"] == 1.0
    # single-turn responses have none
    single = evaluate([problem], lambda probs, k: [[Completion("7", 4, False)]], Exact(), k=1)
    assert not any("multiturn" in key for key in single)


def test_tools_flag_without_a_run_uses_the_schemas_multi_turn_settings(
    capsys, tmp_path, chat_server, tool_run
):
    """--tools PATH with no --run: the episodes with that tool YAML and rollout.multi_turn's defaults."""
    data = tool_run.parent / "val.parquet"
    tokenizer = tool_run.parent / "tokenizer"
    args = ["--url", chat_server, "--tokenizer", tokenizer, "--data", data, "--tools", CALCULATOR]
    status, metrics, err = run_eval(
        capsys, *args, "--template", "none", "--max-tokens", 64, "--k", 1, "--pass-k", 1
    )
    assert status == 0, err
    assert metrics["avg@1"] == 1.0 and metrics["multiturn/tool_calls_mean"] == 1.0
    assert len(ChatStandIn.requests) == 2 * len(PRODUCTS)
