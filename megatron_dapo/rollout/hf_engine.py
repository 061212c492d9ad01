"""The CPU rollout engine (and small GPU runs): an HF transformers model sampled by our own loop.

Why our own loop and not ``model.generate``: we need (1) the log-probability of each sampled
token under exactly the distribution SGLang reports, (2) a seed per request, so a response does
not depend on which other requests share its batch, and (3) abort between decode steps. With
``generate`` the first needs ``output_scores`` post-processing that differs by logits-processor
order, the second is impossible (one global generator per call), the third needs a stopping
criteria hack; and (4) continuous batching with responses that do not depend on their batch
mates (``HFEngine``). The loop is a KV-cached decode over a fixed frame: each row's prompt is
prefilled once, then each step feeds one token per row in flight.

Sampling, per row (the order SGLang's sampler uses): ``z = logits / T``; the returned
log-prob is ``log_softmax(z)[token]`` over the full vocabulary, i.e. before top-k/top-p
truncation and renormalisation, which is what SGLang returns in ``output_token_logprobs``
(unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set, which reports the T=1 distribution;
renormalised values are a separate opt-in there, ``return_sampling_mask``). The token is then
drawn from the top-k/top-p-truncated, renormalised distribution by inverse CDF with one uniform
number from the request's own ``torch.Generator``. T=0 is greedy with the T=1 log-prob, as in
SGLang. The sampler works row by row, so a row's draw depends only on its own logits.

CPU/GPU difference: ``release_memory``/``resume_memory`` move the model to host memory and
back on CUDA and do nothing on CPU (there is no device memory to give back).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from megatron_dapo.rollout.engine import EngineError, OnResult
from megatron_dapo.rollout.types import GenerationRequest, GenerationResult

logger = logging.getLogger(__name__)
# prompts are prefilled right-padded to a multiple of this many tokens (HFEngine._prefill_width), and
# the logits of a prefill's last this-many positions are computed (each prompt ends among them)
_PREFILL_STEP = 16
# decode steps a queued row waits at most for others to join with it (HFEngine._admit_now)
_ADMIT_WAIT = 4
# seconds an idle engine's first queued row waits for others to start with it (HFEngine._admit_now)
_IDLE_GATHER_S = 0.01


class WeightLoadError(EngineError):
    """A bucket did not fit the model: unknown or missing names, or a shape mismatch."""


class HFEngine:
    """HF transformers engine with seeded, abortable sampling and continuous batching.

    Args:
        model_path: HF checkpoint directory (ignored when ``model`` is given).
        model: an already built ``*ForCausalLM`` module (tests, or a driver that shares one).
        name: engine name for logs and errors.
        device: "cpu" or a CUDA device.
        dtype: parameter dtype when loading from ``model_path``.
        max_batch_size: rows decoded together (the slots of the frame).
        seed: seed of the generator used by requests without their own seed.
        frame: tokens of one row's attention frame, at least the longest prompt plus response the
            engine will be sent (the driver passes ``data.max_prompt_length +
            data.max_response_length``). None: it grows to fit, in steps of 64 tokens.

    Continuous batching: every request is a row; rows wait in one queue (``generate`` calls and
    ``generate_apart``'s one-request calls alike) and join the decode at the next step that has a
    free slot, so an episode's turn sent while others decode does not wait for them to finish.
    Batch invariance: a row's numbers do not depend on which rows share its steps. Its prompt is
    prefilled right-padded to a width its own length sets (``_prefill_width``); every decode step
    attends over the same ``frame`` keys (its own, the rest masked); the linear layers compute each
    row alone (``tests/test_rollout_hf_engine.py`` checks that this machine's GEMM does). So a
    seeded response is bitwise the same alone, in a batch, and joining one mid-way, and a seeded
    run is reproducible however its episodes' turns meet in the engine. No thread of its own: the
    thread of one waiting call runs the steps until its own rows are answered, then hands over to
    another. A weight load waits for the rows in flight and no row starts while it waits.
    Prefix reuse: an episode's turn (``GenerationRequest.prefix_lengths``) restores the stored
    keys and values of its previous prompt and prefills only what it adds (``_segments``).
    ``stats``: ``prefills`` and ``steps`` count forwards, ``prefill_tokens`` the prompt tokens
    computed and ``reused_tokens`` those restored.

    A plain class, so a Ray driver can wrap it as an actor (``ray.remote(HFEngine)``).
    """

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        model: torch.nn.Module | None = None,
        name: str = "hf-0",
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = 64,
        seed: int = 0,
        record_routing: bool = False,
        frame: int | None = None,
    ):
        if model is None:
            if model_path is None:
                raise ValueError("HFEngine needs model_path or model")
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype)
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.name = name
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.max_batch_size = max_batch_size
        self.weight_version: int | None = 0
        self.stats = {
            "requests": 0,
            "tokens": 0,
            "aborted": 0,
            "busy_s": 0.0,
            "prefills": 0,
            "steps": 0,
            "prefill_tokens": 0,
            "reused_tokens": 0,
        }
        cfg = self.model.config
        self.eos_token_ids = _eos_ids(self.model)
        pad = getattr(cfg, "pad_token_id", None)
        self.pad_token_id = (
            int(pad) if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else 0)
        )
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        if frame is not None and frame < 1:
            raise ValueError(f"frame must be >= 1 tokens, got {frame}")
        self._frame = _Frame(self.device, None if frame is None else min(frame, self.max_positions))
        self._gemm_rows = _gemm_row_multiple(cfg, self.device)
        self._masks = _MaskBuilder(cfg)
        # episodes' prompts' keys and values for their next turns: as many tokens as the frame holds
        self._prefixes = _PrefixStore(lambda: self.max_batch_size * max(self._frame.width, 1))
        self._lock = threading.Lock()  # the model: a step or a weight load at a time
        self._cv = threading.Condition()  # the rows' queue and slots, and who runs the steps
        self._pending: deque[_Row] = deque()
        self._active: list[_Row] = []  # the rows in flight; row k sits in the frame's slot k
        self._serving = False  # a caller's thread is running the steps
        self._waiters: list[tuple[list[_Job], threading.Event]] = []  # callers not running them
        self._loads_waiting = 0  # weight loads waiting for the rows in flight to finish
        self._abort_epoch = 0
        self._rng = torch.Generator(device="cpu").manual_seed(seed)
        self._healthy = True
        # MoE routing replay: each result carries the experts every MoE layer chose per token.
        self._routing = _RoutingRecorder(self.model) if record_routing else None

    # -- generation --------------------------------------------------------------------

    def generate(
        self, requests: Sequence[GenerationRequest], on_result: OnResult | None = None
    ) -> list[GenerationResult]:
        """Sample one response per request, in request order (see the module doc for semantics);
        ``on_result`` gets each row's result at the step it stops. Concurrent calls share the
        decode (the class doc); the thread of one of them runs each step."""
        requests = list(requests)
        for r in requests:
            self._check_prompt(r)
        if not requests:
            return []
        job = _Job(requests, on_result, self._abort_epoch)
        self._serve([job])
        if job.error is not None:
            raise job.error
        return job.results

    def generate_apart(
        self, requests: Sequence[GenerationRequest], on_result: OnResult | None = None
    ) -> list[GenerationResult]:
        """Each request as a call of its own, all queued at once (what concurrent one-request
        calls would be, in one call): a Ray host takes episodes' later turns this way, so that
        they cross to it in one message; a failing row fails only its own call."""
        requests = list(requests)
        for r in requests:
            self._check_prompt(r)
        epoch = self._abort_epoch
        jobs = [_Job([r], on_result, epoch) for r in requests]
        self._serve(jobs)
        for job in jobs:
            if job.error is not None:
                raise job.error
        return [job.results[0] for job in jobs]

    def _serve(self, jobs: list[_Job]) -> None:
        """Queue ``jobs``' rows and return once they are answered; while no other caller's thread
        runs the steps, this one does (until its own rows are answered, then it hands over to one
        waiting caller). A waiting caller sleeps on its own event, set when its rows are answered
        or the steps are handed to it: a step wakes no one whose rows did not end in it (hundreds
        of episodes' turns may wait at once)."""
        wake = threading.Event()
        entry = (jobs, wake)
        with self._cv:
            for job in jobs:
                job.wake = wake
                self._pending.extend(_Row(job, i) for i in range(len(job.requests)))
            self._waiters.append(entry)
            self._cv.notify_all()  # a serving thread idle in _step
        while True:
            with self._cv:
                if all(j.done for j in jobs):
                    self._waiters.remove(entry)
                    return
                if not self._serving:
                    self._serving = True
                    self._waiters.remove(entry)
                    break
                wake.clear()
            wake.wait()
        try:
            while not all(j.done for j in jobs):
                self._step()
        finally:
            with self._cv:
                self._serving = False
                for waiting, their_wake in self._waiters:
                    if not all(j.done for j in waiting):
                        their_wake.set()
                        break

    def abort(self) -> None:
        """Stop the rows in flight at their next step (rows still queued too)."""
        self._abort_epoch += 1

    def _check_prompt(self, r: GenerationRequest) -> None:
        if not r.prompt_ids:
            raise ValueError(f"request {r.request_id}: empty prompt_ids")
        if len(r.prompt_ids) >= self.max_positions:
            raise ValueError(
                f"request {r.request_id}: prompt of {len(r.prompt_ids)} tokens does not fit the model's "
                f"max_position_embeddings={self.max_positions}"
            )
        cuts = list(r.prefix_lengths or ())
        if any(not 0 < c < len(r.prompt_ids) for c in cuts) or cuts != sorted(set(cuts)):
            raise ValueError(
                f"request {r.request_id}: prefix_lengths {cuts} must rise strictly within (0, "
                f"{len(r.prompt_ids)}), the lengths of the episode's earlier prompts"
            )

    def _step(self) -> None:
        """Answer the rows an abort reached, let queued rows into free slots, then one forward
        for them (their prompts) and one for every row in flight (its next token)."""
        with self._cv:
            self._drop_aborted()
            if self._loads_waiting and not self._active:
                self._cv.wait()  # a weight load takes the model between rows
                return
            joining = []
            if not self._loads_waiting and self._admit_now():
                free = self.max_batch_size - len(self._active)
                while self._pending and len(joining) < free:
                    joining.append(self._pending.popleft())
            for row in self._pending:
                row.waited += 1
            if not joining and not self._active:
                # nothing to decode: this caller's rows were just answered, or queued ones gather
                gathering = (
                    _IDLE_GATHER_S - (time.monotonic() - self._pending[0].queued_at) if self._pending else 0.1
                )
                self._cv.wait(timeout=min(max(gathering, 0.0), 0.1))
                return
        with self._lock:
            t0 = time.perf_counter()
            try:
                self._advance(joining)
            except BaseException as e:  # every row in flight fails with it: its call raises
                with self._cv:
                    for row in self._active + joining:
                        row.job.fail(e)
                    self._active = []
                    self._cv.notify_all()
                return
            finally:
                self.stats["busy_s"] += time.perf_counter() - t0

    def _admit_now(self) -> bool:
        """Whether queued rows join at this step: when nothing decodes, once the first has waited
        ``_IDLE_GATHER_S``; else when they are a quarter of the rows decoding, or once the first
        has waited ``_ADMIT_WAIT`` steps. A prefill is a forward of its own, whose fixed cost on a
        CPU is a decode step's: turns that come in one by one join a few at a time rather than one
        prefill each (an idle engine that started at the first of a round's second turns ran
        small steps while the rest came in: 51.2 s busy over a calculator demo against 43.5 s).
        Which step a row joins changes no number of it (the class doc), only when it is answered."""
        if not self._pending:
            return False
        n = len(self._active)
        if n == 0:
            return time.monotonic() - self._pending[0].queued_at >= _IDLE_GATHER_S
        return 4 * len(self._pending) >= n or self._pending[0].waited >= _ADMIT_WAIT

    def _drop_aborted(self) -> None:
        """Under ``_cv``: rows of calls made before the last abort are answered "abort" with what
        they sampled (queued ones with nothing) and leave their slots."""
        epoch = self._abort_epoch
        stale = [r for r in self._pending if r.job.epoch != epoch]
        for row in stale:
            self._pending.remove(row)
            row.job.answer(row.index, self._aborted(row.request, [], []))
        stale = [r for r in self._active if r.job.epoch != epoch]
        for row in stale:
            row.job.answer(row.index, self._aborted(row.request, row.out_ids, row.out_lps))
        self._release(stale)

    def _release(self, rows: list[_Row]) -> None:
        """``rows`` leave their slots; rows in flight from past the new end move into the slots
        left below it (rows stay in slots 0..n-1, so a step's keys are a view of the frame), all
        in one copy per layer: a step may end hundreds of rows."""
        if not rows:
            return
        leaving = {id(r) for r in rows}
        n = len(self._active) - len(leaving)
        holes = [k for k, r in enumerate(self._active[:n]) if id(r) in leaving]
        movers = [k for k in range(n, len(self._active)) if id(self._active[k]) not in leaving]
        self._frame.move(movers, holes)
        for src, dst in zip(movers, holes):
            self._active[dst] = self._active[src]
        del self._active[n:]
        if not self._active and self._loads_waiting:
            self._cv.notify_all()  # a weight load waits for the rows in flight

    @torch.no_grad()
    def _advance(self, joining: list[_Row]) -> None:
        """Under the model lock: the joining rows' prompts, then one decode step for all rows
        (unless an abort came meanwhile: the next step answers them)."""
        epoch = self._abort_epoch
        if joining:
            for row in joining:
                row.start(self.eos_token_ids)
            need = max(row.frame_tokens(self.max_positions) for row in self._active + joining)
            self._active += joining
            self._frame.fit(len(self._active), need)
            for row in joining:
                row.segments = self._segments(row)
            # a row's segments go one forward each, in order; rows whose next segment has the same
            # kind and width share a forward
            while True:
                groups: dict[tuple[bool, int], list[_Row]] = {}
                for row in joining:
                    if row.segments:
                        start, end = row.segments[0]
                        groups.setdefault((start > 0, self._prefill_width(end - start)), []).append(row)
                if not groups:
                    break
                for (extend, width), rows in groups.items():
                    self._prefill(rows, width, extend)
        live = list(self._active)
        if not live or self._abort_epoch != epoch:
            return
        n = len(live)
        padded = self._rows_for(n, 1)
        self._frame.fit(padded, 0)
        # rows past n are fillers (the pad token at position 0 of a free slot): GEMMs then see a
        # row count whose per-row results do not depend on it (see _gemm_row_multiple)
        feed = torch.tensor(
            [[r.out_ids[-1]] for r in live] + [[self.pad_token_id]] * (padded - n),
            dtype=torch.long,
            device=self.device,
        )
        pos = torch.tensor(
            [r.position() for r in live] + [0] * (padded - n), dtype=torch.long, device=self.device
        )
        self._frame.decoding(padded, pos)
        if self._routing:
            self._routing.start()
        out = self.model(
            input_ids=feed,
            position_ids=pos[:, None],
            attention_mask=self._masks.decode(pos[:, None], self._frame.width),
            cache=self._frame,
            use_cache=True,
            logits_to_keep=1,
        )
        self.stats["steps"] += 1
        if self._routing:
            self._routing.decode([r.routed for r in live], padded)
        self._sampled(live, out.logits[:n, -1, :].float())

    def _rows_for(self, rows: int, length: int) -> int:
        """The rows a forward runs so that its GEMMs' row count (rows x length tokens) is a
        multiple of ``_gemm_rows``: ``rows`` and fillers."""
        step = self._gemm_rows // math.gcd(self._gemm_rows, length)
        return -(-rows // step) * step

    def _prefill_width(self, length: int) -> int:
        """The tokens a prompt of ``length`` is prefilled in: its length rounded up to a multiple
        of ``_PREFILL_STEP``, padded on the right. It depends on the prompt alone, so the prompt
        gets the same numbers whichever prompts share its forward, and prompts of one width
        share one."""
        return min(-(-length // _PREFILL_STEP) * _PREFILL_STEP, self.max_positions)

    def _segments(self, row: _Row) -> list[tuple[int, int]]:
        """The spans of ``row``'s prompt still to compute, in order. An episode's turn
        (``prefix_lengths``) is computed in segments split at its earlier prompts' lengths: the
        first prefilled alone, each later one attending to the frame (``_prefill``). So its numbers
        are the same whether the keys and values of an earlier prompt come from the store or are
        computed again here (a miss: evicted, another engine, a weight load between), and the
        longest stored prefix is restored into the row's slot instead of computed."""
        prompt = row.request.prompt_ids
        cuts = list(row.request.prefix_lengths or ())
        start = 0
        for j in range(len(cuts) - 1, -1, -1):
            entry = self._prefixes.take(prompt[: cuts[j]], cuts[:j])
            if entry is not None:
                kv, routed = entry
                self._frame.restore(self._active.index(row), kv)
                if routed is not None:
                    row.routed = [routed]
                start = cuts[j]
                self.stats["reused_tokens"] += start
                break
        bounds = [start] + [c for c in cuts if c > start] + [len(prompt)]
        return list(zip(bounds, bounds[1:]))

    def _prefill(self, rows: list[_Row], width: int, extend: bool) -> None:
        """The next segment of each of ``rows``, right-padded to ``width`` tokens, written to their
        slots; the rows whose prompt it completes draw their first token (and an episode's turn
        keeps its prompt's keys and values for the next turn). A first segment attends to itself
        alone; a later one (``extend``) to its row's frame, which holds the prompt before it.
        Filler rows (pad tokens, free slots) round the token count up."""
        slot_of = {id(r): k for k, r in enumerate(self._active)}
        padded = self._rows_for(len(rows), width)
        free = len(self._active)
        self._frame.fit(free + padded - len(rows), 0)
        slots = [slot_of[id(r)] for r in rows] + list(range(free, free + padded - len(rows)))
        spans = [row.segments.pop(0) for row in rows]
        prompts = [r.request.prompt_ids for r in rows]
        feed = [p[s:e] + [self.pad_token_id] * (width - (e - s)) for p, (s, e) in zip(prompts, spans)]
        feed += [[self.pad_token_id] * width] * (padded - len(rows))
        ids = torch.tensor(feed, dtype=torch.long, device=self.device)
        starts = torch.tensor([s for s, _ in spans] + [0] * (padded - len(rows)), device=self.device)
        positions = starts[:, None] + torch.arange(width, device=self.device)[None, :]
        if extend:
            self._frame.extending(slots, positions)
            mask = self._masks.decode(positions, self._frame.width)
        else:
            self._frame.prefilling(slots)
            mask = self._masks.prefill(padded, width, self.device)
        if self._routing:
            self._routing.start()
        keep = min(_PREFILL_STEP, width)  # a fixed count: the head's GEMM rows stay a multiple
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,
            cache=self._frame,
            use_cache=True,
            logits_to_keep=keep,
        )
        self.stats["prefills"] += 1
        self.stats["prefill_tokens"] += sum(e - s for s, e in spans)
        if self._routing:
            for row, experts, (s, e) in zip(rows, self._routing.prefill(padded), spans):
                row.routed = (row.routed or []) + [experts[0][: e - s]]
        complete = [b for b, row in enumerate(rows) if not row.segments]
        if not complete:
            return
        for b in complete:
            row = rows[b]
            if row.request.prefix_lengths is not None and not self._prefixes.has(
                row.request.prompt_ids, row.request.prefix_lengths
            ):  # a group's samples send one prompt
                routed = None if row.routed is None else torch.cat(row.routed)
                kv = self._frame.save(slots[b], len(row.request.prompt_ids))
                self._prefixes.put(row.request.prompt_ids, row.request.prefix_lengths, kv, routed)
        last = torch.tensor(
            [spans[b][1] - spans[b][0] - 1 - (width - keep) for b in complete], device=self.device
        )
        picked = torch.tensor(complete, device=self.device)
        self._sampled([rows[b] for b in complete], out.logits[picked, last, :].float())

    def _sampled(self, rows: list[_Row], logits: torch.Tensor) -> None:
        """Draw each row's next token; a row that stops is answered (``on_result`` at once) and
        leaves its slot."""
        vocab = logits.shape[-1]
        tokens, lps = _sample(
            logits,
            torch.tensor(
                [r.request.sampling.temperature for r in rows], device=self.device, dtype=torch.float32
            ),
            torch.tensor([r.top_k(vocab) for r in rows], device=self.device),
            torch.tensor([r.request.sampling.top_p for r in rows], device=self.device, dtype=torch.float32),
            [r.gen for r in rows],
            self._rng,
        )
        done = []
        for row, tok, lp in zip(rows, tokens.tolist(), lps.tolist()):
            row.out_ids.append(tok)
            row.out_lps.append(lp)
            finish = row.finish_after(tok, self.max_positions)
            if finish is not None:
                result = self._finished(row, finish)
                if row.job.on_result is not None:
                    row.job.on_result(result)
                done.append((row, result))
        if done:
            with self._cv:
                for row, result in done:
                    row.job.answer(row.index, result)
                self._release([row for row, _ in done])

    def _finished(self, row: _Row, finish: str) -> GenerationResult:
        self.stats["requests"] += 1
        self.stats["tokens"] += len(row.out_ids)
        return GenerationResult(
            row.request.request_id,
            list(row.out_ids),
            list(row.out_lps),
            finish,
            self.weight_version,
            routed_experts=None if row.routed is None else torch.cat(row.routed),
        )

    def _aborted(self, r: GenerationRequest, ids: list[int], lps: list[float]) -> GenerationResult:
        self.stats["aborted"] += 1
        return GenerationResult(r.request_id, list(ids), list(lps), "abort", self.weight_version)

    # -- weights -------------------------------------------------------------------------

    def load_weights(self, buckets: Iterable[dict[str, torch.Tensor]], version: int) -> None:
        """Copy HF-named tensors into the model by name, strictly.

        Every parameter (and persistent buffer) must be given exactly once over all buckets,
        under its HF name; tied weights (``lm_head.weight`` tied to ``model.embed_tokens.weight``)
        may be given under either name. An unknown name, a wrong shape or a missing tensor
        raises :class:`WeightLoadError` naming it; the engine then reports unhealthy until a
        complete load succeeds, since its weights are a mix of two versions.
        """
        with self._between_rows():
            self._healthy = False
            self.weight_version = None
            self._prefixes.clear()  # computed by the weights being replaced
            targets, canonical = self._weight_targets()
            covered: set[str] = set()
            with torch.no_grad():
                for index, bucket in enumerate(buckets):
                    for name, tensor in bucket.items():
                        target = targets.get(name)
                        if target is None:
                            raise WeightLoadError(
                                f"engine {self.name}: bucket {index} has tensor {name!r} that the model does not "
                                f"have (model names look like {sorted(targets)[:3]}); check the HF name map"
                            )
                        if tuple(tensor.shape) != tuple(target.shape):
                            raise WeightLoadError(
                                f"engine {self.name}: bucket {index} tensor {name!r} has shape "
                                f"{tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
                            )
                        target.copy_(tensor.to(device=target.device, dtype=target.dtype))
                        covered.add(canonical[name])
            missing = sorted(set(canonical.values()) - covered)
            if missing:
                raise WeightLoadError(
                    f"engine {self.name}: weight update v{version} lacks {len(missing)} tensors, e.g. "
                    f"{missing[:5]}; the sender must send every parameter"
                )
            self.weight_version = version
            self._healthy = True

    @contextmanager
    def _between_rows(self):
        """The model, once the rows in flight are answered; no row starts until it is handed back
        (a response is sampled by one version of the weights)."""
        with self._cv:
            self._loads_waiting += 1
            while self._active:
                self._cv.wait()
        try:
            with self._lock:
                yield
        finally:
            with self._cv:
                self._loads_waiting -= 1
                self._cv.notify_all()

    def load_from_disk(self, path: str | Path, version: int) -> bool:
        """Load every ``*.safetensors`` file of an HF checkpoint directory (one bucket per file)."""
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise WeightLoadError(f"engine {self.name}: no *.safetensors files in {path}")
        self.load_weights((load_file(str(f)) for f in files), version)
        return True

    def _weight_targets(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """name -> tensor for every parameter name (tied aliases included), and name -> canonical name."""
        targets: dict[str, torch.Tensor] = {}
        canonical: dict[str, str] = {}
        first_name: dict[int, str] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            experts = _per_expert_views(name, p.data)
            if experts:
                targets.update(experts)
                canonical.update({k: k for k in experts})
                continue
            targets[name] = p.data
            canonical[name] = first_name.setdefault(id(p), name)
        persistent = set(self.model.state_dict(keep_vars=True))
        for name, buf in self.model.named_buffers():
            if name in persistent:
                targets[name] = buf
                canonical[name] = name
        return targets, canonical

    # -- memory / health -----------------------------------------------------------------

    def release_memory(self) -> None:
        """CUDA: move the model to host memory; CPU: nothing to release."""
        if self.device.type == "cuda":
            with self._between_rows():
                self._prefixes.clear()
                self.model.to("cpu")
                torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        """CUDA: move the model back to its device; CPU: nothing to do."""
        if self.device.type == "cuda":
            with self._between_rows():
                self.model.to(self.device)

    def health(self, check_process: bool = True) -> bool:
        """Whether it serves (in process: there is no separate process to check)."""
        return self._healthy


class _Job:
    """One ``generate`` call: its requests, the abort epoch it was made in, its results so far."""

    def __init__(self, requests: list[GenerationRequest], on_result: OnResult | None, epoch: int):
        self.requests, self.on_result, self.epoch = requests, on_result, epoch
        self.results: list[GenerationResult | None] = [None] * len(requests)
        self.left = len(requests)
        self.error: BaseException | None = None
        self.wake: threading.Event | None = None  # its caller's, set once it is answered

    @property
    def done(self) -> bool:
        return self.left == 0 or self.error is not None

    def answer(self, i: int, result: GenerationResult) -> None:
        self.results[i] = result
        self.left -= 1
        if self.left == 0 and self.wake is not None:
            self.wake.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        if self.wake is not None:
            self.wake.set()


class _Row:
    """One request being decoded: what it sampled so far, its own generator and stop ids."""

    def __init__(self, job: _Job, index: int):
        self.job, self.index = job, index
        self.request = job.requests[index]
        self.out_ids: list[int] = []
        self.out_lps: list[float] = []
        self.gen: torch.Generator | None = None
        self.stops: set[int] = set()
        self.routed: list[torch.Tensor] | None = None
        self.waited = 0  # steps it spent queued while rows decoded
        self.queued_at = time.monotonic()
        self.segments: list[tuple[int, int]] = []  # spans of its prompt still to compute

    def start(self, eos_token_ids: list[int]) -> None:
        s = self.request.sampling
        self.gen = _request_generator(s)
        self.stops = set(s.stop_token_ids) | (set() if s.ignore_eos else set(eos_token_ids))

    def top_k(self, vocab: int) -> int:
        k = self.request.sampling.top_k
        return vocab if k in (-1, None) else min(k, vocab)

    def position(self) -> int:
        """The frame position of the token fed next (the last one sampled)."""
        return len(self.request.prompt_ids) + len(self.out_ids) - 1

    def frame_tokens(self, max_positions: int) -> int:
        """Frame positions it uses: its prompt and every sampled token but the last (never fed)."""
        n = len(self.request.prompt_ids)
        return min(n + max(self.request.sampling.max_new_tokens - 1, 0), max_positions) or 1

    def finish_after(self, token: int, max_positions: int) -> str | None:
        if token in self.stops:
            return "stop"
        n = len(self.out_ids)
        if n >= self.request.sampling.max_new_tokens or len(self.request.prompt_ids) + n >= max_positions:
            return "length"
        return None


class _Frame:
    """The keys and values of the rows in flight, per layer ``[slots, kv_heads, width, head_dim]``,
    row k in slot k; the model calls ``update`` as its KV cache. A prefill writes its rows' prompt
    keys and attends to them alone; a decode step writes each row's new key at its position and
    attends to the whole frame (``_MaskBuilder`` hides what is not the row's), so every step of
    every row has the same shape whoever shares it."""

    def __init__(self, device: torch.device, width: int | None):
        self.device = device
        self.fixed = width is not None
        self.width = width or 0
        self.slots = 0
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self._prefill_slots: torch.Tensor | None = None
        self._decode: tuple[int, torch.Tensor] | None = None
        self._extend: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def fit(self, rows: int, width: int) -> None:
        """Room for ``rows`` rows of ``width`` positions (grown: slots to a power of two, width
        to a multiple of 64; a grown width changes later rows' rounding, hence ``frame``)."""
        if width > self.width:
            if self.fixed:
                logger.warning(
                    "HF engine: a request needs %d frame positions, more than the %d it was given; the frame "
                    "grows (rows decoded after this differ from before it in float rounding)",
                    width,
                    self.width,
                )
                self.fixed = False
            self.width = -(-width // 64) * 64
        if rows > self.slots:
            self.slots = 1 << (rows - 1).bit_length()
        for store in (self.keys, self.values):
            for layer, t in store.items():
                if t.shape[0] < self.slots or t.shape[2] < self.width:
                    grown = t.new_zeros((self.slots, t.shape[1], self.width, t.shape[3]))
                    grown[: t.shape[0], :, : t.shape[2]] = t
                    store[layer] = grown

    def move(self, src: list[int], dst: list[int]) -> None:
        """Slots ``src`` copied into slots ``dst`` (none of them among ``src``)."""
        if not src:
            return
        src_index = torch.tensor(src, dtype=torch.long, device=self.device)
        dst_index = torch.tensor(dst, dtype=torch.long, device=self.device)
        for store in (self.keys, self.values):
            for t in store.values():
                t[dst_index] = t[src_index]

    def prefilling(self, slots: list[int]) -> None:
        self._prefill_slots = torch.tensor(slots, dtype=torch.long, device=self.device)
        self._decode = self._extend = None

    def decoding(self, rows: int, positions: torch.Tensor) -> None:
        self._decode = (rows, positions)
        self._prefill_slots = self._extend = None

    def extending(self, slots: list[int], positions: torch.Tensor) -> None:
        """A later prompt segment: rows in ``slots`` at ``positions`` ``[rows, tokens]`` (its
        padding's positions past the frame are not written; no query of the prompt reads them)."""
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        inside = positions < self.width
        self._extend = (index, index[:, None].expand_as(positions)[inside], positions[inside], inside)
        self._prefill_slots = self._decode = None

    def save(self, slot: int, n: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """A copy of the keys and values of ``slot``'s first ``n`` positions, by layer."""
        return {
            layer: (self.keys[layer][slot, :, :n].clone(), self.values[layer][slot, :, :n].clone())
            for layer in self.keys
        }

    def restore(self, slot: int, kv: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write what ``save`` copied into ``slot``'s first positions."""
        for layer, (k, v) in kv.items():
            self.keys[layer][slot, :, : k.shape[1]] = k
            self.values[layer][slot, :, : v.shape[1]] = v

    def _buffers(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self.keys:
            shape = (self.slots, like.shape[1], self.width, like.shape[3])
            self.keys[layer] = like.new_zeros(shape)
            self.values[layer] = like.new_zeros(shape)
        return self.keys[layer], self.values[layer]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self._buffers(layer_idx, key_states)
        if self._prefill_slots is not None:
            # a prompt's keys past the frame are padding (the frame holds every prompt)
            n = min(key_states.shape[2], self.width)
            keys[self._prefill_slots, :, :n] = key_states[:, :, :n]
            values[self._prefill_slots, :, :n] = value_states[:, :, :n]
            return key_states, value_states
        if self._extend is not None:
            index, rows, positions, inside = self._extend
            keys[rows, :, positions] = key_states.transpose(1, 2)[inside]
            values[rows, :, positions] = value_states.transpose(1, 2)[inside]
            return keys[index], values[index]
        rows, positions = self._decode
        index = torch.arange(rows, device=self.device)
        keys[index, :, positions] = key_states[:, :, 0]
        values[index, :, positions] = value_states[:, :, 0]
        return keys[:rows], values[:rows]


class _PrefixStore:
    """Episodes' prompts' keys and values (and routed experts), kept for their next turns, least
    recently used first out past ``capacity()`` tokens. Keyed by the prompt's ids and the lengths
    it was split at, which fix its numbers (``HFEngine._segments``): a group's episodes share
    their first prompt's entry, so a turn that finds one leaves it for its group mates. Cleared on
    a weight load."""

    def __init__(self, capacity):
        self.capacity = capacity
        self._entries: OrderedDict[tuple, tuple[dict, torch.Tensor | None, int]] = OrderedDict()
        self._tokens = 0

    def put(self, prompt: list[int], cuts: Sequence[int], kv: dict, routed: torch.Tensor | None) -> None:
        key = (tuple(prompt), tuple(cuts))
        self._drop(key)
        self._entries[key] = (kv, routed, len(prompt))
        self._tokens += len(prompt)
        while self._tokens > self.capacity() and self._entries:
            self._drop(next(iter(self._entries)))

    def has(self, prompt: list[int], cuts: Sequence[int]) -> bool:
        return (tuple(prompt), tuple(cuts)) in self._entries

    def take(self, prompt: list[int], cuts: Sequence[int]) -> tuple[dict, torch.Tensor | None] | None:
        key = (tuple(prompt), tuple(cuts))
        if key not in self._entries:
            return None
        self._entries.move_to_end(key)
        kv, routed, _ = self._entries[key]
        return kv, routed

    def _drop(self, key: tuple) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._tokens -= entry[2]

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0


class _MaskBuilder:
    """The attention masks of a prefill (causal over the prompt) and of a decode step (the row's
    frame positions up to its own), in the form the model's attention takes: boolean for sdpa,
    additive for eager; a dict by layer type for a model with sliding-window layers."""

    def __init__(self, config):
        self.impl = getattr(config, "_attn_implementation", None) or "eager"
        if self.impl not in ("sdpa", "eager"):
            raise ValueError(
                f"the HF engine runs attn_implementation 'sdpa' or 'eager', the model has {self.impl!r}; "
                "load it with attn_implementation='sdpa'"
            )
        types = set(getattr(config, "layer_types", None) or ["full_attention"])
        self.window = getattr(config, "sliding_window", None) if "sliding_attention" in types else None
        self.types = sorted(types)

    def _form(self, allowed: torch.Tensor, dtype: torch.dtype):
        if self.impl == "eager":
            return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
                ~allowed, torch.finfo(dtype).min
            )
        return allowed

    def _by_type(self, full: torch.Tensor, distance: torch.Tensor, dtype: torch.dtype):
        if self.window is None:
            return self._form(full, dtype)
        return {
            "full_attention": self._form(full, dtype),
            "sliding_attention": self._form(full & (distance < self.window), dtype),
        }

    def prefill(self, rows: int, length: int, device: torch.device, dtype=torch.float32):
        q = torch.arange(length, device=device)
        distance = q[:, None] - q[None, :]
        causal = (distance >= 0)[None, None].expand(rows, 1, length, length)
        return self._by_type(causal, distance[None, None], dtype)

    def decode(self, positions: torch.Tensor, width: int, dtype=torch.float32):
        """Queries at ``positions`` ``[rows, tokens]`` over a frame of ``width`` keys: each its row's
        keys up to its own position (a decode step's one token, or a later prompt segment)."""
        keys = torch.arange(width, device=positions.device)
        distance = (positions[:, :, None] - keys[None, None, :])[:, None]
        return self._by_type(distance >= 0, distance, dtype)


def _per_expert_views(name: str, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-expert HF names -> views of transformers' fused expert tensors (empty for any other
    parameter). transformers 5 keeps a MoE layer's experts as ``experts.gate_up_proj``
    ``[E, 2I, H]`` (each expert's gate rows, then its up rows) and ``experts.down_proj``
    ``[E, H, I]``, and converts checkpoints' ``experts.{e}.gate_proj.weight`` names on load and
    save; the weight sync sends those checkpoint names."""
    prefix, _, leaf = name.rpartition(".experts.")
    if not prefix or param.dim() != 3 or leaf not in ("gate_up_proj", "down_proj"):
        return {}
    base = f"{prefix}.experts"
    if leaf == "down_proj":
        return {f"{base}.{e}.down_proj.weight": param[e] for e in range(param.shape[0])}
    half = param.shape[1] // 2
    out = {}
    for e in range(param.shape[0]):
        out[f"{base}.{e}.gate_proj.weight"] = param[e, :half]
        out[f"{base}.{e}.up_proj.weight"] = param[e, half:]
    return out


class _RoutingRecorder:
    """The top-k experts of every MoE layer per forwarded token, from the logits each router
    module returns (the module transformers itself records ``router_logits`` from: output 0 of
    the model's ``TopKRouter``; one ``[tokens, experts]`` tensor per layer, tokens flattened
    batch-major). Top-k of the logits is top-k of their softmax, the choice the HF MoE block
    makes. Hooks rather than ``output_router_logits``: with that flag the model also computes its
    load-balancing loss, which fails on a KV-cached decode step under an attention mask."""

    def __init__(self, model):
        self.k = int(getattr(model.config, "num_experts_per_tok", 0) or 0)
        routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
        if not self.k or not routers:
            raise ValueError(
                f"record_routing needs a mixture-of-experts model with TopKRouter modules; "
                f"{type(model).__name__} has none"
            )
        self._logits: list[torch.Tensor] = []
        for router in routers:  # module order is layer order
            router.register_forward_hook(lambda _m, _args, out: self._logits.append(out[0].detach()))

    def _topk(self, rows: int) -> torch.Tensor:
        """``[rows, tokens, layers, k]`` int16 experts of the forward just run."""
        per_layer = [lg.reshape(rows, -1, lg.shape[-1]).topk(self.k, dim=-1).indices for lg in self._logits]
        self._logits.clear()
        return torch.stack(per_layer, dim=2).to(torch.int16).cpu()

    def start(self) -> None:
        self._logits.clear()

    def prefill(self, rows: int) -> list[list[torch.Tensor]]:
        """A prefill's experts per row (its rows are unpadded prompts of one length; fillers last)."""
        experts = self._topk(rows)
        return [[experts[b]] for b in range(rows)]

    def decode(self, routed: list[list[torch.Tensor]], rows: int) -> None:
        """One decode step's experts (of its ``rows``, fillers last), appended to each row's."""
        experts = self._topk(rows)
        for b, row in enumerate(routed):
            row.append(experts[b])


def _gemm_row_multiple(config, device: torch.device) -> int:
    """The least row count whose multiples this machine's GEMM computes row by row alike.

    A BLAS computes the rows of ``x @ W.T`` in blocks; a block short of rows (the tail of a
    thread's share) goes through another kernel, which rounds differently (measured: oneMKL on
    AVX-512, rows of a 1-3 row tail differ in the last bits, every multiple of 4 rows agrees). So a
    forward whose token count is a multiple of this number gives each row the numbers it gets in
    any other such forward. Probed on random weights of the model's hidden sizes; none found (a GPU
    BLAS that splits the reduction by shape): 1, and rows are then equal only up to rounding."""
    hidden = int(getattr(config, "hidden_size", 64))
    inner = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    gen = torch.Generator(device="cpu").manual_seed(0)
    shapes = [(hidden, hidden), (hidden, inner), (inner, hidden)]
    weights = [torch.randn(n, k, generator=gen).to(device) for k, n in shapes]
    x = [torch.randn(192, k, generator=gen).to(device) for k, _ in shapes]
    whole = [torch.nn.functional.linear(a, w) for a, w in zip(x, weights)]
    for step in (4, 8, 16, 32, 64):
        if all(
            torch.equal(torch.nn.functional.linear(a[:m], w), y[:m])
            for a, w, y in zip(x, weights, whole)
            for m in (step, 2 * step, 3 * step)
            if m <= 192
        ):
            return step
    logger.warning(
        "HF engine: no row multiple makes this device's GEMM batch invariant; responses "
        "depend on their batch mates in float rounding"
    )
    return 1


def _eos_ids(model) -> list[int]:
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    return []


def _request_generator(sampling) -> torch.Generator | None:
    """The request's own generator, past the ``seed_offset`` draws an earlier, aborted call of the
    same response spent (one uniform per sampled token, see ``_sample``), so a continuation draws
    what the uninterrupted request would have."""
    if sampling.seed is None:
        return None
    gen = torch.Generator(device="cpu").manual_seed(int(sampling.seed))
    if sampling.seed_offset:
        torch.rand(sampling.seed_offset, generator=gen)
    return gen


def _sample(
    logits: torch.Tensor,
    temps: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    gens: list[torch.Generator | None],
    default_gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; returns (tokens, log-probs under log_softmax(logits / T))."""
    greedy = temps <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    probs_sorted, order = torch.sort(logp.exp(), dim=-1, descending=True, stable=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    # SGLang's truncation: drop tokens whose preceding mass already exceeds top_p, and ranks >= top_k
    drop = ((probs_sorted.cumsum(-1) - probs_sorted) > top_ps[:, None]) | (ranks >= top_ks[:, None])
    kept = probs_sorted.masked_fill(drop, 0.0)
    cdf = kept.cumsum(-1)
    u = torch.stack([torch.rand((), generator=g if g is not None else default_gen) for g in gens]).to(
        logits.device
    )
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)
    last_kept = (~drop).sum(-1) - 1
    pick = torch.minimum(pick, last_kept)
    tokens = order.gather(-1, pick[:, None]).squeeze(-1)
    tokens = torch.where(greedy, logits.argmax(-1), tokens)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
