"""`megatron-dapo eval` judged by a served reward model (`reward.model`), against stand-in servers
on loopback: the policy's /v1/completions answers scripted responses, the judge's
/v1/chat/completions a verdict computed from the response, so every metric is known by hand.

An unscored response (a verdict without yes/no, a 5xx) is left out of its problem, never counted
as wrong (eval/metrics.py): the problem's metrics are those of its scored responses; a problem
with none is left out of every metric; pass@k and maj@k leave out problems with fewer than k.
"""

from __future__ import annotations

import json
from math import comb

import pytest
from judge_standin import StandIn, chat_answer, judge_prompt_parts

from megatron_dapo.cli import main
from megatron_dapo.config import load_config, to_yaml
from megatron_dapo.eval import ProblemSamples, aggregate
from megatron_dapo.eval.runner import Completion, EvalProblem, evaluate
from megatron_dapo.eval.served import ServedScorer
from megatron_dapo.rewards.served import ScoreOutcome

# problem -> (ground truth, the policy's 4 responses). The judge says yes/no by the answer, has
# no verdict for "??" (unparseable) and answers 500 for "500" (server_error, no retry).
SCRIPT = {
    "1+1": ("2", ["Answer: 2", "Answer: 2", "Answer: 3", "Answer: ??"]),
    "2+3": ("5", ["Answer: 5", "Answer: 500", "Answer: 4", "Answer: 5"]),
    "4+4": ("8", ["Answer: ??"] * 4),
}
K = 4


def judge(body):
    parts = judge_prompt_parts(body)
    answer = parts["response"].removeprefix("Answer: ")
    if answer == "??":
        return chat_answer("I cannot tell.")
    if answer == "500":
        return 500, {"object": "error", "message": "CUDA out of memory", "code": 500}
    return chat_answer("yes" if answer == parts["ground_truth"] else "no")


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_hf_checkpoint):
    return tiny_hf_checkpoint()


@pytest.fixture(scope="module")
def servers(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))

    def complete(body):
        # the tiny tokenizer is one token a character: the prompt's text, less the spaces decode adds
        problem = tok.decode(body["prompt"]).replace(" ", "")
        texts = SCRIPT[problem][1]
        assert body["n"] == K
        choices = [{"index": i, "text": t, "finish_reason": "stop"} for i, t in enumerate(texts)]
        return 200, {"choices": choices}

    policy = StandIn({"/v1/completions": complete})
    judge_server = StandIn({"/v1/chat/completions": judge})
    yield policy, judge_server
    policy.close()
    judge_server.close()


@pytest.fixture
def data(tmp_path):
    f = tmp_path / "val.jsonl"
    rows = [{"prompt": p, "answer": gt, "data_source": "math_dapo"} for p, (gt, _) in SCRIPT.items()]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def eval_cli(capsys, *args):
    status = main(["eval", *map(str, args)])
    out = capsys.readouterr()
    return status, out.out, out.err


def common_args(servers, tokenizer_dir, data, dump):
    policy, _ = servers
    return [
        "--url",
        policy.url,
        "--tokenizer",
        tokenizer_dir,
        "--data",
        data,
        "--template",
        "none",
        "--no-chat-template",
        "--k",
        K,
        "--pass-k",
        1,
        2,
        4,
        "--max-tokens",
        16,
        "--dump",
        dump,
    ]


# By hand. 1+1 scores [yes, yes, no] (its "??" left out); 2+3 [yes, no, yes] (its 500 left out);
# 4+4 none (left out of everything). Scores are the judge's +1/-1.
BY_HAND = {
    "avg@4": (2 / 3 + 2 / 3) / 2,
    "pass@1": (2 / 3 + 2 / 3) / 2,
    # n=3 scored, c=2 correct: 1 - C(1, 2) / C(3, 2) = 1 for both
    "pass@2": 1.0 - comb(1, 2) / comb(3, 2),
    "problems_below@1": 0.0,
    "problems_below@2": 0.0,
    # neither has 4 scored responses: no pass@4 at all
    "problems_below@4": 2.0,
    "unscored": 6.0,
    "unscored/unparseable": 5.0,
    "unscored/server_error": 1.0,
    "problems_unscored": 1.0,
    "score/mean": (1 + 1 - 1 + 1 - 1 + 1) / 6,
    "num_problems": 3.0,
    "samples_per_problem": 4.0,
}


