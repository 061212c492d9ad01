"""The real SGLang 0.5.23 server (CPU, fp32, tiny Qwen2) driven by the project's client.

One server for the module (start-up is minutes on a loaded 2-core machine); tests that change its
weights say which checkpoint it serves afterwards (``served``), and every log-prob check compares
the server's ``return_logprob`` output with an HF transformers forward of that checkpoint.
Skips when ``.venv-sglang`` is not built (``make setup-sglang``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch
from helpers import hf_state_dict

from megatron_dapo.ports import free_port
from megatron_dapo.rollout.partial import continuation, from_result, join
from megatron_dapo.rollout.types import GenerationRequest, SamplingParams
from megatron_dapo.sglang.client import SGLangEngine, SGLangError
from megatron_dapo.sglang.ipc import push_weights_ipc
from megatron_dapo.sync.sglang_senders import (
    init_custom_group,
    push_weights_distributed,
)

PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 3, 77, 12, 9]]
TOL = 1e-5
LONG = 120  # new tokens; prompt + LONG stays inside the tiny model's 128 positions

_hf_cache: dict[str, torch.nn.Module] = {}


def hf_model(path):
    from transformers import AutoModelForCausalLM

    key = str(path)
    if key not in _hf_cache:
        _hf_cache[key] = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
    return _hf_cache[key]


def hf_logprobs(path, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Log-probs of ``output`` after ``prompt`` under an HF forward of ``path`` (fp32)."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = hf_model(path)(ids).logits[0].float().log_softmax(-1)
    steps = logp[len(prompt) - 1 : len(prompt) - 1 + len(output)]
    return steps.gather(-1, torch.tensor(output)[:, None])[:, 0]


def req(i: int, prompt: list[int], max_new_tokens: int = 8, **kw) -> GenerationRequest:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, **kw)
    return GenerationRequest(f"r{i}-{time.monotonic_ns()}", list(prompt), sampling)


def assert_serves(engine, path) -> None:
    """The server's sampled tokens and log-probs are those of the checkpoint at ``path``."""
    results = engine.generate([req(i, p) for i, p in enumerate(PROMPTS)])
    for prompt, res in zip(PROMPTS, results):
        assert res.finish_reason in ("length", "stop") and res.output_ids, res
        ref = hf_logprobs(path, prompt, res.output_ids)
        diff = (ref - torch.tensor(res.logprobs)).abs().max().item()
        assert diff < TOL, f"log-probs differ from HF {path} by {diff:.3g}"


@pytest.fixture(scope="module")
def models(tiny_hf_checkpoint):
    """The served start checkpoint and a changed one with the same architecture."""
    return {"base": tiny_hf_checkpoint(), "changed": tiny_hf_checkpoint(seed=1)}


@pytest.fixture(scope="module")
def engine(sglang_cpu_server):
    eng = SGLangEngine(sglang_cpu_server.url, name="real-sglang-0", timeout_s=600.0)
    yield eng
    eng.close()


def test_generate_logprobs_equal_hf_forward(engine, models):
    assert_serves(engine, models["base"])


def test_an_idle_server_holds_no_cpu_core(engine, sglang_cpu_server):
    """With nothing to serve (the trainer's update and sync), the scheduler waits on its sockets
    (`--sleep-on-idle`) instead of polling them: without it, it takes a core's share even on a
    loaded machine (4.7 CPU-s in 10 s, measured beside a running make test)."""
    import psutil

    server = psutil.Process(sglang_cpu_server.server.proc.pid)
    (scheduler,) = [p for p in server.children(recursive=True) if "scheduler" in p.name()]
    engine.generate([req(0, PROMPTS[0])])  # it served just before: the wait starts from a real reply

    def busy() -> float:
        t = scheduler.cpu_times()
        return t.user + t.system

    before = busy()
    time.sleep(4.0)  # the measured window itself, not a wait for an event
    used = busy() - before
    assert used < 0.4, f"the idle scheduler used {used:.2f} CPU-s in 4 s"


def test_connect_reads_version_and_resumes_a_paused_server(engine, models):
    # a crashed trainer can leave a server paused: generation would wait forever
    engine.run(engine.client.pause_generation("abort"))
    version = engine.run(engine.client.on_connect(), timeout=120)
    assert version[:3] == (0, 5, 23)
    assert_serves(engine, models["base"])


