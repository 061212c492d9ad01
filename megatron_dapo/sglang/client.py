"""Async HTTP client for one SGLang server's native API, and the engine built on it.

Payloads follow SGLang's request types field for field (``GenerateReqInput``,
``SamplingParams``, ``AbortReq``, ``UpdateWeightFromDiskReqInput``,
``InitWeightsUpdateGroupReqInput``, ``UpdateWeightsFromDistributedReqInput``,
``UpdateWeightsFromTensorReqInput``, ``Release/ResumeMemoryOccupationReqInput``,
``Pause/ContinueGenerationReqInput`` in ``sglang/srt/managers/io_struct.py``); the fields and the
commit they were read at are in ``tests/fixtures/sglang/``, and the tests check every payload
built here against them. The ``payload_*`` functions are pure so that check needs no server.

Failure handling: refused connections are retried (``max_retries``, exponential back-off); dropped
connections, read timeouts and 5xx answers are retried only for idempotent calls, never for
``/generate`` (same rid), ``/init_weights_update_group`` or the weight updates (a second metadata
POST leaves the server waiting in a broadcast that never comes). 4xx answers, malformed JSON and
exhausted retries raise :class:`SGLangError` naming the engine and the endpoint; the manager
decides what to do with a failed ``/generate``. ``/flush_cache`` answers 400 while requests drain:
:meth:`SGLangClient.flush_cache` retries that until ``flush_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import httpx
import torch

from megatron_dapo.http_errors import http_error
from megatron_dapo.rollout.engine import EngineError, OnResult
from megatron_dapo.rollout.types import GenerationRequest, GenerationResult
from megatron_dapo.sglang.ipc import push_weights_ipc
from megatron_dapo.sglang.server import ROUTED_EXPERTS_FLAG
from megatron_dapo.sglang.version import parse_version, unsupported

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
NOT_RETRIED = " (not retried: the server may have acted on it, and this call is not idempotent)"

# From 0.5.21 tensor/distributed updates are refused outside /begin_weight_update../end_weight_update.
UPDATE_SESSION_SINCE = (0, 5, 21)


def check_supported_version(version: tuple[int, ...], engine: str) -> None:
    why = unsupported(version)
    if why:
        raise SGLangError(f"sglang engine {engine}: {why} (pip install 'megatron-dapo[gpu]')")


class SGLangError(EngineError):
    """A call to an SGLang server failed; names the engine and the endpoint."""


def _request_named(payload: Any) -> str | None:
    """``request <rid>`` for an error line, when the call carried a request id."""
    rid = payload.get("rid") if isinstance(payload, dict) else None
    return f"request {rid}" if rid else None


# -- payloads (pure) -----------------------------------------------------------------------


def payload_generate(req: GenerationRequest, routed_experts: bool = False) -> dict:
    """``GenerateReqInput`` for one tokenised prompt, asking for the sampled tokens' log-probs
    (and with ``routed_experts`` each MoE layer's experts per token, from position 0: the server
    needs ``sglang.server.ROUTED_EXPERTS_FLAG``)."""
    s = req.sampling
    sampling = {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "max_new_tokens": s.max_new_tokens,
        "ignore_eos": s.ignore_eos,
        # keep special tokens and the stop token in the output, as the trainer sees them
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if s.stop_token_ids:
        sampling["stop_token_ids"] = list(s.stop_token_ids)
    if s.seed is not None:
        sampling["sampling_seed"] = int(s.seed)
    payload = {
        "rid": req.request_id,
        "input_ids": list(req.prompt_ids),
        "sampling_params": sampling,
        "return_logprob": True,
    }
    if routed_experts:
        payload.update(return_routed_experts=True, routed_experts_start_len=0)
    return payload


def parse_routed_experts(meta: dict, shape: tuple[int, int], tokens: int, where: str) -> torch.Tensor:
    """SGLang 0.5.23's ``meta_info.routed_experts`` -> an int16 ``[tokens, layers, k]`` tensor.

    What its source defines: the detokenizer base64-encodes the int32 rows that
    ``RoutedExpertsCapturer.get_topk`` reads from its host cache, one per token position in
    ``[routed_experts_start_len, seq_len - 1)`` (the last sampled token is never forwarded), each
    ``[num_hidden_layers, num_experts_per_tok]`` of the text config: a row for every decoder
    layer, indexed by layer id, fused shared-expert columns dropped. ``shape`` is that
    ``(layers, k)`` (``sglang.engines.routed_experts_shape``)."""
    import base64

    import numpy as np

    raw = meta.get("routed_experts")
    if raw is None:
        raise SGLangError(
            f"{where} has no meta_info.routed_experts, which actor.routing_replay=rollout needs: the "
            f"server must be started with {ROUTED_EXPERTS_FLAG} (the driver passes it to the servers it "
            "starts; add it to servers given by rollout.sglang.urls, e.g. SGLANG_EXTRA_ARGS for "
            "launch/start_sglang_servers.sh)"
        )
    flat = np.frombuffer(base64.b64decode(raw), dtype=np.int32)
    layers, k = shape
    if flat.size != tokens * layers * k:
        raise SGLangError(
            f"{where}: routed_experts holds {flat.size} ids, expected {tokens} tokens x {layers} layers x top-{k}"
        )
    return torch.from_numpy(flat.copy()).view(tokens, layers, k).to(torch.int16)


def payload_abort(rid: str | None = None) -> dict:
    """``AbortReq``: one request by id, or everything."""
    return {"rid": rid, "abort_all": False} if rid else {"abort_all": True}


def payload_update_from_disk(model_path: str, version: int, flush_cache: bool = True) -> dict:
    return {"model_path": str(model_path), "weight_version": str(version), "flush_cache": flush_cache}


def payload_init_group(
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str,
    backend: str = "nccl",
) -> dict:
    return {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": int(rank_offset),
        "world_size": int(world_size),
        "group_name": group_name,
        "backend": backend,
    }


def bucket_metadata(bucket: dict[str, torch.Tensor]) -> tuple[list[str], list[str], list[list[int]]]:
    """Names, dtype names (``"bfloat16"``, as ``getattr(torch, name)`` reads them) and shapes."""
    names = list(bucket)
    dtypes = [str(t.dtype).removeprefix("torch.") for t in bucket.values()]
    shapes = [list(t.shape) for t in bucket.values()]
    return names, dtypes, shapes


def payload_update_from_distributed(
    bucket: dict[str, torch.Tensor], version: int, group_name: str, flush_cache: bool = True
) -> dict:
    names, dtypes, shapes = bucket_metadata(bucket)
    return {
        "names": names,
        "dtypes": dtypes,
        "shapes": shapes,
        "group_name": group_name,
        "flush_cache": flush_cache,
        "weight_version": str(version),
    }


def payload_update_from_tensor(
    serialized_per_tp_rank: list[str], version: int, load_format: str | None = None, flush_cache: bool = True
) -> dict:
    payload = {
        "serialized_named_tensors": list(serialized_per_tp_rank),
        "flush_cache": flush_cache,
        "weight_version": str(version),
    }
    if load_format is not None:
        payload["load_format"] = load_format
    return payload


def payload_memory(tags: Sequence[str] | None) -> dict:
    """``Release/ResumeMemoryOccupationReqInput``; None means every region."""
    if tags is None:
        return {}
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise ValueError(f"memory tags must be among {MEMORY_TAGS}, got {bad}")
    return {"tags": list(tags)}


def payload_pause(mode: str = "abort") -> dict:
    if mode not in ("abort", "retract", "in_place"):
        raise ValueError(f"pause mode must be abort, retract or in_place, got {mode!r}")
    return {"mode": mode}


def parse_generate_reply(
    reply: Any, req: GenerationRequest, engine: str, routed_experts_shape: tuple[int, int] | None = None
) -> GenerationResult:
    """A ``/generate`` reply -> :class:`GenerationResult` (tokens from ``output_token_logprobs``;
    with ``routed_experts_shape`` = (MoE layers, top-k) also the experts of every forwarded token)."""
    where = f"sglang engine {engine}: /generate reply for {req.request_id}"
    try:
        meta = reply["meta_info"]
        reason = meta["finish_reason"]
        kind = reason["type"] if isinstance(reason, dict) else reason
        # a request aborted while still queued never ran: its reply has no output_token_logprobs
        items = meta["output_token_logprobs"] if kind != "abort" else meta.get("output_token_logprobs") or []
        logprobs = [float(item[0]) for item in items]
        ids = [int(item[1]) for item in items]
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise SGLangError(
            f"{where} lacks meta_info.finish_reason/output_token_logprobs ({e!r}): {str(reply)[:200]}"
        ) from e
    if kind not in ("stop", "length", "abort"):
        raise SGLangError(f"{where}: unknown finish_reason {reason!r}")
    version = meta.get("weight_version")
    try:
        version = int(version) if version is not None else None
    except (TypeError, ValueError):
        version = None
    routed = None
    if routed_experts_shape is not None and kind != "abort" and ids:
        routed = parse_routed_experts(meta, routed_experts_shape, len(req.prompt_ids) + len(ids) - 1, where)
    token_versions = _token_versions(meta.get("weight_versions"), len(ids))
    return GenerationResult(
        req.request_id, ids, logprobs, kind, version, token_versions=token_versions, routed_experts=routed
    )


def _token_versions(spans: Any, tokens: int) -> list[int] | None:
    """SGLang's ``meta_info.weight_versions`` (``{"version", "start", "end"}`` spans over output
    positions, sent when the weights changed while the request ran) -> one version per token;
    None (every token is the reply's ``weight_version``) when absent or not covering the tokens."""
    if not spans:
        return None
    out: list[int] = []
    try:
        for span in spans:
            if int(span["start"]) != len(out):
                return None
            out += [int(span["version"])] * (int(span["end"]) - int(span["start"]))
    except (KeyError, TypeError, ValueError):
        return None
    return out if len(out) == tokens else None


# -- the client --------------------------------------------------------------------------------


class SGLangClient:
    """Async client of one server. Create and use it inside one event loop.

    Args:
        base_url: ``http://host:port``.
        name: engine name for errors (default: the URL).
        api_key: sent as ``Authorization: Bearer`` (the server's ``--api-key``).
        timeout_s: read timeout of one call (``/generate`` can take minutes).
        max_retries: retries after the first attempt on connection errors and 5xx.
        backoff_s: first retry delay, doubled each time.
        flush_timeout_s: how long :meth:`flush_cache` retries while the server drains requests.
        health_timeout_s: read timeout of ``/health`` (it runs a generation in SGLang 0.5.x).
    """

    def __init__(
        self,
        base_url: str,
        *,
        name: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 1800.0,
        connect_timeout_s: float = 10.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        flush_timeout_s: float = 120.0,
        health_timeout_s: float = 120.0,
        routed_experts_shape: tuple[int, int] | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        # MoE routing replay: (layers, top-k) of the served model, or None to not ask for them.
        self.routed_experts_shape = routed_experts_shape
        self.name = name or self.base_url
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.connect_timeout_s = connect_timeout_s
        self.flush_timeout_s = flush_timeout_s
        self.health_timeout_s = health_timeout_s
        self.server_version: tuple[int, ...] | None = None
        self._update_session = False
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        self.in_flight = 0

    async def close(self) -> None:
        await self._http.aclose()

    async def call(
        self,
        method: str,
        endpoint: str,
        payload: dict | None = None,
        *,
        expect_json: bool = True,
        retry_read_timeout: bool = True,
        idempotent: bool = True,
        timeout_s: float | None = None,
    ) -> Any:
        """One request with retries; the decoded JSON (or text when ``expect_json`` is False).

        ``idempotent=False`` retries only connections that were refused (the server never saw
        the request): a second ``/generate`` with the same rid, or a second weight-update metadata
        POST (the server then waits in a broadcast that never comes), is worse than a clear error. ``timeout_s`` overrides the read timeout of this call.
        """
        last = ""
        attempts = self.max_retries + 1
        extra = (
            {} if timeout_s is None else {"timeout": httpx.Timeout(timeout_s, connect=self.connect_timeout_s)}
        )
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                r = await self._http.request(method, endpoint, json=payload, **extra)
            except httpx.ReadTimeout as e:
                if not retry_read_timeout or not idempotent:
                    raise SGLangError(
                        f"sglang engine {self.name}: {method} {endpoint} timed out reading: {e}"
                    ) from e
                last = f"read timeout ({e})"
                continue
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # never reached the server
                last = f"{type(e).__name__}: {e}"
                continue
            except httpx.TransportError as e:  # reset or dropped mid-reply: it may have run
                last = f"{type(e).__name__}: {e}"
                if not idempotent:
                    last += NOT_RETRIED
                    break
                continue
            if r.status_code >= 500:
                last = http_error(r, _request_named(payload))
                if not idempotent:
                    last += NOT_RETRIED
                    break
                continue
            if r.status_code >= 400:
                raise SGLangError(
                    f"sglang engine {self.name}: {method} {endpoint} -> {http_error(r, _request_named(payload))}"
                )
            if not expect_json:
                return r.text
            try:
                return r.json()
            except (json.JSONDecodeError, ValueError) as e:
                raise SGLangError(
                    f"sglang engine {self.name}: {method} {endpoint} answered malformed JSON ({e}): {r.text[:200]!r}"
                ) from e
        raise SGLangError(
            f"sglang engine {self.name}: {method} {endpoint} failed after {attempt + 1} attempts; last: {last}"
        )

    async def generate(self, req: GenerationRequest) -> GenerationResult:
        self.in_flight += 1
        try:
            payload = payload_generate(req, routed_experts=self.routed_experts_shape is not None)
            reply = await self.call("POST", "/generate", payload, idempotent=False)
        finally:
            self.in_flight -= 1
        return parse_generate_reply(reply, req, self.name, self.routed_experts_shape)

    async def abort_all(self, max_rounds: int = 20, settle_s: float = 0.25) -> int:
        """Abort everything, repeated until this client has no ``/generate`` open; returns the rounds used.

        One ``abort_all`` can miss requests that reach the scheduler just after it, so it is
        re-sent while any of our requests is still open.
        """
        for rounds in range(1, max_rounds + 1):
            await self.call("POST", "/abort_request", payload_abort(), expect_json=False)
            deadline = time.monotonic() + settle_s
            while self.in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            if not self.in_flight:
                return rounds
        raise SGLangError(
            f"sglang engine {self.name}: {self.in_flight} requests still open after {max_rounds} aborts"
        )

    async def flush_cache(self) -> None:
        """Flush the radix cache, retrying its 400 ("requests still running") until it answers 200.

        Raises :class:`SGLangError` after ``flush_timeout_s`` (the client's ``flush_timeout_s``).
        """
        deadline = time.monotonic() + self.flush_timeout_s
        delay = 0.05
        while True:
            try:
                await self.call("POST", "/flush_cache", expect_json=False)
                return
            except SGLangError as e:
                if "HTTP 400" not in str(e) or time.monotonic() + delay > deadline:
                    if "HTTP 400" in str(e):
                        raise SGLangError(
                            f"sglang engine {self.name}: /flush_cache still refused after "
                            f"{self.flush_timeout_s:g}s (flush_timeout_s; requests did not drain): {e}"
                        ) from e
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def pause_generation(self, mode: str = "abort") -> None:
        await self.call("POST", "/pause_generation", payload_pause(mode))

    async def continue_generation(self) -> None:
        """Close an open weight-update session, then resume; resumes even when closing failed."""
        try:
            await self.end_weight_update()
        finally:
            await self.call("POST", "/continue_generation", {})

    async def update_weights_from_disk(self, model_path: str, version: int) -> dict:
        return self._checked(
            await self.call(
                "POST", "/update_weights_from_disk", payload_update_from_disk(model_path, version)
            ),
            "/update_weights_from_disk",
        )

    async def init_weights_update_group(self, **kwargs) -> dict:
        return self._checked(
            await self.call(
                "POST", "/init_weights_update_group", payload_init_group(**kwargs), idempotent=False
            ),
            "/init_weights_update_group",
        )

    async def update_weights_from_distributed(
        self, bucket: dict[str, torch.Tensor], version: int, group_name: str
    ) -> dict:
        # the sync flushes once before its first bucket (flush_cache), not once per bucket
        payload = payload_update_from_distributed(bucket, version, group_name, flush_cache=False)
        await self.begin_weight_update()
        return self._checked(
            await self.call("POST", "/update_weights_from_distributed", payload, idempotent=False),
            "/update_weights_from_distributed",
        )

    async def update_weights_from_tensor(
        self, serialized: list[str], version: int, load_format: str | None = None
    ) -> dict:
        payload = payload_update_from_tensor(serialized, version, load_format, flush_cache=False)
        await self.begin_weight_update()
        return self._checked(
            await self.call("POST", "/update_weights_from_tensor", payload, idempotent=False),
            "/update_weights_from_tensor",
        )

    async def begin_weight_update(self) -> None:
        """Open the update session SGLang >= 0.5.21 requires around tensor/distributed updates.

        Opened by the first such update of a sync and closed by the ``continue_generation`` that
        ends every sync, so callers (the driver's transports) need not know about it.
        """
        if self._update_session or not await self.needs_update_session():
            return
        self._checked(
            await self.call("POST", "/begin_weight_update", {}, idempotent=False), "/begin_weight_update"
        )
        self._update_session = True

    async def end_weight_update(self) -> None:
        if not self._update_session:
            return
        self._update_session = False
        self._checked(
            await self.call("POST", "/end_weight_update", {}, idempotent=False), "/end_weight_update"
        )

    async def needs_update_session(self) -> bool:
        return (await self.version()) >= UPDATE_SESSION_SINCE

    async def version(self) -> tuple[int, ...]:
        """The server's SGLang version (``/get_server_info``, else its successor ``/server_info``), read once."""
        if self.server_version is None:
            try:
                info = await self.call("GET", "/get_server_info")
            except SGLangError as e:
                if "HTTP 404" not in str(e):
                    raise
                info = await self.call("GET", "/server_info")
            raw = info.get("version") if isinstance(info, dict) else None
            self.server_version = parse_version(raw)
        return self.server_version

    async def on_connect(self) -> tuple[int, ...]:
        """Refuse an unsupported server; resume one a crashed trainer left paused."""
        version = await self.version()
        check_supported_version(version, self.name)
        await self.continue_generation()
        return version

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        await self.flush_cache()  # the radix cache points into the KV memory being released
        await self.call("POST", "/release_memory_occupation", payload_memory(tags), expect_json=False)

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        await self.call("POST", "/resume_memory_occupation", payload_memory(tags), expect_json=False)

    async def health(self) -> bool:
        """``GET /health`` answers 200 (one attempt) within ``health_timeout_s``.

        In SGLang 0.5.x ``/health`` runs a one-token generation behind the queued work, so a busy
        server needs far more than a ping's timeout to answer.
        """
        try:
            r = await self._http.get(
                "/health", timeout=httpx.Timeout(self.health_timeout_s, connect=self.connect_timeout_s)
            )
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    async def get_server_info(self) -> dict:
        return await self.call("GET", "/get_server_info")

    def _checked(self, reply: Any, endpoint: str) -> dict:
        if not isinstance(reply, dict) or not reply.get("success", False):
            raise SGLangError(f"sglang engine {self.name}: {endpoint} did not succeed: {str(reply)[:300]}")
        return reply


class _LoopThread:
    """A private asyncio loop in a daemon thread, so sync callers (threads) can run coroutines."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=f"sglang-loop-{name}", daemon=True)
        self.stopped = False
        self.thread.start()

    def run(self, coro, timeout: float | None = None):
        if self.stopped:  # a stopped loop never runs it: the caller would wait forever
            coro.close()
            raise EngineError(f"{self.thread.name}: the engine is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def cancel_all(self) -> None:
        """Cancel what still runs: a call to a hung server would otherwise leave its caller's
        thread waiting forever once the loop stops (and the process's exit with it)."""

        async def cancel() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self.thread.is_alive():
            with contextlib.suppress(Exception):  # stopping anyway
                asyncio.run_coroutine_threadsafe(cancel(), self.loop).result(timeout=5)

    def stop(self) -> None:
        self.stopped = True
        self.cancel_all()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


class SGLangEngine:
    """A :class:`~megatron_dapo.rollout.engine.RolloutEngine` backed by one SGLang server.

    Args:
        base_url: the server URL.
        name: engine name.
        server: the supervised process, when this side launched it (``health`` checks it is alive).
        tp_size: the server's TP size (one CUDA-IPC payload per TP rank).
        client_kwargs: passed to :class:`SGLangClient`.

    ``load_weights`` uses CUDA IPC (``/update_weights_from_tensor``): colocated, GPU only. The
    disaggregated NCCL path is :func:`~megatron_dapo.sync.sglang_senders.push_weights_distributed`.
    """

    def __init__(
        self, base_url: str, *, name: str | None = None, server=None, tp_size: int = 1, **client_kwargs
    ):
        self.name = name or base_url
        self.server = server
        self.tp_size = tp_size
        self._loop = _LoopThread(self.name)
        self.client: SGLangClient = self._loop.run(self._make_client(base_url, client_kwargs))
        self._abort_epoch = 0
        self.weight_version: int | None = None
        # between release_memory and resume_memory (colocated): /health would run a generation
        # without weights or KV cache, so a health check then only asks whether the process lives
        self.memory_released = False

    async def _make_client(self, base_url, kwargs) -> SGLangClient:
        return SGLangClient(base_url, name=self.name, **kwargs)

    def submit(self, coro):
        """Start a client coroutine on this engine's loop; a ``concurrent.futures.Future``."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop.loop)

    def run(self, coro, timeout: float | None = None):
        """Run a client coroutine on this engine's loop (e.g. ``engine.run(engine.client.flush_cache())``)."""
        return self._loop.run(coro, timeout)

    def generate(
        self, requests: Sequence[GenerationRequest], on_result: OnResult | None = None
    ) -> list[GenerationResult]:
        epoch = self._abort_epoch

        async def one(req: GenerationRequest) -> GenerationResult:
            if self._abort_epoch != epoch:  # aborted before it was sent: never reaches the server
                return GenerationResult(req.request_id, [], [], "abort", self.weight_version)
            result = await self.client.generate(req)
            if on_result is not None and result.finish_reason != "abort":
                on_result(result)  # this reply is in; the others of the call may still be generating
            return result

        async def all_of() -> list[GenerationResult]:
            return list(await asyncio.gather(*(one(r) for r in requests)))

        return self._loop.run(all_of())

    def abort(self) -> None:
        """Abort every open request. A server that does not answer within ``health_timeout_s`` and
        then fails ``health()`` (hung or dead) has nothing left to abort: the caller's own health
        check marks it down, instead of this call waiting out the request timeout and its retries."""
        self._abort_epoch += 1
        fut = self.submit(self.client.abort_all())
        try:
            fut.result(timeout=self.client.health_timeout_s)
        except Exception:
            fut.cancel()
            if self.health():
                raise

    def load_weights(self, buckets: Iterable[dict[str, torch.Tensor]], version: int) -> None:
        push_weights_ipc(self, buckets, version)
        self.weight_version = version

    def load_from_disk(self, path: str, version: int) -> bool:
        self._loop.run(self.client.update_weights_from_disk(path, version))
        self.weight_version = version
        return True

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        self._loop.run(self.client.release_memory_occupation(tags))
        self.memory_released = True

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        self._loop.run(self.client.resume_memory_occupation(tags))
        self.memory_released = False

    def health(self, check_process: bool = True) -> bool:
        """The server answers ``GET /health`` within ``health_timeout_s``; with ``check_process``
        (and a server this side launched) its process is asked first whether it lives, which on
        the Ray path is a call to its node's host actor: the check before a sync skips that for a
        server that answers."""
        if check_process and self.server is not None and not self.server.alive():
            return False
        try:
            return bool(self._loop.run(self.client.health(), timeout=self.client.health_timeout_s + 30))
        except Exception:  # noqa: BLE001 - no answer in time (or a loop gone): not healthy
            return False

    def close(self) -> None:
        self._loop.cancel_all()  # calls in flight end cancelled, not on a closed HTTP client
        self._loop.run(self.client.close())
        self._loop.stop()