def test_a_judge_by_url_scores_every_response_and_leaves_the_unscored_out(
    capsys, servers, tokenizer_dir, data, tmp_path
):
    _, judge_server = servers
    dump = tmp_path / "dump.jsonl"
    status, out, err = eval_cli(
        capsys,
        *common_args(servers, tokenizer_dir, data, dump),
        "reward.model.kind=judge",
        f"reward.model.url={judge_server.url}",
        "reward.model.max_retries=0",
    )
    assert status == 0, err
    metrics = json.loads(out)
    for key, value in BY_HAND.items():
        assert metrics[key] == pytest.approx(value), key
    # no extracted answer to vote on without reward.combine: no maj@k; no pass@4 (above)
    assert not any(key.startswith(("maj@", "pass@4")) for key in metrics), metrics
    assert metrics["truncated_ratio"] == 0.0
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    assert len(rows) == 12
    unscored = [r for r in rows if r["unscored"]]
    assert {r["response"] for r in unscored} == {"Answer: ??", "Answer: 500"}
    # never scored 0, never counted wrong: no score and no acc at all
    assert all(r["score"] is None and r["acc"] is None and r["detail"] for r in unscored)
    assert {r["score"] for r in rows if not r["unscored"]} == {1.0, -1.0}
    # every response reached the judge once (no retries asked), greedy by default
    asked = [b for path, b in judge_server.requests if path == "/v1/chat/completions"]
    assert len(asked) >= 12 and all(b["temperature"] == 0.0 and b["model"] == "standin" for b in asked)


def test_reward_combine_gets_the_rule_score_and_its_pred_is_voted_on(
    capsys, servers, tokenizer_dir, data, tmp_path
):
    """reward.combine: the math rule's ±1 beside the judge's; its pred makes maj@k."""
    _, judge_server = servers
    combine = tmp_path / "combine.py"
    combine.write_text(
        "def combine(data_source, solution_str, ground_truth, extra_info, rule_score, model_score):\n"
        "    return {'score': (rule_score + model_score) / 2, 'acc': model_score > 0,\n"
        "            'pred': solution_str.split(': ')[1]}\n"
    )
    dump = tmp_path / "dump.jsonl"
    status, out, err = eval_cli(
        capsys,
        *common_args(servers, tokenizer_dir, data, dump),
        "reward.model.kind=judge",
        f"reward.model.url={judge_server.url}",
        "reward.model.max_retries=0",
        f"reward.combine={combine}:combine",
    )
    assert status == 0, err
    metrics = json.loads(out)
    rows = [
        json.loads(line) for line in dump.read_text().splitlines() if json.loads(line)["unscored"] is None
    ]
    # the DAPO rule agrees with this judge on "Answer: X": (r + m) / 2 = m
    assert [(r["rule_score"], r["model_score"], r["score"]) for r in rows] == [
        (s, s, s) for s in (1.0, 1.0, -1.0, 1.0, -1.0, 1.0)
    ]
    # maj@2 over the first two scored: 1+1 votes "2", "2" (right); 2+3 "5", "4": a tie, "5" first (right)
    assert metrics["maj@1"] == 1.0 and metrics["maj@2"] == 1.0
    assert metrics["avg@4"] == pytest.approx(BY_HAND["avg@4"])


def test_the_runs_reward_model_is_used_and_overrides_go_on_top(
    capsys, servers, tokenizer_dir, data, tmp_path
):
    _, judge_server = servers
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(
        None,
        [
            f"model.path={tokenizer_dir}",
            f"data.val_files=[{data}]",
            "reward.model.kind=judge",
            f"reward.model.url={judge_server.url}",
            "reward.model.max_retries=3",
        ],
    )
    (run / "config.yaml").write_text(to_yaml(cfg))
    args = [a for a in common_args(servers, tokenizer_dir, data, tmp_path / "d.jsonl") if a != data]
    args.remove("--data")
    before = len(judge_server.requests)
    status, out, err = eval_cli(capsys, *args, "--run", run, "reward.model.max_retries=0")
    assert status == 0, err
    metrics = json.loads(out)
    assert metrics["unscored/server_error"] == 1.0 and metrics["avg@4"] == pytest.approx(BY_HAND["avg@4"])
    # max_retries=0 from the override: the 500 was asked once
    fives = [b for p, b in judge_server.requests[before:] if "Answer: 500" in json.dumps(b)]
    assert len(fives) == 1


