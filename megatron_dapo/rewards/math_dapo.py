"""The DAPO math reward: +1 if the final ``Answer:`` line matches the ground truth, else -1.

Behaviour follows the rule released with the DAPO paper (``eval/math_dapo.py`` of
BytedTsinghua-SIA/DAPO, identical to verl's ``math_dapo``), so rewards and AIME scores are
comparable with the paper's:

1. Only the last 300 characters of the response are read.
2. The prediction is the text after the last case-insensitive ``Answer:`` (up to the end of
   that line; whitespace, including newlines, after the colon is skipped).
3. Prediction and ground truth go through the same Minerva normalisation
   (:func:`normalize_final_answer`) and must then be equal as strings.

What the released normalisation does *not* do, and therefore neither does this one (a
response must match these literally): it does not map ``\\dfrac`` to ``\\frac``, does not drop
``\\%``, does not drop a trailing ``.`` after a bare number (``Answer: 42.`` is wrong; ``$42$.``
is right), and strips commas only when what remains is all digits (``-1,000`` keeps its comma).

``boxed_fallback`` (off by default, not in the release) takes the last ``\\boxed{...}`` of the
last 300 characters when no ``Answer:`` line is present.
"""

from __future__ import annotations

import re

TAIL_CHARS = 300
STRICT_BOX_TAIL_CHARS = 100
INVALID = "[INVALID]"

_ANSWER_LINE = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)

# Applied in order with str.replace; the order matters ("\\text{m}" becomes "\\text{}", which a
# later removal deletes).
_REPLACEMENTS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)

# Units, filler words and TeX spacing, deleted wherever they occur (Minerva's list).
_DELETIONS = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)

# The first $...$ pair wins; text around it is dropped.
_FIRST_INLINE_MATH = re.compile(r"(.*?)\$(.*?)\$(.*)")
_UNWRAP = (
    re.compile(r"\\text\{(.*?)\}"),
    re.compile(r"\\textbf\{(.*?)\}"),
    re.compile(r"\\overline\{(.*?)\}"),
    re.compile(r"\\boxed\{(.*)\}"),
)
# Shorthand TeX: \frac12 -> \frac{1}{2}, \sqrt2 -> \sqrt{2}
_FRAC_SHORTHAND = re.compile(r"frac([^{])(.)")
_SQRT_SHORTHAND = re.compile(r"sqrt([^{])")


def normalize_final_answer(answer: str) -> str:
    """Minerva-style canonical form of a final answer (the DAPO release's normalisation)."""
    text = answer.split("=")[-1]
    for old, new in _REPLACEMENTS:
        text = text.replace(old, new)
    for junk in _DELETIONS:
        text = text.replace(junk, "")
    text = _FIRST_INLINE_MATH.sub(r"$\2$", text)
    for pattern in _UNWRAP:
        text = pattern.sub(r"\1", text)
    text = _FRAC_SHORTHAND.sub(r"frac{\1}{\2}", text)
    text = _SQRT_SHORTHAND.sub(r"sqrt{\1}", text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def last_boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    open_at = start + len("\\boxed")
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
    return None


def extract_answer(solution_str: str, boxed_fallback: bool = False) -> str | None:
    """The raw (unnormalised) final answer of a response, or None when there is none."""
    tail = solution_str[-TAIL_CHARS:]
    lines = _ANSWER_LINE.findall(tail)
    if lines:
        return lines[-1]
    if boxed_fallback:
        return last_boxed_content(tail)
    return None


def compute_score(
    solution_str: str,
    ground_truth: str,
    strict_box_verify: bool = False,
    boxed_fallback: bool = False,
) -> dict:
    """Score one response: ``{"score": 1.0 or -1.0, "acc": bool, "pred": str}``.

    Args:
        solution_str: the decoded response (prompt excluded).
        ground_truth: the reference answer (e.g. ``"540"``), normalised like the prediction.
        strict_box_verify: the release's alternative rule: the last ``\\boxed{}`` within the
            last 100 characters must equal the ground truth verbatim (no normalisation).
        boxed_fallback: use the last ``\\boxed{}`` when there is no ``Answer:`` line (not in the
            release; off by default).

    ``pred`` is the normalised prediction, or ``"[INVALID]"`` when none was found; a missing
    prediction is always wrong.
    """
    if not isinstance(solution_str, str) or not isinstance(ground_truth, str):
        raise TypeError(
            f"compute_score needs str arguments, got solution_str={type(solution_str).__name__}, "
            f"ground_truth={type(ground_truth).__name__}"
        )
    if strict_box_verify:
        boxed = last_boxed_content(solution_str[-STRICT_BOX_TAIL_CHARS:])
        correct = boxed is not None and boxed == ground_truth
        pred = INVALID if boxed is None else boxed
    else:
        raw = extract_answer(solution_str, boxed_fallback)
        pred = INVALID if raw is None else normalize_final_answer(raw)
        correct = raw is not None and pred == normalize_final_answer(ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
