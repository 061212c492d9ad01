"""Held-out accuracy: avg@k counting, nucleus (top_p) sampling against a hand-computed nucleus."""

import pytest
import torch

from megatron_dapo.demo.accuracy import generate_responses, sampled_accuracy
from megatron_dapo.demo.model import TinyModelSpec, create_model
from megatron_dapo.demo.sft import prompt_ids
from megatron_dapo.demo.task import Problem
from megatron_dapo.demo.tokenizer import build_tokenizer


def _tiny(seed=0):
    torch.set_num_threads(1)
    tok = build_tokenizer(128)
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64)
    model = create_model(spec, tok, seed=seed).eval()
    return model, tok


class _ScriptedModel:
    """Stands in for an HF model: ``generate`` appends the next scripted response to each prompt row."""

    def __init__(self, tokenizer, responses):
        self.tok = tokenizer
        self.responses = list(responses)

    def generate(self, input_ids, **kwargs):
        rows = []
        for _ in range(input_ids.shape[0]):
            ids = self.tok(self.responses.pop(0), add_special_tokens=False)["input_ids"] + [
                self.tok.eos_token_id
            ]
            rows.append(ids)
        width = max(map(len, rows))
        out = torch.full((input_ids.shape[0], input_ids.shape[1] + width), self.tok.pad_token_id)
        out[:, : input_ids.shape[1]] = input_ids
        for r, ids in enumerate(rows):
            out[r, input_ids.shape[1] : input_ids.shape[1] + len(ids)] = torch.tensor(ids)
        return out


def test_avg_at_k_counts_every_sample_of_every_problem():
    tok = build_tokenizer(128)
    problems = [Problem("What is 12 + 3?", "+", 12, 3), Problem("Find 40 - 7.", "-", 40, 7)]
    # question-major: problem 0 gets samples 0-1, problem 1 samples 2-3; 3 of 4 are right.
    scripted = ["12 + 3 = 15\nAnswer: 15", "Answer: 14", "Answer: 33", "40 - 7 = 33\nAnswer: 33"]
    acc = sampled_accuracy(_ScriptedModel(tok, scripted), tok, problems, k=2, top_p=0.7)
    assert acc.mean == pytest.approx(0.75)
    assert (acc.num_problems, acc.samples_per_problem, acc.temperature, acc.top_p) == (2, 2, 1.0, 0.7)


def test_tiny_top_p_is_greedy():
    torch.manual_seed(0)
    model, tok = _tiny()
    questions = ["What is 47 + 8?", "Find 12 - 3."]
    greedy = generate_responses(model, tok, questions, n=1, temperature=0.0, max_new_tokens=6)
    torch.manual_seed(5)
    nucleus = generate_responses(model, tok, questions, n=2, temperature=1.0, top_p=1e-6, max_new_tokens=6)
    assert nucleus == [greedy[0]] * 2 + [greedy[1]] * 2


def test_top_p_samples_only_from_the_hand_computed_nucleus():
    model, tok = _tiny(seed=1)
    question = "Compute 23 + 9."
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids(tok, question)])).logits[0, -1]
    probs, order = torch.softmax(logits.double(), -1).sort(descending=True)
    # Smallest prefix of the sorted distribution whose mass reaches top_p.
    size = int((probs.cumsum(0) < 0.5).sum()) + 1
    nucleus = set(order[:size].tolist())
    assert 1 < size < 100  # the random model is spread out, so the test can tell the cases apart

    torch.manual_seed(0)
    first = [
        r[0]
        for r in generate_responses(
            model, tok, [question], n=200, top_p=0.5, temperature=1.0, max_new_tokens=1
        )
    ]
    assert set(first) <= nucleus and len(set(first)) > 1
    torch.manual_seed(0)
    full = [
        r[0]
        for r in generate_responses(
            model, tok, [question], n=200, top_p=1.0, temperature=1.0, max_new_tokens=1
        )
    ]
    assert set(full) - nucleus


def test_invalid_top_p_is_rejected():
    model, tok = _tiny()
    with pytest.raises(ValueError, match="top_p"):
        generate_responses(model, tok, ["Find 1 + 1."], n=1, temperature=1.0, top_p=0.0, max_new_tokens=2)
