"""Check, before anything is sampled, that every prompt fits its budget and the model's context.

A prompt the server cannot take fails only once requests are in flight, and a server's message
names neither the template that made the prompt long nor the knob to turn; this check names both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_dapo.data.templates import DAPO_TEMPLATE_MARKER
from megatron_dapo.eval.runner import EvalProblem


class PromptTooLong(ValueError):
    """A prompt does not fit: bad input the user fixes with a flag or the run's config."""


@dataclass(frozen=True)
class PromptSettings:
    """How eval builds and bounds its prompts; ``origin`` names where each value came from
    (a flag, or a key of a run's config.yaml), for the error lines."""

    template: str
    apply_chat_template: bool
    max_prompt_length: int
    max_response_length: int
    origin: dict[str, str] = field(default_factory=dict)

    def name(self, key: str) -> str:
        return self.origin.get(key, key)

    def describe(self, prompt_text: str) -> str:
        """``template auto -> dapo, chat template on`` for a prompt built with these settings."""
        if self.template == "auto":
            template = "auto -> " + ("dapo" if DAPO_TEMPLATE_MARKER in prompt_text else "none")
        elif self.template in ("dapo", "none"):
            template = self.template
        else:
            template = f"custom {self.template[:40]!r}"
        chat = "on" if self.apply_chat_template else "off"
        return f"template {template} from {self.name('template')}, chat template {chat}"


def check_prompts_fit(
    problems: Sequence[EvalProblem],
    settings: PromptSettings,
    context_length: int | None,
    context_from: str,
) -> None:
    """Raise :class:`PromptTooLong` (one line) unless every prompt is at most ``max_prompt_length``
    tokens and, with ``max_response_length`` response tokens, within ``context_length``
    (None: unknown, only the prompt budget is checked). ``context_from`` says where the context
    length was read."""
    if not problems:
        return
    longest = max(problems, key=lambda p: len(p.prompt_ids))
    n_tokens = len(longest.prompt_ids)
    which = f"the longest (problem {longest.problem_id}) is {n_tokens} tokens ({settings.describe(longest.prompt_text)})"
    over_budget = [p for p in problems if len(p.prompt_ids) > settings.max_prompt_length]
    if over_budget:
        raise PromptTooLong(
            f"{len(over_budget)} of {len(problems)} prompts are longer than "
            f"{settings.name('max_prompt_length')}={settings.max_prompt_length} tokens: {which}; "
            f"raise {settings.name('max_prompt_length')} or choose another template"
        )
    if context_length is None:
        return
    budget = settings.max_response_length
    over_context = [p for p in problems if len(p.prompt_ids) + budget > context_length]
    if over_context:
        room = context_length - n_tokens
        fix = (
            f"lower {settings.name('max_response_length')} to at most {room} or shorten the prompts"
            if room > 0
            else "the prompt alone fills the context: shorten the prompts"
        )
        raise PromptTooLong(
            f"{len(over_context)} of {len(problems)} prompts do not fit the model's context of "
            f"{context_length} tokens ({context_from}): {which} and needs {n_tokens + budget} "
            f"with {settings.name('max_response_length')}={budget} response tokens; {fix} "
            "(e.g. another template)"
        )