def test_update_from_disk_then_logprobs_match_the_new_weights(engine, models):
    engine.load_from_disk(str(models["changed"]), version=1)
    assert_serves(engine, models["changed"])
    engine.load_from_disk(str(models["base"]), version=2)
    assert_serves(engine, models["base"])


def test_update_from_tensor_changes_the_served_model(engine, models):
    changed = hf_state_dict(models["changed"])
    half = len(changed) // 2
    buckets = [dict(list(changed.items())[:half]), dict(list(changed.items())[half:])]
    # 0.5.23 refuses this outside /begin_weight_update../end_weight_update: the client wraps it
    push_weights_ipc(engine, buckets, version=3)
    assert_serves(engine, models["changed"])


def test_update_from_distributed_over_gloo_changes_the_served_model(engine, models):
    group = f"sync-{os.getpid()}"
    port = free_port()
    joined = engine.submit(
        engine.client.init_weights_update_group(
            master_address="127.0.0.1",
            master_port=port,
            rank_offset=1,
            world_size=2,
            group_name=group,
            backend="gloo",
        )
    )
    pg = init_custom_group("127.0.0.1", port, 0, 2, group, backend="gloo", timeout_s=300)
    joined.result(timeout=300)
    base = hf_state_dict(models["base"])
    names = list(base)
    buckets = [{n: base[n] for n in names[:5]}, {n: base[n] for n in names[5:]}]
    try:
        assert push_weights_distributed([engine], buckets, 4, pg, group, timeout_s=300) == 2
        assert_serves(engine, models["base"])
    finally:
        engine.run(engine.client.call("POST", "/destroy_weights_update_group", {"group_name": group}))
        torch.distributed.destroy_process_group(pg)


def _submit_many(engine, n: int, max_new_tokens: int):
    reqs = [req(i, PROMPTS[i % len(PROMPTS)], max_new_tokens, ignore_eos=True) for i in range(n)]

    async def many():
        return await asyncio.gather(*(engine.client.generate(r) for r in reqs), return_exceptions=True)

    return engine.submit(many())


def _wait_for_load(engine, pending, running: int, waiting: int, timeout_s: float = 300.0) -> bool:
    """Poll SGLang's ``GET /v1/loads`` (its scheduler's own count, published every few batches)
    until it runs ``running`` requests with ``waiting`` queued (True), or ``pending`` is done
    first (False: a loaded machine's scheduler published no count while they ran)."""
    deadline, seen = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline and not pending.done():
        loads = engine.run(engine.client.call("GET", "/v1/loads?include=core"))["loads"]
        seen = (sum(x["num_running_reqs"] for x in loads), sum(x["num_waiting_reqs"] for x in loads))
        if seen == (running, waiting):
            return True
        time.sleep(0.02)
    if pending.done():
        return False
    raise AssertionError(f"/v1/loads never showed {running} running + {waiting} waiting; last {seen}")


def test_abort_of_running_and_queued_requests(engine, models):
    # 12 requests on a server that runs at most 8 (--max-running-requests 8): 4 wait in its queue.
    # LONG tokens each: the running ones are far from done when the abort lands. The abort must
    # land while the server shows 8 running + 4 waiting; when the requests end before it showed
    # that, they are sent again.
    for _ in range(5):
        pending = _submit_many(engine, 12, LONG)
        if _wait_for_load(engine, pending, running=8, waiting=4):
            break
    else:
        raise AssertionError("12 requests never showed as 8 running + 4 waiting in 5 tries")
    engine.abort()
    results = pending.result(timeout=300)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"aborted requests must come back as results, got {errors[:2]}"
    assert all(r.finish_reason == "abort" for r in results), [r.finish_reason for r in results]
    # the 4 queued ones never ran (SGLang sends no output_token_logprobs for them); the 8 running
    # ones return the tokens they had, fewer than asked for
    assert sorted(len(r.output_ids) > 0 for r in results) == [False] * 4 + [True] * 8, [
        len(r.output_ids) for r in results
    ]
    assert all(len(r.output_ids) < LONG and len(r.output_ids) == len(r.logprobs) for r in results)
    # rollout.partial: a running request's tokens continue (prompt + tokens as the input, the
    # budget left); the joined log-probs are those of one HF forward of the served checkpoint
    i, aborted = next((i, r) for i, r in enumerate(results) if r.output_ids)
    prompt, kept = PROMPTS[i % len(PROMPTS)], from_result(aborted, None)
    again = req(100, prompt, LONG, ignore_eos=True)
    (rest,) = engine.generate([continuation(again.request_id, prompt, kept, again.sampling)])
    joined = join(kept, rest)
    assert rest.finish_reason == "length" and len(joined.output_ids) == LONG
    diff = (
        (hf_logprobs(models["base"], prompt, joined.output_ids) - torch.tensor(joined.logprobs)).abs().max()
    )
    assert diff.item() < TOL, f"continued log-probs differ from HF by {diff.item():.3g}"
    assert_serves(engine, models["base"])


