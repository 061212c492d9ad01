"""Stand-ins for the rollout manager's tests: a scripted engine that answers prompt ``p`` by its class
(``prompt_ids[0]``): 0 = mixed (half the samples right), 1 = all right, 2 = all wrong; a tokenizer
that decodes token 1 as "right"; a scorer that gives +1 / -1 for right / wrong; a dataset of such
prompts; and the identity every manager metric set must satisfy (``accounted``)."""

from __future__ import annotations

import threading
import time

from megatron_dapo.data.types import PromptSample
from megatron_dapo.rollout.manager import RolloutManagerConfig
from megatron_dapo.rollout.types import GenerationResult

MIXED, RIGHT, WRONG = 0, 1, 2


class Dataset:
    def __init__(self, classes):
        self.classes = classes
        self.cursor = 0

    def next_batch(self, n):
        out = [self[i] for i in range(self.cursor, self.cursor + n)]
        self.cursor += n
        return out

    def __getitem__(self, i):
        return PromptSample(
            i, "scripted", [], f"prompt {i}", [self.classes[i % len(self.classes)], 7, i], "right", {}
        )

    def position_of(self, sample):
        """Prompt ``i`` is the ``i``-th drawn (an endless dataset in draw order)."""
        return sample.index


class CheckpointedDataset(Dataset):
    """The scripted dataset with the cursor a trainer checkpoints."""

    def state_dict(self):
        return {"cursor": self.cursor}

    def load_state_dict(self, state):
        self.cursor = state["cursor"]


class Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "right" if ids and ids[0] == 1 else "wrong"


class Result:
    def __init__(self, score, acc, pred):
        self.score, self.acc, self.pred, self.error = score, acc, pred, None


class Scorer:
    def __init__(self):
        self.calls = 0
        self.items = 0  # responses scored

    def score_many(self, items):
        self.calls += 1
        self.items += len(items)
        return [Result(1.0 if text == "right" else -1.0, text == "right", text) for _, text, _, _ in items]


class ScriptedEngine:
    """Answers by prompt class; can be slow, fail, die, or hang; honours abort like SGLang does.

    A prompt is 3 tokens; anything after them is a partial response being continued, and the
    answer is the rest of the full response. ``keep_on_abort``: tokens an aborted slow call had
    generated (returned with the abort, as SGLang does); ``version``: the weight version reported;
    ``slow_once``: a slow prompt blocks until the engine's first abort, then answers at once;
    ``abort_calls``: calls the engine itself aborts at once, returning ``keep_on_abort`` tokens
    (SGLang aborting its running requests as it shuts down); ``dies_with``: the exception a dead
    engine raises; ``hold``: an event every call waits for before answering; ``hand_over``: each
    answer goes to ``on_result`` before the call returns (False: only in the returned list)."""

    def __init__(
        self,
        name,
        length=3,
        slow_prompts=(),
        fail_calls=(),
        die_at_call=None,
        hang_calls=(),
        keep_on_abort=0,
        slow_once=False,
        abort_calls=(),
        dies_with=ConnectionError,
        hold=None,
        hand_over=True,
    ):
        self.name = name
        self.hand_over = hand_over
        self.length = length
        self.keep_on_abort = keep_on_abort
        self.slow_once = slow_once
        self.blocked = 0  # slow calls waiting for an abort now
        self.blocked_changed = threading.Condition()
        self.version = 3
        self.requests = []
        self.slow_prompts = set(slow_prompts)
        self.fail_calls = set(fail_calls)
        self.die_at_call = die_at_call
        self.hang_calls = set(hang_calls)
        self.abort_calls = set(abort_calls)
        self.dies_with = dies_with
        self.hold = hold
        self.dead = threading.Event()
        self.calls = 0
        self.aborts = 0
        self.unaborted_slow = 0  # slow calls that ended by their deadline, not by an abort
        self.seeds = {}
        self.served = []
        self._epoch = 0
        self._alive = True
        self._lock = threading.Lock()

    def generate(self, requests, on_result=None):
        epoch = self._epoch
        with self._lock:
            self.calls += 1
            call = self.calls
        if not self._alive:
            raise self.dies_with(f"{self.name} is gone")
        if self.die_at_call is not None and call >= self.die_at_call:
            self._alive = False
            self.dead.set()
            raise self.dies_with(f"{self.name} died")
        if self.hold is not None:
            assert self.hold.wait(60), f"{self.name}: nothing released the held call"
        if call in self.abort_calls:
            k = self.keep_on_abort
            return [
                GenerationResult(
                    r.request_id,
                    self._full(r)[len(r.prompt_ids) - 3 :][:k],
                    [-0.5] * k,
                    "abort",
                    self.version,
                )
                for r in requests
            ]
        if call in self.fail_calls:
            raise RuntimeError(f"{self.name}: transient failure on call {call}")
        if call in self.hang_calls:
            time.sleep(1.0)  # ignores abort, like a wedged server
        prompt_idx = requests[0].prompt_ids[2]
        if prompt_idx in self.slow_prompts:
            # blocks until aborted; the generous deadline only ends a test whose manager never aborts.
            # slow_once: until the engine's first abort, even one before this call started (the
            # manager may abort a call it dispatched before the call's thread got to run)
            def aborted():
                return self.aborts > 0 if self.slow_once else self._epoch != epoch

            deadline = time.monotonic() + 120
            with self.blocked_changed:
                self.blocked += 1
                self.blocked_changed.notify_all()
            while not aborted() and time.monotonic() < deadline:
                time.sleep(0.01)
            with self.blocked_changed:
                self.blocked -= 1
            if aborted():
                if self.slow_once:  # the continuation of this prompt answers at once
                    self.slow_prompts.discard(prompt_idx)
                k = self.keep_on_abort
                return [
                    GenerationResult(
                        r.request_id, self._full(r)[:k], [-0.5] * k, "abort", 0 if not k else self.version
                    )
                    for r in requests
                ]
            self.unaborted_slow += 1
        out = []
        for r in requests:
            self.requests.append(r)
            self.seeds[r.request_id] = r.sampling.seed
            ids = self._full(r)[len(r.prompt_ids) - 3 :]
            out.append(GenerationResult(r.request_id, ids, [-0.5] * len(ids), "stop", self.version))
            if on_result is not None and self.hand_over:
                on_result(out[-1])  # as SGLang's client does when each reply arrives
        self.served.append(prompt_idx)
        return out

    def _full(self, r):
        """The whole response to request ``r`` (sample index from its id ``...-s{j}``)."""
        j = int(r.request_id.rsplit("-s", 1)[1])
        cls = r.prompt_ids[0]
        right = cls == RIGHT or (cls == MIXED and j % 2 == 0)
        return [1 if right else 2] + [5] * (self.length - 1)

    def abort(self):
        self.aborts += 1
        self._epoch += 1

    def health(self, check_process=True):
        return self._alive


