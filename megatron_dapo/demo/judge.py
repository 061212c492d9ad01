"""A tiny judge for the arithmetic demo: `megatron-dapo demo --judge` rewards the policy through a
generative judge served by SGLang instead of the DAPO rule, on CPU, end to end.

Why a judge of its own: the policy cannot judge (its context of 256 tokens does not hold the
built-in judge prompt, 263 tokens before any response, and it was only taught arithmetic), and no
chat model small enough for the CPU demo exists to download. So the demo trains one the way it
trains the policy's warm start: a model of the policy's shape and tokenizer, supervised on judging
responses to the demo's training problems.

What it learns: given ``JUDGE_TEMPLATE`` (the reference, then the response), to write the
response's final answer, the reference, then "yes" or "no" ("55 55 yes"). Writing the two numbers
first makes the comparison one between neighbouring tokens, which a 2-layer model learns in a few
hundred steps; asked for "yes"/"no" alone it stayed near 70% (measured, 600 steps). The built-in
``yes_no`` parser reads the verdict (its first standalone yes/no). The labels are the DAPO rule's
(``rewards.math_dapo``) on the same response, so a perfect judge would give the rule's rewards;
the responses judged in training are the kinds the warm-started policy writes: the right worked
line and answer, the lazy teacher's first operand as the answer, a wrong answer, a wrong line with
the right answer, and no answer line at all. Its held-out accuracy (problems it never saw) is
measured after training and printed; the judge's mistakes are reward noise the run trains through,
as with a real judge.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from megatron_dapo.demo.accuracy import generate_responses
from megatron_dapo.demo.model import TinyModelSpec, create_model, save_checkpoint
from megatron_dapo.demo.sft import SFTConfig, supervised_warm_start
from megatron_dapo.demo.task import Problem, make_problems
from megatron_dapo.demo.tokenizer import build_tokenizer
from megatron_dapo.driver.progress import heartbeat
from megatron_dapo.rewards.math_dapo import compute_score, extract_answer
from megatron_dapo.rewards.served.judge import judge_prompt_ids, parse_yes_no, render_prompt
from megatron_dapo.rewards.served.outcome import RewardSample

# The reference first, then the response: what the judge compares, and nothing else (the question
# is not needed to compare two final answers, and leaving it out keeps the prompt short).
JUDGE_TEMPLATE = "Reference: {ground_truth}\n{response}\nSame?"
JUDGE_MAX_NEW_TOKENS = 16  # "NNN NNN yes" and the end token
# Share of training responses broken on purpose (``garbled``): a judge shown only well-formed
# responses was gamed within 10 steps (the policy's held-out accuracy 84.4% by the judge, 7.6% by
# the rule: garbled lines it said yes to).
GARBLED_SHARE = 0.25
# Bump when the examples, template or training change, so a cached judge is rebuilt.
JUDGE_VERSION = 2
MANIFEST = "judge.json"


@dataclass(frozen=True)
class JudgeRecipe:
    spec: TinyModelSpec = TinyModelSpec()
    steps: int = 800
    batch_size: int = 64
    lr: float = 3e-3
    num_train: int = 4000
    num_val: int = 200
    probe_examples: int = 600  # held-out responses the accuracy is measured on


@dataclass(frozen=True)
class DemoJudge:
    hf_dir: Path
    accuracy: float  # greedy verdicts equal to the rule's on held-out responses
    steps: int
    seconds: float
    reused: bool


def judged_response(problem: Problem, rng: random.Random) -> str:
    """A response to ``problem`` of one of the kinds the warm-started policy writes."""
    c = problem.answer
    wrong = c + rng.choice([d for d in range(-9, 10) if d and c + d >= 0])
    line = f"{problem.a} {problem.op} {problem.b} = {c}"
    bad_line = f"{problem.a} {problem.op} {problem.b} = {wrong}"
    kinds = (
        f"{line}\nAnswer: {c}",  # right (a third of the kinds: the policy's most common once trained)
        f"{line}\nAnswer: {c}",
        f"{line}\nAnswer: {c}",
        f"{line}\nAnswer: {problem.a}",  # the lazy teacher's
        f"{line}\nAnswer: {wrong}",
        f"{bad_line}\nAnswer: {wrong}",
        f"{bad_line}\nAnswer: {c}",  # right by the rule: it reads the final answer only
        line,  # no answer line (cut at the budget)
    )
    if rng.random() < GARBLED_SHARE:
        return garbled(f"{line}\nAnswer: {c}", rng)
    return rng.choice(kinds)


def garbled(text: str, rng: random.Random) -> str:
    """``text`` broken the ways a policy searching for the judge's blind spots breaks it: its
    characters shuffled, its answer line's label mangled, or its digits run together."""
    how = rng.randrange(3)
    if how == 0:
        chars = list(text)
        rng.shuffle(chars)
        return "".join(chars)
    if how == 1:
        return text.replace("Answer: ", rng.choice(["Answer", "Answe", "Answer:: ", "nswer: ", "Answer "]))
    return text.replace(" ", "")


