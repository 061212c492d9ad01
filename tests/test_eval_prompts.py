"""`megatron-dapo eval`'s prompts: every prompt is checked against its budget and the model's
context before anything is sampled (one line naming the template and the lengths), and `--run`
builds them with the run's template, chat template and lengths (explicit flags win).

The model is the tiny random Qwen2 of tests/helpers.py (a character-level tokenizer: one token
per character, no chat template; 128 positions), sampled by the HF engine."""

from __future__ import annotations

import json

import pytest

from megatron_dapo.cli import main
from megatron_dapo.config import load_config, to_yaml
from megatron_dapo.data.templates import DAPO_TEMPLATE
from megatron_dapo.eval.prompt_fit import PromptSettings, PromptTooLong, check_prompts_fit
from megatron_dapo.eval.runner import EvalProblem

PROBLEMS = ["1+1", "2+3", "4+4"]  # 3 characters: 3 prompt tokens without a template
CONTEXT = 128  # the tiny checkpoint's max_position_embeddings


@pytest.fixture(scope="module")
def model(tiny_hf_checkpoint):
    return tiny_hf_checkpoint()


@pytest.fixture
def data(tmp_path):
    f = tmp_path / "val.jsonl"
    f.write_text("".join(json.dumps({"prompt": p, "answer": str(eval(p))}) + "\n" for p in PROBLEMS))
    return f


def write_run(tmp_path, model, data, *overrides):
    """A run directory whose config.yaml is what `train` writes (the resolved config)."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(
        None,
        [
            f"model.path={model}",
            f"data.val_files=[{data}]",
            "data.template=none",
            "data.apply_chat_template=false",
            "algorithm.overlong_buffer.enable=false",
            *overrides,
        ],
    )
    (run / "config.yaml").write_text(to_yaml(cfg))
    return run


def eval_cli(capsys, *args):
    status = main(["eval", *map(str, args)])
    out = capsys.readouterr()
    return status, out.out, out.err


def test_dapo_template_too_long_for_the_context_is_one_line_naming_template_and_lengths(capsys, model, data):
    # the case: the DAPO template makes the prompts longer than the model's context
    status, out, err = eval_cli(
        capsys, "--hf-dir", model, "--data", data, "--no-chat-template", "--max-tokens", "8", "--k", "1"
    )
    prompt_tokens = len(DAPO_TEMPLATE.replace("{problem}", "1+1"))  # one token per character
    assert status == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert f"3 of 3 prompts do not fit the model's context of {CONTEXT} tokens" in line
    assert f"max_position_embeddings in {model / 'config.json'}" in line
    assert (
        f"is {prompt_tokens} tokens (template auto -> dapo from --template (default), chat template off)"
        in line
    )
    assert f"and needs {prompt_tokens + 8} with --max-tokens=8 response tokens" in line
    assert "the prompt alone fills the context" in line


def test_response_budget_over_the_context_names_the_room_left(capsys, model, data):
    status, _, err = eval_cli(
        capsys, "--hf-dir", model, "--data", data, "--no-chat-template", "--template", "none",
        "--max-tokens", "126", "--k", "1",
    )  # fmt: skip
    assert status == 2
    assert "3 of 3 prompts do not fit" in err and "and needs 129 with --max-tokens=126" in err
    assert "template none from --template" in err
    assert f"lower --max-tokens to at most {CONTEXT - 3}" in err


def test_run_dir_gives_template_chat_template_and_lengths(capsys, tmp_path, model, data):
    run = write_run(tmp_path, model, data, "data.max_prompt_length=8", "data.max_response_length=200")
    status, _, err = eval_cli(capsys, "--hf-dir", model, "--run", run, "--k", "1")
    config = run / "config.yaml"
    assert status == 2, err
    # template none and no chat template (the run's): 3-token prompts, within its prompt budget;
    # its 200 response tokens do not fit the 128 positions
    assert f"is 3 tokens (template none from data.template in {config}, chat template off)" in err
    assert f"and needs 203 with data.max_response_length in {config}=200 response tokens" in err

    # an explicit flag wins over the run, and then the run's settings sample
    dump = tmp_path / "dump.jsonl"
    status, out, err = eval_cli(
        capsys, "--hf-dir", model, "--run", run, "--max-tokens", "4", "--k", "2", "--dump", dump
    )
    assert status == 0, err
    metrics = json.loads(out)
    assert metrics["num_problems"] == 3 and metrics["samples_per_problem"] == 2
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    assert len(rows) == 6 and all(1 <= r["tokens"] <= 4 for r in rows)
    assert metrics["response_length/mean"] == pytest.approx(sum(r["tokens"] for r in rows) / 6)


def test_run_dir_prompt_budget_names_its_key(capsys, tmp_path, model, data):
    run = write_run(tmp_path, model, data, "data.max_prompt_length=2", "data.max_response_length=4")
    status, _, err = eval_cli(capsys, "--hf-dir", model, "--run", run, "--k", "1")
    assert status == 2
    assert f"3 of 3 prompts are longer than data.max_prompt_length in {run / 'config.yaml'}=2 tokens" in err
    assert "the longest (problem 0) is 3 tokens" in err


def test_run_dir_without_config_is_one_line(capsys, tmp_path, model):
    status, _, err = eval_cli(capsys, "--hf-dir", model, "--run", tmp_path, "--k", "1")
    assert status == 2 and f"--run {tmp_path} has no config.yaml" in err


def test_url_needs_a_tokenizer(capsys, data):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    class Models(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Models)
    Thread(target=srv.serve_forever, daemon=True).start()
    try:
        status, _, err = eval_cli(
            capsys, "--url", f"http://127.0.0.1:{srv.server_address[1]}", "--data", data
        )
    finally:
        srv.shutdown()
    assert status == 2 and "--url needs --tokenizer" in err


def _problem(i, n_tokens, text="x"):
    return EvalProblem(str(i), text, list(range(n_tokens)), "s", "0", {})


def test_check_prompts_fit_bounds():
    s = PromptSettings("none", True, max_prompt_length=10, max_response_length=6, origin={})
    check_prompts_fit([_problem(0, 10), _problem(1, 4)], s, context_length=16, context_from="c")
    with pytest.raises(
        PromptTooLong,
        match=r"1 of 2 prompts do not fit .* context of 15 tokens \(c\): the longest \(problem 0\) is 10",
    ):
        check_prompts_fit([_problem(0, 10), _problem(1, 4)], s, context_length=15, context_from="c")
    with pytest.raises(PromptTooLong, match=r"1 of 2 prompts are longer than max_prompt_length=10"):
        check_prompts_fit([_problem(0, 11), _problem(1, 4)], s, context_length=None, context_from="c")
    check_prompts_fit([_problem(0, 10)], s, context_length=None, context_from="c")  # unknown context
