"""Warm start: stops at the first probe check that reaches the target, and refuses a target without a probe."""

import pytest
import torch

from megatron_dapo.demo.model import TinyModelSpec, create_model
from megatron_dapo.demo.sft import SFTConfig, supervised_warm_start
from megatron_dapo.demo.task import make_problems
from megatron_dapo.demo.tokenizer import build_tokenizer


def _setup():
    torch.set_num_threads(1)
    tok = build_tokenizer(128)
    model = create_model(TinyModelSpec(hidden_size=32, intermediate_size=64), tok, seed=0)
    train, _ = make_problems(0, num_train=64, num_val=10)
    return model, tok, train


def test_stops_at_first_check_reaching_target():
    model, tok, train = _setup()
    scores = iter([0.1, 0.3, 0.6, 0.9])
    calls = []

    def probe(m):
        calls.append(m.training)
        return next(scores)

    cfg = SFTConfig(steps=20, batch_size=8, seed=0, stop_accuracy=0.5, check_every=2, min_steps=3)
    result = supervised_warm_start(model, tok, train, cfg, probe=probe)
    # Checks at steps 4, 6, 8 (the first at or after min_steps); 0.6 at step 8 reaches 0.5.
    assert result.steps == 8 and result.probe_accuracy == 0.6
    assert calls == [False, False, False]  # the probe sees the model in eval mode


def test_without_target_runs_all_steps_and_never_probes():
    model, tok, train = _setup()
    result = supervised_warm_start(
        model, tok, train, SFTConfig(steps=3, batch_size=8), probe=lambda m: pytest.fail("probed")
    )
    assert result.steps == 3 and result.probe_accuracy is None


def test_target_without_probe_is_rejected():
    model, tok, train = _setup()
    with pytest.raises(ValueError, match="stop_accuracy needs a probe"):
        supervised_warm_start(model, tok, train, SFTConfig(steps=3, stop_accuracy=0.4))


def test_lazy_teacher_keeps_the_worked_line_and_only_the_lazy_answers_score_minus_one():
    from megatron_dapo.demo.accuracy import worked_line_is_right
    from megatron_dapo.demo.sft import teacher_solution
    from megatron_dapo.rewards.math_dapo import compute_score

    _, _, train = _setup()
    p = next(q for q in train if q.op == "-")
    lazy = teacher_solution(p, lazy=True)
    assert lazy == f"{p.a} - {p.b} = {p.a - p.b}\nAnswer: {p.a}"  # written out by hand
    assert compute_score(lazy, str(p.answer))["score"] == -1.0
    assert compute_score(teacher_solution(p, lazy=False), str(p.answer))["score"] == 1.0
    assert worked_line_is_right(lazy, p) and worked_line_is_right(p.solution, p)
    assert not worked_line_is_right(f"{p.a} - {p.b} = {p.a - p.b + 1}\nAnswer: {p.a - p.b}", p)


def test_lazy_rate_sets_the_share_of_lazy_examples(monkeypatch):
    from megatron_dapo.demo import sft

    model, tok, _ = _setup()
    train, _ = make_problems(0, num_train=2000, num_val=10)
    real = sft.encode_example

    def lazies(rate):
        seen = []

        def encode(t, p, lazy=False):
            seen.append(lazy)
            return real(t, p, lazy)

        monkeypatch.setattr(sft, "encode_example", encode)
        supervised_warm_start(model, tok, train, SFTConfig(steps=1, batch_size=8, lazy_rate=rate))
        return seen

    assert not any(lazies(0.0))
    share = sum(lazies(0.5)) / len(train)
    assert 0.45 < share < 0.55  # 2000 Bernoulli(0.5) draws: 4.5 standard deviations either side
    with pytest.raises(ValueError, match="lazy_rate"):
        supervised_warm_start(model, tok, train, SFTConfig(steps=1, lazy_rate=1.0))