def verdict(response: str, ground_truth: str) -> str:
    """What the judge is taught to write: the response's final answer, the reference, and the
    rule's verdict on them."""
    right = compute_score(response, ground_truth)["acc"]
    return f"{extract_answer(response) or 'none'} {ground_truth} {'yes' if right else 'no'}"


def _sample(problem: Problem, response: str) -> RewardSample:
    return RewardSample(
        "demo", [{"role": "user", "content": problem.question}], response, str(problem.answer)
    )


def _examples(problems: list[Problem], rng: random.Random) -> list[tuple[Problem, str]]:
    return [(p, judged_response(p, rng)) for p in problems]


def _accuracy(model, tokenizer, examples: list[tuple[Problem, str]]) -> float:
    """Share of greedy verdicts that agree with the rule (yes_no's reading of the text)."""
    prompts = [render_prompt(JUDGE_TEMPLATE, _sample(p, r)) for p, r in examples]
    out = generate_responses(
        model, tokenizer, prompts, n=1, temperature=0.0, max_new_tokens=JUDGE_MAX_NEW_TOKENS
    )
    agree = 0
    for ids, (p, r) in zip(out, examples):
        said = parse_yes_no(tokenizer.decode(ids, skip_special_tokens=True))
        agree += said is not None and (said > 0) == compute_score(r, str(p.answer))["acc"]
    return agree / len(examples)


def prepare_demo_judge(
    out_dir: str | Path, seed: int = 0, *, recipe: JudgeRecipe = JudgeRecipe(), console: Any = None
) -> DemoJudge:
    """Train (or reuse, when ``out_dir`` holds one of the same recipe and seed) the demo's judge;
    its HF checkpoint, with the demo's tokenizer and chat template, is ``out_dir/hf``."""
    import torch
    from rich.console import Console

    console = console or Console()
    root = Path(out_dir)
    key = {"version": JUDGE_VERSION, "seed": seed, "recipe": asdict(recipe), "template": JUDGE_TEMPLATE}
    manifest = root / MANIFEST
    if manifest.is_file():
        data = json.loads(manifest.read_text())
        if data.get("key") == key and (root / "hf" / "model.safetensors").is_file():
            console.print(
                f"[green]demo judge[/] reused from {root} (held-out agreement with the rule {data['accuracy']:.1%})"
            )
            return DemoJudge(root / "hf", data["accuracy"], data["steps"], data["seconds"], reused=True)
    root.mkdir(parents=True, exist_ok=True)
    manifest.unlink(missing_ok=True)  # a half-built judge must not look cached
    train, val = make_problems(seed, recipe.num_train, recipe.num_val)  # the policy's split
    tokenizer = build_tokenizer(recipe.spec.vocab_size)
    model = create_model(recipe.spec, tokenizer, seed=seed + 1)
    examples = _examples(train, random.Random(f"judge-{seed}"))
    held_out = _examples(val, random.Random(f"judge-val-{seed}"))
    held_out = (held_out * (recipe.probe_examples // len(held_out) + 1))[: recipe.probe_examples]

    def encode(example: tuple[Problem, str], lazy: bool) -> tuple[list[int], list[int]]:
        del lazy
        problem, response = example
        prompt = judge_prompt_ids(tokenizer, JUDGE_TEMPLATE, _sample(problem, response))
        target = tokenizer(verdict(response, str(problem.answer)), add_special_tokens=False)["input_ids"]
        return prompt, target + [tokenizer.eos_token_id]

    state = {"step": 0, "loss": float("nan")}
    cfg = SFTConfig(steps=recipe.steps, batch_size=recipe.batch_size, lr=recipe.lr, seed=seed)

    def line(elapsed: float) -> str:
        return (
            f"demo judge (SFT) step {state['step']}/{recipe.steps} loss {state['loss']:.3f}, {elapsed:.0f}s"
        )

    with heartbeat(console, line):
        result = supervised_warm_start(
            model,
            tokenizer,
            examples,
            cfg,
            on_step=lambda s, loss: state.update(step=s, loss=loss),
            encode=encode,
        )
    with torch.no_grad():
        accuracy = _accuracy(model, tokenizer, held_out)
    save_checkpoint(model, tokenizer, root / "hf")
    data = {"key": key, "accuracy": accuracy, "steps": result.steps, "seconds": round(result.seconds, 1)}
    manifest.write_text(json.dumps(data, indent=2))
    console.print(
        f"[green]demo judge trained[/] in {result.steps} steps, {result.seconds:.0f}s; its verdicts agree with the "
        f"rule on {accuracy:.1%} of {len(held_out)} held-out responses"
    )
    return DemoJudge(root / "hf", accuracy, result.steps, result.seconds, reused=False)


def judge_overrides(judge: DemoJudge) -> list[str]:
    """The run's ``reward.model`` for the demo judge (served by SGLang from its checkpoint)."""
    return [
        "reward.model.kind=judge",
        f"reward.model.path={judge.hf_dir}",
        f"reward.model.prompt_template={json.dumps(JUDGE_TEMPLATE)}",
        f"reward.model.max_new_tokens={JUDGE_MAX_NEW_TOKENS}",
    ]