def test_flush_while_requests_run_waits_for_them(engine, models):
    pending = _submit_many(engine, 8, LONG)
    engine.run(engine.client.flush_cache(), timeout=600)
    results = pending.result(timeout=600)
    assert all(not isinstance(r, BaseException) and r.finish_reason == "length" for r in results)
    assert_serves(engine, models["base"])


def test_release_and_resume_memory_round_trip(engine, models):
    engine.release_memory()
    engine.resume_memory()
    assert_serves(engine, models["base"])


def test_hung_server_ends_in_a_named_timeout(sglang_cpu_server):
    pgid = sglang_cpu_server.server.proc.pid
    hung = SGLangEngine(
        sglang_cpu_server.url, name="hung-engine", timeout_s=2.0, max_retries=1, health_timeout_s=2.0
    )
    os.killpg(pgid, signal.SIGSTOP)
    try:
        with pytest.raises(SGLangError, match=r"hung-engine.*/generate"):
            hung.generate([req(0, PROMPTS[0])])
        assert hung.health() is False
    finally:
        os.killpg(pgid, signal.SIGCONT)
        hung.close()


def test_a_server_that_hangs_mid_rollout_is_left_behind_and_the_step_finishes(sglang_cpu_server):
    """The real server SIGSTOPped as its first request goes out (a real hang: port open, nothing
    answered): the manager's probe finds it within the health timeout, its group goes to the other
    engine, and the step's batch is the one that engine alone draws; continued, the server serves."""
    import threading

    from rollout_fakes import MIXED, Dataset, Scorer, ScriptedEngine, Tokenizer, manager_config

    from megatron_dapo.rollout.manager import RolloutManager

    pgid = sglang_cpu_server.server.proc.pid
    # given by URL (no `server`): this run cannot restart it, so it goes on without it
    hung = SGLangEngine(sglang_cpu_server.url, name="hung-real", timeout_s=3600.0, health_timeout_s=2.0)
    generate, stopped = hung.client.generate, threading.Event()

    async def stop_then_send(r):
        if not stopped.is_set():
            stopped.set()
            os.killpg(pgid, signal.SIGSTOP)
        return await generate(r)

    hung.client.generate = stop_then_send
    ticks = iter(range(1, 1_000_000))  # the probe's clock: a second per reading, no sleeps
    cfg = manager_config(
        n=2, max_concurrency_per_engine=2, request_timeout_s=3600.0, health_probe_interval_s=2
    )
    ok = ScriptedEngine("ok")
    mgr = RolloutManager([hung, ok], Scorer(), cfg, Tokenizer())
    mgr.clock = lambda: float(next(ticks))
    try:
        batch = mgr.collect(Dataset([MIXED]), 0)
    finally:
        os.killpg(pgid, signal.SIGCONT)
    ref = RolloutManager([ScriptedEngine("ref")], Scorer(), cfg, Tokenizer()).collect(Dataset([MIXED]), 0)
    try:
        assert (
            stopped.is_set()
            and "GET " in mgr.pool.down["hung-real"]
            and "within 2s" in mgr.pool.down["hung-real"]
        )
        assert [(s.prompt.index, s.response_ids) for s in batch.samples] == [
            (s.prompt.index, s.response_ids) for s in ref.samples
        ]
        assert batch.metrics["rollout/engines_hung"] == 1
        # the manager's background abort of the hung engine goes on after SIGCONT (its rounds
        # abort whatever the server runs, slowly on a loaded machine): let it end first
        for t in threading.enumerate():
            if t.name == "abort-hung":
                t.join(120)
        res = hung.generate([req(0, PROMPTS[0])])[0]  # continued, it answers again
        assert res.finish_reason in ("length", "stop") and res.output_ids
    finally:
        hung.close()
