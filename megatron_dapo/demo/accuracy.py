"""Sampled held-out accuracy of an HF model on demo problems, scored by the math_dapo rule."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dapo.demo.sft import prompt_ids
from megatron_dapo.demo.task import Problem
from megatron_dapo.rewards.math_dapo import compute_score


@dataclass(frozen=True)
class Accuracy:
    """avg@k: mean correctness over all k samples of all problems."""

    mean: float
    num_problems: int
    samples_per_problem: int
    temperature: float
    top_p: float


def generate_responses(
    model,
    tokenizer,
    questions: list[str],
    *,
    n: int,
    temperature: float,
    max_new_tokens: int,
    top_p: float = 1.0,
    batch_size: int = 256,
) -> list[list[int]]:
    """``n`` sampled responses (token ids, EOS included when produced) per question, question-major.

    ``temperature`` 0 means greedy; otherwise tokens are sampled at ``temperature`` from the
    nucleus of mass ``top_p`` (1.0: the full distribution).
    """
    import torch

    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")

    prompts = [prompt_ids(tokenizer, q) for q in questions for _ in range(n)]
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        width = max(map(len, chunk))
        ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for row, p in enumerate(chunk):
            ids[row, width - len(p) :] = torch.tensor(p)
            attn[row, width - len(p) :] = 1
        with torch.no_grad():
            gen = model.generate(
                input_ids=ids,
                attention_mask=attn,
                max_new_tokens=max_new_tokens,
                do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None,
                top_p=top_p if temperature > 0 else None,
                top_k=0 if temperature > 0 else None,  # greedy: no top_k, or transformers warns it is unused
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        for row in gen[:, width:].tolist():
            out.append(_trim(row, tokenizer.eos_token_id))
    return out


def _trim(row: list[int], eos_id: int) -> list[int]:
    """Cut a generated row after its first EOS (generate pads finished rows)."""
    return row[: row.index(eos_id) + 1] if eos_id in row else row


def worked_line_accuracy(model, tokenizer, problems: list[Problem], max_new_tokens: int = 32) -> float:
    """Share of greedy responses whose first line is the problem's worked line with the right result.

    What the warm start has learnt of the arithmetic itself, whatever final answer it writes.
    """
    responses = generate_responses(
        model, tokenizer, [p.question for p in problems], n=1, temperature=0.0, max_new_tokens=max_new_tokens
    )
    decoded = (tokenizer.decode(r, skip_special_tokens=True) for r in responses)
    return sum(map(worked_line_is_right, decoded, problems)) / len(problems)


def worked_line_is_right(response: str, problem: Problem) -> bool:
    """True when the response's first line is exactly "a op b = result" with the right result."""
    first = response.split("\n", 1)[0].strip()
    return first == f"{problem.a} {problem.op} {problem.b} = {problem.answer}"


def sampled_accuracy(
    model,
    tokenizer,
    problems: list[Problem],
    *,
    k: int = 4,
    temperature: float = 1.0,
    top_p: float = 0.7,
    max_new_tokens: int = 32,
    seed: int = 0,
) -> Accuracy:
    """avg@k with the math_dapo rule; sampling seeded by ``seed`` so repeated calls agree.

    The defaults are the project's evaluation protocol (the DAPO paper's AIME one): k samples per
    problem at temperature 1.0 with top_p 0.7.
    """
    import torch

    torch.manual_seed(seed)
    responses = generate_responses(
        model,
        tokenizer,
        [p.question for p in problems],
        n=k,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        top_p=top_p,
    )
    truths = [str(p.answer) for p in problems for _ in range(k)]
    correct = [
        compute_score(tokenizer.decode(r, skip_special_tokens=True), t)["acc"]
        for r, t in zip(responses, truths)
    ]
    return Accuracy(
        mean=sum(correct) / len(correct),
        num_problems=len(problems),
        samples_per_problem=k,
        temperature=temperature,
        top_p=top_p,
    )