class HungEngine(ScriptedEngine):
    """Takes calls and never answers them (a wedged server): ``entered`` is set once a call is
    in, ``health()`` fails (and is counted). An abort makes the stuck calls return after all,
    complete, like a server that answers late; ``returned`` is then set."""

    def __init__(self, name, **kw):
        super().__init__(name, **kw)
        self.entered, self.returned, self._release = threading.Event(), threading.Event(), threading.Event()
        self.health_calls = 0

    def generate(self, requests, on_result=None):
        self.entered.set()
        assert self._release.wait(120), "a hung engine's call was never released"
        out = super().generate(requests, on_result)
        self.returned.set()
        return out

    def abort(self):
        self.aborts += 1
        self._release.set()

    def health(self, check_process=True):
        self.health_calls += 1
        return False


class GatedEngine(ScriptedEngine):
    """Answers only once ``gate`` is set (``entered`` tells a call is in); healthy, counted."""

    def __init__(self, name, gate, **kw):
        super().__init__(name, **kw)
        self.gate, self.entered = gate, threading.Event()
        self.health_calls = 0

    def generate(self, requests, on_result=None):
        self.entered.set()
        assert self.gate.wait(120), "gate never opened"
        return super().generate(requests, on_result)

    def health(self, check_process=True):
        self.health_calls += 1
        return True


class StepClock:
    """A clock the test moves: the manager's hang probe reads it instead of the wall clock."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def manager_config(**kw):
    """The manager's settings for the scripted tests (4 prompts x 4 samples); ``kw`` wins."""
    base = dict(
        n=4,
        gen_batch_size=4,
        train_batch_size=4,
        max_num_gen_batches=10,
        over_sample=False,
        max_response_length=8,
        overlong_buffer_len=4,
        max_concurrency_per_engine=64,
        request_timeout_s=30.0,
    )
    base.update(kw)
    return RolloutManagerConfig(**base)


def accounted(m):
    return (
        m["rollout/groups_in_batch"]
        + m["rollout/filtered_all_correct"]
        + m["rollout/filtered_all_wrong"]
        + m["rollout/filtered_other"]
        + m["rollout/surplus"]
        + m["rollout/aborted"]
    )


class TickingClock:
    """A manager clock (``manager.clock``) whose every reading is a second later: the hang probe's
    interval of silence passes in a few loop turns, without waiting for it."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 1.0
        return self.t
