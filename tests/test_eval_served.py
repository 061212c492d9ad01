"""`megatron-dapo eval --url` against the real SGLang 0.5.23 server (CPU, fp32) serving the demo's
warm-started checkpoint, next to `eval --hf-dir` of the same checkpoint (the HF engine).

Both evaluations build their prompts from a demo run's config.yaml (`--run`: no DAPO template,
the chat template, 24 prompt / 32 response tokens), so they sample the same prompts under the same
protocol (avg@K at temperature 1.0, top_p 0.7); only the engine differs. The one server of the
module serves every test. Skips when ``.venv-sglang`` is not built (``make setup-sglang``).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import httpx
import pytest
from sglang_fixtures import real_sglang_server

from megatron_dapo.cli import main
from megatron_dapo.config import load_config, to_yaml
from megatron_dapo.eval.openai_endpoint import EndpointError, make_endpoint_generator
from megatron_dapo.eval.runner import EvalProblem
from megatron_dapo.hf_tokenizer import load_tokenizer
from megatron_dapo.rollout.types import GenerationRequest, SamplingParams
from megatron_dapo.sglang.client import SGLangEngine, SGLangError

DEMO_CONFIG = Path(__file__).parent.parent / "configs" / "demo.yaml"
PROBLEMS = 64  # held-out problems
K = 4  # samples per problem (the demo's avg@4)
# Two independent estimates of the same avg@K over the same P problems differ only by sampling:
# each is a mean over problems of K Bernoulli(p_i) draws, with variance sum_i p_i (1 - p_i) / K / P^2
# <= 1 / (4 P K), so their difference has sd <= sqrt(1 / (2 P K)) (0.044 here). Four sd: a false
# failure once in ~16,000 runs.
AVG_BOUND = 4 * math.sqrt(1 / (2 * PROBLEMS * K))
SERVER_CONTEXT = 256  # the demo model's max_position_embeddings


@pytest.fixture(scope="module")
def demo_server(assets, tmp_path_factory):
    with real_sglang_server(assets.hf_dir, tmp_path_factory.mktemp("sglang_eval")) as handle:
        yield handle


@pytest.fixture(scope="module")
def demo_run(assets, tmp_path_factory):
    """A run directory of the demo on these assets: config.yaml as `train` writes it."""
    run = tmp_path_factory.mktemp("eval_run")
    cfg = load_config(DEMO_CONFIG, [f"model.path={assets.hf_dir}", f"data.val_files=[{assets.val_file}]"])
    (run / "config.yaml").write_text(to_yaml(cfg))
    return run


@pytest.fixture(scope="module")
def tokenizer(assets):
    return load_tokenizer(assets.hf_dir)


def run_eval(capsys, *args) -> tuple[int, str, str]:
    status = main(["eval", *map(str, args)])
    out = capsys.readouterr()
    return status, out.out, out.err


def counted(tokenizer, rows) -> list[int]:
    """The tokenizer's count of each dumped response, plus the stop token the text does not show."""
    return [
        len(tokenizer.encode(r["response"], add_special_tokens=False)) + (not r["truncated"]) for r in rows
    ]


