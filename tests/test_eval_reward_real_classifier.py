"""`megatron-dapo eval` with a classifier reward model it serves itself, through the real SGLang
0.5.23 CPU server: `reward.model.kind=classifier reward.model.path=DIR` on a tiny random
Qwen2ForSequenceClassification (no ``score.bias``, as transformers saves it).

The policy (the tiny random causal LM, the HF engine) samples first; then eval writes the served
copy, starts one server (``--is-embedding``), runs the start-up check against transformers,
scores every response, and stops the server. Each response's score must be transformers'
``AutoModelForSequenceClassification`` logit of the same conversation within 1e-4, and avg@k is
the share of positive scores, by hand from those. One server start (20-40 s on an idle 2-core
machine); skips without ``.venv-sglang``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
from reward_model_fixtures import make_tiny_classifier
from sglang_fixtures import launched_servers, require_sglang

from megatron_dapo.cli import main
from megatron_dapo.rewards.served.classifier import load_tokenizer, render_ids
from megatron_dapo.rewards.served.startup_check import reference_scores

PROBLEMS = ["1+1", "2+3", "4+4"]
K = 2
TOLERANCE = 1e-4


def test_eval_serves_a_classifier_and_scores_as_transformers(tiny_hf_checkpoint, tmp_path, capsys):
    require_sglang()
    policy = tiny_hf_checkpoint()
    rm = make_tiny_classifier(tmp_path / "rm", max_shard_size="100KB")
    data = tmp_path / "val.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "x"}) + "\n" for p in PROBLEMS))
    dump = tmp_path / "dump.jsonl"
    workdirs = set(Path(tempfile.gettempdir()).glob("megatron-dapo-eval-reward-*"))
    status = main(
        [
            "eval",
            "--hf-dir",
            str(policy),
            "--data",
            str(data),
            "--template",
            "none",
            "--no-chat-template",
            "--k",
            str(K),
            "--pass-k",
            "1",
            "--max-tokens",
            "6",
            "--dump",
            str(dump),
            "reward.model.kind=classifier",
            f"reward.model.path={rm}",
        ]
    )
    out = capsys.readouterr()
    assert status == 0, out.err
    metrics = json.loads(out.out)
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    assert len(rows) == len(PROBLEMS) * K and not any(r["unscored"] for r in rows)

    tokenizer = load_tokenizer(str(rm), "test")
    by_problem = {str(i): p for i, p in enumerate(PROBLEMS)}
    ids = [
        render_ids(tokenizer, [{"role": "user", "content": by_problem[r["problem"]]}], r["response"], "test")
        for r in rows
    ]
    expected = [logits[0] for logits in reference_scores(rm, ids)]
    assert [r["model_score"] for r in rows] == pytest.approx(expected, abs=TOLERANCE)
    assert [r["score"] for r in rows] == [r["model_score"] for r in rows]
    assert [r["acc"] for r in rows] == [s > 0 for s in expected]

    # by hand: avg@2 is the mean over problems of each one's share of positive scores
    per_problem = [[s > 0 for s in expected[i * K : (i + 1) * K]] for i in range(len(PROBLEMS))]
    assert metrics["avg@2"] == pytest.approx(sum(sum(p) / K for p in per_problem) / len(PROBLEMS))
    assert metrics["score/mean"] == pytest.approx(sum(expected) / len(expected), abs=TOLERANCE)
    assert metrics["unscored"] == 0.0 and metrics["problems_unscored"] == 0.0

    # the server is gone, and its work directory (the served copy, the log) with it
    assert launched_servers(os.getpid()) == []
    assert set(Path(tempfile.gettempdir()).glob("megatron-dapo-eval-reward-*")) == workdirs
