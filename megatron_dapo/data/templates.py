"""Prompt templates; the DAPO template is applied to bare problems."""

from __future__ import annotations

# Verbatim from the DAPO release (the AIME 2024 eval parquet's prompts are this with the problem).
DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the "
    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
DAPO_TEMPLATE_MARKER = "Solve the following math problem step by step."
TEMPLATE_MODES = ("auto", "dapo", "none")
PLACEHOLDER = "{problem}"


def check_template(template: str) -> None:
    """Raise ValueError unless ``template`` is a mode name or a custom string with ``{problem}``."""
    if template not in TEMPLATE_MODES and PLACEHOLDER not in template:
        raise ValueError(
            f"template must be one of {', '.join(TEMPLATE_MODES)} or a string containing {PLACEHOLDER}; "
            f"got {template!r:.80}"
        )


def apply_template(problem: str, template: str) -> str:
    """The user prompt for ``problem`` under ``template``.

    ``"dapo"`` always wraps the problem in the DAPO template; ``"auto"`` does so unless the text
    already contains the template's first sentence; ``"none"`` leaves it as is; any other
    string is a custom template whose ``{problem}`` is replaced (plain replacement, so braces
    in the problem or template are safe).
    """
    check_template(template)
    if template == "none":
        return problem
    if template == "auto":
        return problem if DAPO_TEMPLATE_MARKER in problem else DAPO_TEMPLATE.replace(PLACEHOLDER, problem)
    chosen = DAPO_TEMPLATE if template == "dapo" else template
    return chosen.replace(PLACEHOLDER, problem)
