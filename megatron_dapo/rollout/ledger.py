"""The rollout's accounting: where every drawn prompt went (batch, filtered by reason, surplus,
aborted, carried), the cut that decides the batch, and the timing of engine calls."""

from __future__ import annotations

from typing import Any

from megatron_dapo.rollout.partial import CarriedGroup
from megatron_dapo.rollout.units import Group, Unit


class Ledger:
    """Where every drawn prompt went, and the timing of engine calls.

    ``outcome`` maps a scored group's draw position to "kept" or its filter reason; the prefix
    ``[0, scanned)`` is all scored, and ``cut`` is set once that prefix holds ``target`` kept
    groups (the batch is then decided, whatever is still running).
    """

    def __init__(self, engine_names: list[str], target: int):
        self.target = target
        self.drawn = 0
        self.rounds = 0
        self.groups: dict[int, Group] = {}
        self.outcome: dict[int, str] = {}
        self.generated: set[int] = set()  # finished generating (scored or not) past the cut
        self.scanned = 0
        self.prefix_kept = 0
        self.cut: int | None = None  # number of groups, in draw order, that decided the batch
        self.kept: list[Group] = []
        self.resumed = 0  # rollout.partial: groups carried in from the previous rollout
        self.units: dict[int, Unit] = {}  # draw position -> its unit (rollout.partial)
        self.carry_out: list[CarriedGroup] = []  # rollout.partial: groups past the cut, kept
        self.restarted_tokens = 0  # rollout.partial: carried tokens dropped for staleness
        # unscored: a reward model left the group fewer than two scored responses
        self.filtered = {"all_correct": 0, "all_wrong": 0, "other": 0, "unscored": 0}
        # reward.model: responses it could not score in the groups up to the cut, by reason
        self.unscored: dict[str, int] = {}
        # groups whose filter metric is constant, measured whether or not the filter drops them
        self.zero_spread_serials: set[int] = set()
        self.zero_spread = 0
        self.surplus = 0
        self.aborted = 0
        self.scored_groups = 0
        self.retries = 0
        self.tokens = 0
        self.intervals: dict[str, list[tuple[float, float]]] = {name: [] for name in engine_names}
        # when units were scored (reward), appended by the scoring threads
        self.score_intervals: list[tuple[float, float]] = []
        # responses of finished calls handed to scoring, and those whose reward had already
        # started when their call returned (the engine handed them over as they completed)
        self.scored_responses = 0
        self.scored_early = 0
        # reward.model: (kind, ScoreOutcome) of every response it was asked to score, appended by
        # the scoring threads (requests, retries and latency of the step)
        self.model_outcomes: list[tuple[str, Any]] = []
        self.hung: list[str] = []  # engines found hung with calls in flight this step

    def record(self, group: Group, outcome: str) -> None:
        self.outcome[group.serial] = outcome
        self.groups[group.serial] = group
        while self.cut is None and self.scanned in self.outcome:
            self.prefix_kept += self.outcome[self.scanned] == "kept"
            self.scanned += 1
            if self.prefix_kept >= self.target:
                self.cut = self.scanned

    def settle(self) -> None:
        """Fill the buckets: up to the cut (or everything drawn) by outcome, the rest as unused."""
        end = self.drawn if self.cut is None else self.cut
        for serial in range(end):
            outcome = self.outcome[serial]
            for s in self.groups[serial].samples or []:
                if s.unscored is not None:
                    self.unscored[s.unscored] = self.unscored.get(s.unscored, 0) + 1
            if outcome == "kept":
                self.kept.append(self.groups[serial])
            else:
                self.filtered[outcome] += 1
        self.scored_groups = end
        self.zero_spread = sum(serial < end for serial in self.zero_spread_serials)
        for serial in range(end, self.drawn):
            if self.carry_out:  # rollout.partial: carried to the next rollout, not unused
                continue
            if serial in self.outcome or serial in self.generated:
                self.surplus += 1
            else:
                self.aborted += 1

    def check(self, in_batch: int) -> None:
        carried = len(self.carry_out)
        total = in_batch + sum(self.filtered.values()) + self.surplus + self.aborted + carried
        assert total == self.drawn, (
            f"rollout accounting broken: drawn {self.drawn} != batch {in_batch} + filtered {self.filtered} "
            f"+ surplus {self.surplus} + aborted {self.aborted} + carried {carried}"
        )