def test_served_eval_matches_the_hf_engine_and_counts_tokens(
    capsys, tmp_path, assets, demo_server, demo_run, tokenizer
):
    common = ["--run", demo_run, "--k", K, "--limit", PROBLEMS, "--pass-k", 1]
    results = {}
    for name, source in (("url", ["--url", demo_server.url]), ("hf", ["--hf-dir", assets.hf_dir])):
        dump = tmp_path / f"{name}.jsonl"
        status, out, err = run_eval(capsys, *source, *common, "--dump", dump)
        assert status == 0, err
        rows = [json.loads(line) for line in dump.read_text().splitlines()]
        assert len(rows) == PROBLEMS * K
        results[name] = (json.loads(out), rows)

    url, hf = results["url"][0], results["hf"][0]
    assert url["num_problems"] == hf["num_problems"] == PROBLEMS
    # the warm start answers right in roughly a third of the samples: a wrong prompt would read ~0
    assert 0.05 < hf[f"avg@{K}"] < 0.95, hf
    assert abs(url[f"avg@{K}"] - hf[f"avg@{K}"]) <= AVG_BOUND, (url, hf, AVG_BOUND)

    for name, (metrics, rows) in results.items():
        lengths = counted(tokenizer, rows)
        assert [r["tokens"] for r in rows] == lengths, name
        assert metrics["response_length/mean"] == pytest.approx(sum(lengths) / len(lengths)), name
    # tokens, not words: a correct response is 21-25 tokens with its stop token (demo/recipe.py)
    assert 15 < url["response_length/mean"] <= 32
    # the same distribution from both engines: within 4 standard errors of a difference of means
    # (samples taken as independent, which overstates the spread: the problems are shared)
    means, var = [], 0.0
    for _, rows in results.values():
        xs = [r["tokens"] for r in rows]
        mean = sum(xs) / len(xs)
        means.append(mean)
        var += sum((x - mean) ** 2 for x in xs) / (len(xs) - 1) / len(xs)
    assert abs(means[0] - means[1]) <= 4 * math.sqrt(var), means


def test_server_usage_counts_what_the_tokenizer_counts(demo_server, tokenizer, assets):
    """With one choice the server's own `usage.completion_tokens` is the count; it equals the
    tokenizer's count of the text plus the trimmed stop token, which eval uses for n > 1."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Compute 95 - 4."}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    for seed in range(4):
        body = {"model": "default", "prompt": ids, "n": 1, "max_tokens": 32, "temperature": 1.0, "seed": seed}
        reply = httpx.post(f"{demo_server.url}/v1/completions", json=body, timeout=300).json()
        choice = reply["choices"][0]
        stop = choice["finish_reason"] == "stop"
        text_tokens = len(tokenizer.encode(choice["text"], add_special_tokens=False))
        assert reply["usage"]["completion_tokens"] == text_tokens + stop, reply


def test_dapo_template_over_the_context_stops_before_any_request(capsys, demo_server, assets):
    # the case: the default `--template auto` wraps the demo's bare problems in the DAPO
    # template, longer than the model's 256 positions; the server's /v1/models says so
    status, out, err = run_eval(
        capsys, "--url", demo_server.url, "--tokenizer", assets.hf_dir, "--data", assets.val_file,
        "--max-tokens", 32, "--k", 1, "--limit", 2,
    )  # fmt: skip
    assert status == 2 and out == ""
    line = err.strip()
    assert "\n" not in line, err
    assert (
        f"do not fit the model's context of {SERVER_CONTEXT} tokens (max_model_len at {demo_server.url}/v1/models)"
        in line
    ), line
    found = re.search(
        r"is (\d+) tokens \(template auto -> dapo from --template \(default\), chat template on\)", line
    )
    assert found and int(found[1]) > SERVER_CONTEXT, line


def test_over_long_prompt_ends_in_the_servers_message(demo_server):
    """Past eval's own check (a prompt the caller built itself), the server's reason reaches the
    one-line error: from eval's endpoint client and from the SGLang rollout client alike."""
    long_ids = [10] * 300
    generate = make_endpoint_generator(
        demo_server.url, model="default", temperature=1.0, top_p=1.0, max_tokens=8, count_text=len
    )
    with pytest.raises(EndpointError) as err:
        generate([EvalProblem("long-0", "", long_ids, "demo", "0", {})], 2)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(
        "HTTP 400 Bad Request: The input (300 tokens) is longer than the model's context length (256 tokens)."
    ), line
    assert f"(POST {demo_server.url}/v1/completions, problem long-0); not retried" in line

    engine = SGLangEngine(demo_server.url, name="demo-0", timeout_s=300)
    try:
        with pytest.raises(SGLangError) as err:
            engine.generate([GenerationRequest("long-1", long_ids, SamplingParams(max_new_tokens=8))])
    finally:
        engine.close()
    line = str(err.value)
    assert "\n" not in line
    assert "The input (300 tokens) is longer than the model's context length (256 tokens)." in line, line
    assert f"(POST {demo_server.url}/generate, request long-1)" in line
