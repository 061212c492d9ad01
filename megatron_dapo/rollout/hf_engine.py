"""The CPU rollout engine (and small GPU runs): an HF transformers model sampled by our own loop.

Why our own loop and not ``model.generate``: we need (1) the log-probability of each sampled
token under exactly the distribution SGLang reports, (2) a seed per request, so a response does
not depend on which other requests share its batch, and (3) abort between decode steps. With
``generate`` the first needs ``output_scores`` post-processing that differs by logits-processor
order, the second is impossible (one global generator per call), the third needs a stopping
criteria hack. The loop is a plain KV-cached decode: prefill the left-padded batch once, then
feed one token per row per step.

Sampling, per row (the order SGLang's sampler uses): ``z = logits / T``; the returned
log-prob is ``log_softmax(z)[token]`` over the full vocabulary, i.e. before top-k/top-p
truncation and renormalisation, which is what SGLang returns in ``output_token_logprobs``
(unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set, which reports the T=1 distribution;
renormalised values are a separate opt-in there, ``return_sampling_mask``). The token is then
drawn from the top-k/top-p-truncated, renormalised distribution by inverse CDF with one uniform
number from the request's own ``torch.Generator``. T=0 is greedy with the T=1 log-prob, as in
SGLang. Responses are independent of batch composition up to float rounding of the batched
forward (a different batch can flip a draw only when a uniform lands within ~1e-7 of a CDF
step).

CPU/GPU difference: ``release_memory``/``resume_memory`` move the model to host memory and
back on CUDA and do nothing on CPU (there is no device memory to give back).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from megatron_dapo.rollout.engine import EngineError, OnResult
from megatron_dapo.rollout.types import GenerationRequest, GenerationResult

logger = logging.getLogger(__name__)


class WeightLoadError(EngineError):
    """A bucket did not fit the model: unknown or missing names, or a shape mismatch."""


class HFEngine:
    """HF transformers engine with batched, seeded, abortable sampling.

    Args:
        model_path: HF checkpoint directory (ignored when ``model`` is given).
        model: an already built ``*ForCausalLM`` module (tests, or a driver that shares one).
        name: engine name for logs and errors.
        device: "cpu" or a CUDA device.
        dtype: parameter dtype when loading from ``model_path``.
        max_batch_size: requests decoded together; larger calls are split.
        seed: seed of the generator used by requests without their own seed.

    A dynamic batcher: concurrent ``generate`` calls wait in one queue, and each decode batch
    takes what is pending when it starts. A call of several requests (a unit of the rollout
    manager: a single-turn call, an episode call's first turns) is decoded alone,
    ``max_batch_size`` requests at a time, in order, as it would be with no other call in flight,
    so its responses never depend on timing. Calls of one request each (an episode's later turns,
    sent as its tool answers arrive) pending at a batch's start are decoded together, up to
    ``max_batch_size``. No thread of its own: the thread of one waiting call runs the batches
    until its own call is answered, then hands over to another. Weight loads take the model
    between batches. ``stats["batches"]`` counts the decode batches run.

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
        self.stats = {"requests": 0, "tokens": 0, "aborted": 0, "busy_s": 0.0, "batches": 0}
        cfg = self.model.config
        self.eos_token_ids = _eos_ids(self.model)
        pad = getattr(cfg, "pad_token_id", None)
        self.pad_token_id = (
            int(pad) if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else 0)
        )
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        self._lock = threading.Lock()  # the model: a decode batch or a weight load at a time
        self._cv = threading.Condition()  # the calls waiting for a batch, and who runs batches
        self._pending: deque[_Job] = deque()
        self._serving = False  # a caller's thread is running batches
        self._abort_epoch = 0
        self._rng = torch.Generator(device="cpu").manual_seed(seed)
        self._healthy = True
        # transformers 5.x renamed the KV-cache argument `past_key_values` -> `cache`
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_args else "past_key_values"
        # MoE routing replay: each result carries the experts every MoE layer chose per token.
        self._routing = _RoutingRecorder(self.model) if record_routing else None

    # -- generation --------------------------------------------------------------------

    def generate(
        self, requests: Sequence[GenerationRequest], on_result: OnResult | None = None
    ) -> list[GenerationResult]:
        """Sample one response per request, in request order (see the module doc for semantics);
        ``on_result`` gets each row's result at the decode step it stops. Concurrent calls share
        decode batches (the class doc); the thread of one of them runs each batch."""
        requests = list(requests)
        for r in requests:
            self._check_prompt(r)
        if not requests:
            return []
        job = _Job(requests, on_result, self._abort_epoch)  # a call waiting for a batch is in flight
        self._serve([job])
        if job.error is not None:
            raise job.error
        return job.results

    def generate_apart(
        self, requests: Sequence[GenerationRequest], on_result: OnResult | None = None
    ) -> list[GenerationResult]:
        """Each request as a call of its own, all queued at once: what concurrent one-request
        calls would be (batched with every one-request call pending), in one call. A Ray host
        takes episodes' later turns this way, so that they cross to it in one message."""
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
        """Queue ``jobs`` and return once they are answered; while no other caller's thread runs
        batches, this one does (until its own jobs are answered, then it hands over)."""
        with self._cv:
            self._pending.extend(jobs)
            while not all(j.done for j in jobs) and self._serving:
                self._cv.wait()
            serve = not all(j.done for j in jobs)
            self._serving |= serve
        if not serve:
            return
        try:
            while not all(j.done for j in jobs):
                with self._cv:
                    rows = self._next_batch()
                if rows:
                    self._run(rows)
                elif not all(j.done for j in jobs):
                    raise RuntimeError(f"engine {self.name}: a call's requests were never batched")
        finally:
            with self._cv:
                self._serving = False
                self._cv.notify_all()

    def abort(self) -> None:
        """Stop in-flight calls at their next decode step (calls still waiting for a batch too)."""
        self._abort_epoch += 1

    def _check_prompt(self, r: GenerationRequest) -> None:
        if not r.prompt_ids:
            raise ValueError(f"request {r.request_id}: empty prompt_ids")
        if len(r.prompt_ids) >= self.max_positions:
            raise ValueError(
                f"request {r.request_id}: prompt of {len(r.prompt_ids)} tokens does not fit the model's "
                f"max_position_embeddings={self.max_positions}"
            )

    def _next_batch(self) -> list[tuple[_Job, int]]:
        """The rows of the next decode batch (under ``_cv``): the next ``max_batch_size`` requests
        of the first call of several, alone (so a call's batches are what they would be with no
        other call: a single-turn call's responses do not depend on timing); else every call of
        one request pending (an episode's later turn), up to ``max_batch_size``. Calls an abort
        reached before their batch are answered "abort" without decoding."""
        for job in [j for j in self._pending if j.epoch != self._abort_epoch]:
            self._pending.remove(job)
            for i in range(job.taken, len(job.requests)):
                job.answer(i, self._aborted(job.requests[i], [], []))
            self._cv.notify_all()
        if not self._pending:
            return []
        head = self._pending[0]
        if len(head.requests) > 1:
            rows = [
                (head, i)
                for i in range(head.taken, min(head.taken + self.max_batch_size, len(head.requests)))
            ]
            head.taken += len(rows)
            if head.taken == len(head.requests):
                self._pending.popleft()
            return rows
        singles = [j for j in self._pending if len(j.requests) == 1][: self.max_batch_size]
        for job in singles:
            self._pending.remove(job)
            job.taken = 1
        return [(job, 0) for job in singles]

    def _run(self, rows: list[tuple[_Job, int]]) -> None:
        """Decode one batch (under the engine lock: a weight load waits for it) and answer its rows."""
        with self._lock:
            # the epoch the rows were taken in: an abort while the batch waited for the model
            # (a weight load) stops it at its first step
            epoch = rows[0][0].epoch
            t0 = time.perf_counter()
            try:
                results = self._generate_batch(
                    [job.requests[i] for job, i in rows], epoch, [job.on_result for job, _ in rows]
                )
            except BaseException as e:  # every call with a row in the batch fails with it
                with self._cv:
                    for job, _ in rows:
                        job.fail(e)
                        if job in self._pending:
                            self._pending.remove(job)
                    self._cv.notify_all()
                return
            finally:
                self.stats["busy_s"] += time.perf_counter() - t0
                self.stats["batches"] += 1
        with self._cv:
            for (job, i), result in zip(rows, results):
                job.answer(i, result)
            self._cv.notify_all()

    @torch.no_grad()
    def _generate_batch(
        self, reqs: list[GenerationRequest], epoch: int, on_results: list[OnResult | None]
    ) -> list[GenerationResult]:
        n = len(reqs)
        width = max(len(r.prompt_ids) for r in reqs)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for b, r in enumerate(reqs):  # left padding: every row's next token sits at column -1
            ids[b, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[b, width - len(r.prompt_ids) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)

        temps = torch.tensor([r.sampling.temperature for r in reqs], dtype=torch.float32, device=self.device)
        top_ps = torch.tensor([r.sampling.top_p for r in reqs], dtype=torch.float32, device=self.device)
        gens = [_request_generator(r.sampling) for r in reqs]
        stops = [
            set(r.sampling.stop_token_ids) | (set() if r.sampling.ignore_eos else set(self.eos_token_ids))
            for r in reqs
        ]
        out_ids: list[list[int]] = [[] for _ in reqs]
        out_lps: list[list[float]] = [[] for _ in reqs]
        finish: list[str | None] = [None] * n
        results: list[GenerationResult | None] = [None] * n

        if self._routing:
            self._routing.start()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        routed = self._routing.prefill([len(r.prompt_ids) for r in reqs]) if self._routing else None
        cache = _cache_of(out)
        logits = out.logits[:, -1, :].float()
        vocab = logits.shape[-1]
        top_ks = torch.tensor(
            [vocab if r.sampling.top_k in (-1, None) else min(r.sampling.top_k, vocab) for r in reqs],
            device=self.device,
        )
        max_new = max(r.sampling.max_new_tokens for r in reqs)
        for step in range(max_new):
            if self._abort_epoch != epoch:
                break
            tokens, lps = _sample(logits, temps, top_ks, top_ps, gens, self._rng)
            for b, r in enumerate(reqs):
                if finish[b] is not None:
                    continue
                tok = int(tokens[b])
                out_ids[b].append(tok)
                out_lps[b].append(float(lps[b]))
                if tok in stops[b]:
                    finish[b] = "stop"
                elif (
                    len(out_ids[b]) >= r.sampling.max_new_tokens
                    or len(r.prompt_ids) + step + 1 >= self.max_positions
                ):
                    finish[b] = "length"
                if finish[b] is not None:  # a finished row is never fed again: its result is whole
                    results[b] = self._finished(r, out_ids[b], out_lps[b], finish[b], routed, b)
                    if on_results[b] is not None:
                        on_results[b](results[b])
            if all(f is not None for f in finish):
                break
            feed = torch.tensor(
                [out_ids[b][-1] if finish[b] is None else self.pad_token_id for b in range(n)],
                dtype=torch.long,
                device=self.device,
            )
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=self.device)], dim=1)
            positions = positions[:, -1:] + 1
            out = self.model(
                input_ids=feed[:, None],
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{self._cache_kwarg: cache},
            )
            if routed is not None:
                self._routing.decode(routed, [finish[b] is None for b in range(n)])
            cache = _cache_of(out)
            logits = out.logits[:, -1, :].float()

        return [
            self._aborted(r, out_ids[b], out_lps[b]) if results[b] is None else results[b]
            for b, r in enumerate(reqs)
        ]

    def _finished(
        self, r: GenerationRequest, ids: list[int], lps: list[float], finish: str, routed, b: int
    ) -> GenerationResult:
        self.stats["requests"] += 1
        self.stats["tokens"] += len(ids)
        return GenerationResult(
            r.request_id,
            ids,
            lps,
            finish,
            self.weight_version,
            routed_experts=None if routed is None else torch.cat(routed[b]),
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
        with self._lock:
            self._healthy = False
            self.weight_version = None
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
            with self._lock:
                self.model.to("cpu")
                torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        """CUDA: move the model back to its device; CPU: nothing to do."""
        if self.device.type == "cuda":
            with self._lock:
                self.model.to(self.device)

    def health(self, check_process: bool = True) -> bool:
        """Whether it serves (in process: there is no separate process to check)."""
        return self._healthy


class _Job:
    """One ``generate`` call: its requests, the abort epoch it was made in, its results so far."""

    def __init__(self, requests: list[GenerationRequest], on_result: OnResult | None, epoch: int):
        self.requests, self.on_result, self.epoch = requests, on_result, epoch
        self.results: list[GenerationResult | None] = [None] * len(requests)
        self.taken = 0  # requests handed to a batch (a call's requests go in order)
        self.left = len(requests)
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.left == 0 or self.error is not None

    def answer(self, i: int, result: GenerationResult) -> None:
        self.results[i] = result
        self.left -= 1

    def fail(self, error: BaseException) -> None:
        self.error = error


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

    def prefill(self, prompt_lens: list[int]) -> list[list[torch.Tensor]]:
        experts = self._topk(len(prompt_lens))
        return [[experts[b, experts.shape[1] - n :]] for b, n in enumerate(prompt_lens)]  # left padded

    def decode(self, routed: list[list[torch.Tensor]], fed: list[bool]) -> None:
        experts = self._topk(len(routed))
        for b, live in enumerate(fed):
            if live:  # finished rows were fed padding
                routed[b].append(experts[b])


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


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
