"""What goes into a served reward model and what comes out of it.

A scoring call never returns 0 for a failure: it returns a :class:`ScoreOutcome` that either
holds a score or says why there is none (``UNSCORED_REASONS``). A failure that is the user's to
fix, not the server's (an HTTP 4xx, a server down past its grace), raises instead, in one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# timeout: no answer within reward.model.timeout_s, or HTTP 408, on every attempt
# server_error: HTTP 5xx on every attempt
# unparseable: an answer with no score in it (a judge's verdict without one, a body that is not
#   the endpoint's JSON); not retried, since a greedy judge gives the same verdict again
# down: the connection was refused or dropped (the server is dead or restarting)
# rate_limited: HTTP 429 on every attempt (each retried after its Retry-After)
# too_long: the judge's prompt does not fit its context (reward.model.too_long=unscored, or a
#   server that refused it as too long)
# closed: the client was closed while the sample waited (the run is stopping)
UNSCORED_REASONS = ("timeout", "server_error", "rate_limited", "unparseable", "too_long", "down", "closed")


@dataclass(frozen=True)
class RewardSample:
    """One response to score.

    Attributes:
        sample_id: names the sample in errors and outcomes (an index or a request id).
        messages: the prompt's chat messages ``[{"role", "content"}]``; a judge's ``{question}``
            is the content of the last ``user`` message.
        response: the decoded response, without the end-of-turn token (the reward model's chat
            template adds its own).
        ground_truth: the reference answer (a judge's ``{ground_truth}``).
        data_source / extra_info: passed through to ``reward.combine``.
    """

    sample_id: str | int
    messages: list[dict]
    response: str
    ground_truth: str = ""
    data_source: str = ""
    extra_info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ScoreOutcome:
    """The result of scoring one sample: ``score``, or ``unscored`` with a reason.

    Attributes:
        sample_id: the sample's id.
        score: the reward (after ``reward.model.transform`` or the judge's parser); None when
            unscored.
        unscored: one of ``UNSCORED_REASONS``, or None when scored.
        detail: for an unscored sample, the last error (one line); empty otherwise.
        raw: a classifier's raw output (the logits SGLang returned) or None.
        verdict: a judge's text, or None.
        server: the URL of the server that answered last (or was tried last).
        attempts: requests sent, retries included.
        elapsed_s: from the first request to the outcome, back-off waits included.
        throttled: HTTP 429/408 answers among the attempts (each waited its Retry-After).
        cut_tokens: a judge's prompt too long for its context: the response tokens dropped.
    """

    sample_id: str | int
    score: float | None
    unscored: str | None = None
    detail: str = ""
    raw: list[float] | None = None
    verdict: str | None = None
    server: str = ""
    attempts: int = 0
    elapsed_s: float = 0.0
    throttled: int = 0
    cut_tokens: int = 0

    def __post_init__(self):
        if (self.score is None) == (self.unscored is None):
            raise ValueError(
                f"sample {self.sample_id}: an outcome has a score or an unscored reason, not "
                f"{'both' if self.score is not None else 'neither'}"
            )
        if self.unscored is not None and self.unscored not in UNSCORED_REASONS:
            raise ValueError(f"unscored={self.unscored!r} is not one of {UNSCORED_REASONS}")

    @property
    def scored(self) -> bool:
        return self.score is not None


class RewardModelError(RuntimeError):
    """A served reward model cannot be used as configured; the message is one line with the fix."""


class RewardRequestError(RewardModelError):
    """The reward server refused a request (HTTP 4xx): the request is wrong, retrying cannot help.

    The message names the status, the server's reason, the URL and the sample."""


class RewardServerDown(RewardModelError):
    """A reward server stayed unreachable past ``reward.model.down_grace_s``."""
