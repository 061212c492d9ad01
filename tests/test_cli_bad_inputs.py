"""Bad inputs through the real command line: every one ends as ONE line on stderr that names the
offending path, key or URL, with exit status 2 (bad input) and no Python traceback.

Each row: (id, argv after `megatron-dapo`, exit status, strings the message must contain). The
first rows run as `python -m megatron_dapo.cli` subprocesses (the entry point's own wiring); the
others each run `cli.main` in a process forked from one that made the commands' imports once
(tests/cli_fork_runner.py), a few at a time; most fail before any cluster starts. Add a row
whenever a new kind of input appears.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import make_tiny_hf_checkpoint
from judge_standin import StandIn, refuse

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "configs/demo.yaml")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def _inputs(d: Path) -> dict[str, str]:
    """Every bad file the table points at, written once."""
    good = make_tiny_hf_checkpoint(d / "model", family="qwen2")
    out = {"good": str(good)}

    truncated = d / "truncated"
    make_tiny_hf_checkpoint(truncated, family="qwen2")
    st = truncated / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-1000])
    out["truncated"] = str(truncated)

    garbage = d / "garbage_header"
    make_tiny_hf_checkpoint(garbage, family="qwen2")
    (garbage / "model.safetensors").write_bytes(b"\xff" * 64)
    out["garbage_header"] = str(garbage)

    bert = d / "bert"
    make_tiny_hf_checkpoint(bert, family="qwen2")
    cfg = json.loads((bert / "config.json").read_text())
    cfg["architectures"] = ["BertForMaskedLM"]
    (bert / "config.json").write_text(json.dumps(cfg))
    out["bert"] = str(bert)

    bad_json = d / "bad_json_model"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{not json")
    out["bad_json_model"] = str(bad_json)

    no_weights = d / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((good / "config.json").read_text())
    out["no_weights"] = str(no_weights)

    (d / "empty_dir").mkdir()
    out["empty_dir"] = str(d / "empty_dir")

    rows = [{"problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(16)]
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out["train"] = str(d / "train.jsonl")
    (d / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9", "answer": "1"}\n')
    out["latin1"] = str(d / "latin1.jsonl")
    (d / "array.json").write_text('[{"prompt": "x", "answer": 1},')
    out["bad_array"] = str(d / "array.json")
    (d / "junk.parquet").write_bytes(b"not a parquet file at all")
    out["junk_parquet"] = str(d / "junk.parquet")
    (d / "data.csv").write_text("a,b\n1,2\n")
    out["csv"] = str(d / "data.csv")

    (d / "broken.yaml").write_text("trainer: [unclosed\n")
    out["broken_yaml"] = str(d / "broken.yaml")
    (d / "unknown_key.yaml").write_text("trainer:\n  totl_steps: 3\n")
    out["unknown_key_yaml"] = str(d / "unknown_key.yaml")

    (d / "reward.py").write_text("def other(*a):\n    return 0.0\n")
    out["reward_py"] = str(d / "reward.py")

    # a resume root whose only checkpoint is truncated
    ckpts = d / "runs" / "bad_resume" / "checkpoints"
    step = ckpts / "step_00000003"
    step.mkdir(parents=True)
    (step / "common.pt").write_bytes(b"x")
    (step / "megatron_dapo_manifest.json").write_text(
        json.dumps({"files": {"common.pt": {"size": 5, "crc32": 0}}})
    )
    (ckpts / "latest").write_text("step_00000003\n")
    out["runs"] = str(d / "runs")

    damaged = d / "damaged_megatron"
    damaged.mkdir()
    (damaged / "metadata.json").write_text("{")
    out["damaged_megatron"] = str(damaged)

    out["closed_url"] = f"http://127.0.0.1:{_closed_port()}"

    # servers on loopback for the forked eval runs (daemon threads, alive as long as this process):
    # a policy that answers every prompt; a judge that refuses every request (a 4xx), one that
    # drops every connection (a server that died)
    def complete(body):
        return 200, {
            "choices": [{"index": i, "text": "Answer: 1", "finish_reason": "stop"} for i in range(body["n"])]
        }

    policy = StandIn({"/v1/completions": complete})
    refusing = StandIn({"/v1/chat/completions": refuse(400, "The input (9000 tokens) is longer than 8192")})
    dropping = StandIn({"/v1/chat/completions": lambda body: "drop"})
    _STAND_INS.extend((policy, refusing, dropping))
    out["policy"], out["judge_4xx"], out["judge_drop"] = policy.url, refusing.url, dropping.url
    return out


_STAND_INS: list = []


def _train(x, *overrides, model="good"):
    base = [
        f"model.path={x[model]}",
        f"data.train_files=[{x['train']}]",
        "data.val_files=[]",
        "data.apply_chat_template=false",
        f"trainer.runs_dir={x['runs']}",
        "trainer.run_name=case",
        "trainer.resume=never",
    ]
    return ["train", DEMO, *base, *overrides]


def _eval(x, *args):
    return ["eval", *args]


def _eval_judged(x, *reward):
    """One problem, one sample of a stand-in policy, judged with ``reward`` overrides."""
    policy = [
        "--url",
        x["policy"],
        "--tokenizer",
        x["good"],
        "--data",
        x["train"],
        "--limit",
        "1",
        "--k",
        "1",
    ]
    policy += ["--pass-k", "1"]
    prompts = ["--max-tokens", "2", "--template", "none", "--no-chat-template"]
    return ["eval", *policy, *prompts, *reward]


# (id, argv builder, exit status, what the message must name)
CASES = [
    ("config-file-missing", lambda x: ["train", "/nonexistent/recipe.yaml"], 2, ["/nonexistent/recipe.yaml"]),
    ("config-yaml-broken", lambda x: ["train", x["broken_yaml"]], 2, ["broken.yaml"]),
    ("config-yaml-unknown-key", lambda x: ["train", x["unknown_key_yaml"]], 2, ["totl_steps"]),
    ("override-unknown-key", lambda x: _train(x, "trainer.totl_steps=3"), 2, ["trainer.totl_steps"]),
    ("override-wrong-type", lambda x: _train(x, "trainer.total_steps=many"), 2, ["trainer.total_steps"]),
    (
        "override-not-a-choice",
        lambda x: _train(x, "algorithm.loss_agg_mode=sum"),
        2,
        ["algorithm.loss_agg_mode"],
    ),
    ("override-negative", lambda x: _train(x, "rollout.n=0"), 2, ["rollout.n"]),
    ("override-no-equals", lambda x: _train(x, "trainer.total_steps"), 2, ["trainer.total_steps"]),
    (
        "mini-batch-not-divisor",
        lambda x: _train(x, "actor.ppo_mini_batch_size=3"),
        2,
        ["actor.ppo_mini_batch_size"],
    ),
    (
        "sampling-budget-too-small",
        lambda x: _train(
            x,
            "algorithm.filter_groups.enable=true",
            "algorithm.allow_partial_batch=false",
            "algorithm.filter_groups.max_num_gen_batches=1",
            "rollout.gen_batch_size=2",
            "trainer.train_batch_size=8",
            "actor.ppo_mini_batch_size=8",
        ),
        2,
        ["max_num_gen_batches", "train_batch_size"],
    ),
    (
        "heads-not-divisible-by-tp",
        lambda x: _train(x, "parallel.tensor_model_parallel_size=3", "parallel.actor_world_size=3"),
        2,
        ["tensor_model_parallel_size"],
    ),
    ("stop-timeout-zero", lambda x: _train(x, "trainer.stop_timeout_s=0"), 2, ["trainer.stop_timeout_s"]),
    ("engine-not-a-choice", lambda x: _train(x, "rollout.engine=vllm"), 2, ["rollout.engine"]),
    ("cuda-without-gpu", lambda x: _train(x, "trainer.device=cuda"), 2, ["trainer.device"]),
    ("model-path-missing", lambda x: _train(x, "model.path=/nonexistent/model"), 2, ["/nonexistent/model"]),
    ("model-path-empty-dir", lambda x: _train(x, model="empty_dir"), 2, ["empty_dir"]),
    (
        "model-config-not-json",
        lambda x: _train(x, model="bad_json_model"),
        2,
        ["bad_json_model", "config.json"],
    ),
    ("model-wrong-architecture", lambda x: _train(x, model="bert"), 2, ["BertForMaskedLM", "config.json"]),
    ("model-no-safetensors", lambda x: _train(x, model="no_weights"), 2, ["no_weights", "safetensors"]),
    (
        "model-truncated-safetensors",
        lambda x: _train(x, model="truncated"),
        2,
        ["truncated/model.safetensors"],
    ),
    (
        "model-garbage-safetensors",
        lambda x: _train(x, model="garbage_header"),
        2,
        ["garbage_header/model.safetensors"],
    ),
    (
        "megatron-path-missing",
        lambda x: _train(x, "model.megatron_path=/nonexistent/mcore"),
        2,
        ["model.megatron_path"],
    ),
    (
        "data-file-missing",
        lambda x: _train(x, "data.train_files=[/nonexistent/train.parquet]"),
        2,
        ["/nonexistent/train.parquet"],
    ),
    (
        "data-not-utf8",
        lambda x: _train(x, f"data.train_files=[{x['latin1']}]"),
        2,
        ["latin1.jsonl", "byte offset 15"],
    ),
    (
        "data-json-array-broken",
        lambda x: _train(x, f"data.train_files=[{x['bad_array']}]"),
        2,
        ["array.json"],
    ),
    (
        "data-parquet-junk",
        lambda x: _train(x, f"data.train_files=[{x['junk_parquet']}]"),
        2,
        ["junk.parquet"],
    ),
    ("data-unknown-extension", lambda x: _train(x, f"data.train_files=[{x['csv']}]"), 2, ["data.csv"]),
    (
        "reward-file-missing",
        lambda x: _train(x, "reward.custom_fn=/nonexistent/reward.py:score"),
        2,
        ["/nonexistent/reward.py"],
    ),
    (
        "reward-function-missing",
        lambda x: _train(x, f"reward.custom_fn={x['reward_py']}:score"),
        2,
        ["reward.py", "score"],
    ),
    (
        "resume-path-missing",
        lambda x: _train(x, "trainer.resume=/nonexistent/ckpt"),
        2,
        ["/nonexistent/ckpt", "trainer.resume"],
    ),
    (
        "resume-only-bad-checkpoints",
        lambda x: (
            [a for a in _train(x, "trainer.resume=auto") if a != "trainer.run_name=case"]
            + ["trainer.run_name=bad_resume"]
        ),
        2,
        ["step_00000003", "trainer.resume=never"],
    ),
    (
        "eval-url-down",
        lambda x: _eval(x, "--url", x["closed_url"] + "/v1", "--no-chat-template"),
        2,
        ["127.0.0.1", "/v1/models"],
    ),
    (
        "eval-url-not-http",
        lambda x: _eval(x, "--url", "localhost:30000", "--no-chat-template"),
        2,
        ["localhost:30000"],
    ),
    (
        "eval-data-missing",
        lambda x: _eval(x, "--hf-dir", x["good"], "--data", "/nonexistent/aime.parquet"),
        2,
        ["/nonexistent/aime.parquet"],
    ),
    (
        "eval-data-not-utf8",
        lambda x: _eval(x, "--hf-dir", x["good"], "--data", x["latin1"]),
        2,
        ["latin1.jsonl"],
    ),
    (
        "eval-hf-dir-missing",
        lambda x: _eval(x, "--hf-dir", "/nonexistent/hf", "--data", x["latin1"]),
        2,
        ["/nonexistent/hf"],
    ),
    # sampling and length flags are checked before anything else reads the model, the data or
    # the URL: a bad number must not surface as some later check's complaint
    (
        "eval-k-zero",
        lambda x: _eval(x, "--hf-dir", x["good"], "--data", x["train"], "--no-chat-template", "--k", "0"),
        2,
        ["--k=0", ">= 1"],
    ),
    (
        "eval-k-before-url",
        lambda x: _eval(x, "--url", x["closed_url"], "--no-chat-template", "--k", "-3"),
        2,
        ["--k=-3", ">= 1"],
    ),
    (
        "eval-temperature-negative",
        lambda x: _eval(x, "--hf-dir", x["good"], "--data", x["train"], "--temperature", "-0.5"),
        2,
        ["--temperature=-0.5", ">= 0"],
    ),
    (
        "eval-top-p-zero",
        lambda x: _eval(x, "--hf-dir", x["good"], "--data", x["train"], "--top-p", "0"),
        2,
        ["--top-p=0.0", "(0, 1]"],
    ),
    (
        "eval-top-p-nan",
        lambda x: _eval(x, "--hf-dir", x["good"], "--data", x["train"], "--top-p", "nan"),
        2,
        ["--top-p=nan", "(0, 1]"],
    ),
    (
        "eval-pass-k-zero",
        lambda x: _eval(x, "--hf-dir", x["good"], "--data", x["train"], "--pass-k", "1", "0"),
        2,
        ["--pass-k", "0", ">= 1"],
    ),
    (
        "eval-limit-negative",
        lambda x: _eval(x, "--hf-dir", x["good"], "--data", x["train"], "--limit", "-1"),
        2,
        ["--limit=-1", ">= 1"],
    ),
    (
        "eval-max-prompt-length-zero",
        lambda x: _eval(x, "--url", x["closed_url"], "--tokenizer", x["good"], "--max-prompt-length", "0"),
        2,
        ["--max-prompt-length=0", ">= 1"],
    ),
    (
        "eval-override-not-reward",
        lambda x: _eval_judged(x, "data.template=none"),
        2,
        ["data.template=none", "reward", "--template"],
    ),
    (
        "eval-reward-parser-unknown",
        lambda x: _eval_judged(
            x, "reward.model.kind=judge", f"reward.model.url={x['judge_4xx']}", "reward.model.parser=yesno"
        ),
        2,
        ["reward.model.parser", "yes_no"],
    ),
    (
        "eval-reward-url-down",
        lambda x: _eval_judged(x, "reward.model.kind=judge", f"reward.model.url={x['closed_url']}"),
        2,
        ["reward.model.url", "127.0.0.1", "does not answer"],
    ),
    (
        "eval-reward-classifier-not-one",
        lambda x: _eval_judged(x, "reward.model.kind=classifier", f"reward.model.path={x['good']}"),
        2,
        ["reward.model.path", "Qwen2ForCausalLM", "reward.model.kind=judge"],
    ),
    (
        "eval-judge-4xx",
        lambda x: _eval_judged(x, "reward.model.kind=judge", f"reward.model.url={x['judge_4xx']}"),
        1,
        ["HTTP 400", "longer than 8192", "/v1/chat/completions", "problem 0 response 0"],
    ),
    (
        "eval-judge-down-past-grace",
        lambda x: _eval_judged(
            x,
            "reward.model.kind=judge",
            f"reward.model.url={x['judge_drop']}",
            "reward.model.down_grace_s=0.2",
        ),
        1,
        ["unreachable", "reward.model.down_grace_s=0.2"],
    ),
    (
        "convert-from-missing-checkpoint",
        lambda x: [
            "convert",
            "megatron-to-hf",
            "--megatron-dir",
            "/nonexistent/mcore",
            "--hf-dir",
            x["runs"] + "/out1",
        ],
        2,
        ["/nonexistent/mcore"],
    ),
    (
        "convert-from-damaged-checkpoint",
        lambda x: [
            "convert",
            "megatron-to-hf",
            "--megatron-dir",
            x["damaged_megatron"],
            "--hf-dir",
            x["runs"] + "/out2",
            "--hf-config-dir",
            x["good"],
        ],
        2,
        ["damaged_megatron"],
    ),
    (
        "convert-from-truncated-hf",
        lambda x: [
            "convert",
            "hf-to-megatron",
            "--hf-dir",
            x["truncated"],
            "--megatron-dir",
            x["runs"] + "/out3",
        ],
        2,
        ["truncated/model.safetensors"],
    ),
    ("plot-missing-run", lambda x: ["plot", "/nonexistent/run"], 2, ["/nonexistent/run"]),
    ("config-bad-override", lambda x: ["config", DEMO, "optim.lr=-1"], 2, ["optim.lr"]),
    ("plan-unknown-key", lambda x: ["plan", DEMO, "parallel.tp=2"], 2, ["parallel.tp"]),
    (
        "verify-model-missing",
        lambda x: ["verify-model", "--hf-dir", "/nonexistent/hf"],
        2,
        ["/nonexistent/hf"],
    ),
]


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", NO_COLOR="1", COLUMNS="80")
    return subprocess.run(
        [sys.executable, "-m", "megatron_dapo.cli", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    inputs = _inputs(tmp_path_factory.mktemp("bad_inputs"))
    # only the cases this session runs (-k), each once, a few at a time
    wanted = {
        item.callspec.params["cid"]
        for item in request.session.items
        if hasattr(item, "callspec") and "cid" in item.callspec.params
    }
    argvs = {cid: build(inputs) for cid, build, _, _ in CASES if cid in wanted}
    real = [cid for cid in argvs if cid in SUBPROCESS_CASES]
    forked = [cid for cid in argvs if cid not in SUBPROCESS_CASES]
    done = {cid: _run(argvs[cid]) for cid in real}
    done.update(zip(forked, _run_forked([argvs[cid] for cid in forked])))
    return done


# rows that also prove the console entry's wiring (module entry, exit status, stderr)
SUBPROCESS_CASES = {"config-file-missing", "override-unknown-key"}


def _run_forked(argvs: list[list[str]]) -> list[subprocess.CompletedProcess]:
    if not argvs:
        return []
    env = dict(os.environ, PYTHONUNBUFFERED="1", NO_COLOR="1", COLUMNS="80")
    runner = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("cli_fork_runner.py"))],
        input=json.dumps(argvs),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    return [
        subprocess.CompletedProcess(argv, r["returncode"], r["stdout"], r["stderr"])
        for argv, r in zip(argvs, json.loads(runner.stdout))
    ]


def test_at_least_thirty_cases():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("cid,build,status,names", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line(results, cid, build, status, names):
    proc = results[cid]
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    assert proc.returncode == status, (proc.returncode, out)
    lines = _without_library_warnings(proc.stderr.splitlines())
    assert len(lines) == 1, proc.stderr
    for name in names:
        assert name in lines[0], (name, lines[0])


# A Python warning raised inside an installed library, as the warnings module prints it: its
# "FILE:LINE: CATEGORY: message" header (megatron-core's "Apex is not installed", "Transformer
# Engine and Apex are not installed", "full scope is deprecated"), then the source line of the
# warnings.warn call, indented.
_LIBRARY_WARNING = re.compile(r"^/\S+/(?:site|dist)-packages/\S+\.py:\d+: \w*Warning: ")


def _without_library_warnings(lines: list[str]) -> list[str]:
    """stderr's non-blank lines less the warnings installed libraries print on their own, which
    are not our message; any other line, "Warning" in it or not, stays."""
    kept, after_header = [], False
    for line in lines:
        if _LIBRARY_WARNING.match(line):
            after_header = True
            continue
        if after_header and line.startswith("  "):  # the warnings.warn(...) source line
            after_header = False
            continue
        after_header = False
        if line.strip():
            kept.append(line)
    return kept


@pytest.mark.parametrize(
    "base",
    [
        "http://h:30000",
        "http://h:30000/",
        "http://h:30000/v1",
        "http://h:30000/v1/",
        "http://h:30000/v1/completions",
    ],
)
def test_eval_url_with_or_without_v1(base):
    from megatron_dapo.eval.openai_endpoint import completions_url

    assert completions_url(base) == "http://h:30000/v1/completions"


def test_plot_says_which_lines_it_skipped(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": 1, "rollout/reward/mean": 0.1}, {"step": 2, "rollout/reward/mean": 0.2}]
    text = json.dumps(lines[0]) + "\n{torn\n" + json.dumps(lines[1]) + "\n[1, 2]\n"
    (run / "metrics.jsonl").write_text(text)
    proc = _run(["plot", str(run)])
    assert proc.returncode == 0, proc.stderr
    assert "skipped 2 of 4 lines" in proc.stderr and "line 2: not JSON" in proc.stderr
    assert "line 4: not a step record" in proc.stderr
    assert (run / "plots" / "reward.png").is_file()