def test_every_response_unscored_reports_the_counts_and_exits_1(capsys, servers, tokenizer_dir, tmp_path):
    f = tmp_path / "val.jsonl"
    f.write_text(json.dumps({"prompt": "4+4", "answer": "8"}) + "\n")
    _, judge_server = servers
    status, out, err = eval_cli(
        capsys,
        *common_args(servers, tokenizer_dir, f, tmp_path / "d.jsonl"),
        "reward.model.kind=judge",
        f"reward.model.url={judge_server.url}",
    )
    assert status == 1
    metrics = json.loads(out)
    assert metrics["unscored"] == 4.0 and metrics["problems_unscored"] == 1.0 and "avg@4" not in metrics
    assert (
        err.strip()
        == "eval: the reward model scored no response (4 unscored: unparseable 4); --dump writes each one's reason"
    )


def test_metrics_leave_unscored_samples_out_by_hand():
    """aggregate() alone: avg over each problem's scored samples, pass@k/maj@k only where k are."""
    a = ProblemSamples(
        "a", [True, False], ["1", "2"], [5, 5, 5], [False] * 3, unscored=["timeout"], scores=[1, -1]
    )
    b = ProblemSamples(
        "b", [True, True, True], ["3", "3", "4"], [2, 2, 2], [False, True, False], [], [1, 1, 1]
    )
    c = ProblemSamples("c", [], [], [9, 9, 9], [True] * 3, unscored=["down", "down", "timeout"])
    m = aggregate([a, b, c], ks=(1, 3))
    assert m["avg@3"] == pytest.approx((1 / 2 + 1) / 2)
    assert m["pass@1"] == pytest.approx((1 / 2 + 1) / 2)
    assert m["pass@3"] == 1.0 and m["maj@3"] == 1.0  # b only: a has 2 scored, c none
    assert m["maj@1"] == pytest.approx((1 + 1) / 2)
    assert (m["problems_below@1"], m["problems_below@3"], m["problems_unscored"]) == (0.0, 1.0, 1.0)
    assert (m["unscored"], m["unscored/down"], m["unscored/timeout"]) == (4.0, 2.0, 2.0)
    assert m["score/mean"] == pytest.approx(3 / 5)
    # lengths and truncation are the generation's: every sample, scored or not
    assert m["response_length/mean"] == pytest.approx((15 + 6 + 27) / 9)
    assert m["truncated_ratio"] == pytest.approx(4 / 9)
    assert m["samples_per_problem"] == 3.0 and m["num_problems"] == 3.0
    # the rule reward (unscored=None) reports none of the unscored keys
    rule = aggregate([ProblemSamples("r", [True, False], ["1", "2"], [1, 1], [False, False])], ks=(1, 2))
    assert not any(key.startswith(("unscored", "problems_", "score/")) for key in rule)


class FakeModel:
    """A reward model answering by table: sample_id -> score or unscored reason."""

    def __init__(self, table):
        self.table = table
        self.calls = []
        self.closed = False

    def score_many(self, samples):
        self.calls.append([s.sample_id for s in samples])
        out = []
        for s in samples:
            v = self.table[s.response]
            out.append(
                ScoreOutcome(s.sample_id, None, v) if isinstance(v, str) else ScoreOutcome(s.sample_id, v)
            )
        return out

    def close(self):
        self.closed = True


def test_the_served_scorer_sends_batches_and_opens_the_model_at_the_first():
    fake = FakeModel({"a": 2.0, "b": -0.5, "c": "timeout"})
    opened = []
    problems = [
        EvalProblem(f"p{i}", f"q{i}", [i], "free_form", "x", {}, [{"role": "user", "content": f"q{i}"}])
        for i in range(3)
    ]

    def generate(probs, k):
        assert not opened, "the model opens after sampling"
        return [[Completion(t, 1, False) for t in ("a", "b", "c")] for _ in probs]

    scorer = ServedScorer(lambda: opened.append(1) or fake, batch_size=4)
    m = evaluate(problems, generate, scorer, k=3, pass_ks=(1, 2), prefix="val/")
    scorer.close()
    assert [len(c) for c in fake.calls] == [4, 4, 1] and fake.closed
    assert fake.calls[0][:3] == ["problem p0 response 0", "problem p0 response 1", "problem p0 response 2"]
    # acc = score > 0 without reward.combine: [a right, b wrong] per problem
    assert m["val/avg@3"] == 0.5 and m["val/unscored/timeout"] == 3.0
    assert m["val/score/mean"] == pytest.approx(0.75) and "val/maj@1" not in m


def test_a_problem_without_chat_messages_is_refused_by_name():
    scorer = ServedScorer(lambda: FakeModel({}))
    with pytest.raises(ValueError, match="problem p has no chat messages"):
        scorer.score_batch([(EvalProblem("p", "q", [1], "s", "x", {}), Completion("a", 1, False))])
