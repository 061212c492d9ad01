"""A real SGLang server SIGKILLed mid-rollout inside the DAPO loop, recovered by the trainer's own
restart path (`rollout/engine_pool.py`): 2 real CPU servers, Ray local, one actor rank (TP=1:
the TP=2 gather into SGLang's update is test_sglang_real_demo's (the calculator demo) and the two-node test's; a second
rank here only cost CPU), fp32, weights by SGLang's distributed update over gloo after every step.

The victim is engine 0's first call. Its detokenizer is stopped first (SIGSTOP), so the call's
requests stay in flight: the server has received and prefilled them (its cumulative prefill
counter in `/v1/loads` rises, the condition the kill waits on) but can never answer. Then the
server's main process is SIGKILLed by pid; its scheduler and detokenizer die with it. Checked:
- the trainer scores both steps' samples as the servers did (mismatch < 1e-4; at step 2 that
  needs the sync after step 1, to the restarted server too);
- step 1 completes on the other server: the batch is full, the manager's ledger accounts for every
  drawn group exactly once, the healthy engine returned exactly `gen_batch_size * n` samples;
- the dead server is restarted and synced before it gets work again: every sample it returns after
  the kill carries a server-reported weight version >= 1 (a fresh server reports none);
- the restarted server serves the actor's weights: its log-probs of a fixed sequence at the end
  equal an HF fp32 forward of the actor's exported final weights within 1e-5.
Skips when the SGLang venv (`make setup-sglang`) or the CPU stand-ins are missing.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from sglang_fixtures import fixed_sequence_logprobs, hf_sequence_logprobs, require_sglang

REPO = Path(__file__).resolve().parents[1]
SEQUENCE = [5, 6, 7, 8, 40, 41, 42, 100, 3, 77]
N, GROUPS = 4, 4


@pytest.fixture(scope="module")
def assets(small_demo_assets):
    require_sglang()
    return small_demo_assets(sft_steps=5, eval_problems=4)


def _prefilled(url: str) -> int:
    """The server's cumulative count of prefilled tokens (published by its scheduler)."""
    loads = httpx.get(f"{url}/v1/loads", params={"include": "core"}, timeout=120).json()["loads"]
    return sum(int(load["total_prefill_uncached_tokens"]) for load in loads)


def _server_pid(engine) -> int:
    import ray

    return ray.get(engine.server.host.pid.remote(engine.server.index), timeout=120)


class Victim:
    """Wraps `SGLangEngine.generate` in the driver: freezes and kills engine 0 in its first call,
    and records what every engine returned (engine name, phase, server-reported versions)."""

    def __init__(self):
        self.armed = threading.Event()
        self.killed = threading.Event()
        self.engine = None
        self.baseline = 0
        self.returned: list[tuple[str, bool, list]] = []  # (engine, after the kill, versions)
        self.finished: list[str] = []
        self.error: BaseException | None = None

    def wrap(self, original):
        victim = self

        def generate(engine, requests, on_result=None):
            if engine.name.startswith("sglang-0@") and not victim.armed.is_set():
                import psutil

                victim.engine = engine
                pid = _server_pid(engine)
                victim.pid = pid
                detok = [p for p in psutil.Process(pid).children(recursive=True) if "detok" in p.name()]
                assert detok, "no sglang::detokenizer under the server"
                victim.baseline = _prefilled(engine.client.base_url)
                for p in detok:
                    p.send_signal(signal.SIGSTOP)
                victim.armed.set()
            after = victim.killed.is_set()
            results = original(engine, requests, on_result)
            victim.returned.append((engine.name, after, [r.weight_version for r in results]))
            victim.finished.extend(r.finish_reason for r in results)
            return results

        return generate

    def kill_when_running(self):
        try:
            assert self.armed.wait(900), "engine 0 never got a call"
            url = self.engine.client.base_url
            deadline = time.monotonic() + 600
            while _prefilled(url) <= self.baseline:  # its requests reached the scheduler and ran
                assert time.monotonic() < deadline, "the victim's requests never ran"
                time.sleep(0.05)
            self.killed.set()
            os.kill(self.pid, signal.SIGKILL)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
            self.armed.set()


def test_server_sigkilled_mid_rollout_is_restarted_and_resynced(assets, tmp_path, monkeypatch):
    import megatron_dapo.driver.launch as launch
    from megatron_dapo.driver.launch import load_for_cli, run_train
    from megatron_dapo.sglang.client import SGLangEngine

    victim = Victim()
    monkeypatch.setattr(SGLangEngine, "generate", victim.wrap(SGLangEngine.generate))
    final: dict[str, list[float]] = {}
    stop = launch.stop_sglang_engines

    def read_then_stop(engines):  # the servers' weights at the end, before they are stopped
        for e in engines:
            final[e.name] = fixed_sequence_logprobs(e.client.base_url, SEQUENCE)
        stop(engines)

    monkeypatch.setattr(launch, "stop_sglang_engines", read_then_stop)
    killer = threading.Thread(target=victim.kill_when_running, daemon=True)
    killer.start()
    overrides = {
        "model.path": assets.hf_dir,
        "data.train_files": f"[{assets.train_file}]",
        "data.val_files": f"[{assets.val_file}]",
        "trainer.runs_dir": tmp_path,
        "trainer.run_name": "restart",
        "trainer.total_steps": 2,
        "trainer.train_batch_size": GROUPS,
        "trainer.val_before_train": "false",
        "trainer.test_freq": 0,
        "trainer.save_freq": 0,
        "trainer.hf_export_at_end": "true",
        "parallel.tensor_model_parallel_size": 1,
        "parallel.actor_world_size": 1,
        "rollout.engine": "sglang",
        "rollout.num_engines": 2,
        "rollout.gen_batch_size": GROUPS,
        "rollout.n": N,
        "rollout.groups_per_call": 1,
        "rollout.max_concurrency_per_engine": 8,
        "rollout.over_sample": "false",  # draw exactly gen_batch_size groups per step
        "rollout.sglang.startup_timeout_s": 900,
        "actor.ppo_mini_batch_size": GROUPS,
        "algorithm.filter_groups.enable": "false",
        "algorithm.allow_partial_batch": "false",
        "logging.progress": "false",
        "logging.plots_at_end": "false",
    }
    cfg = load_for_cli(str(REPO / "configs/demo.yaml"), [f"{k}={v}" for k, v in overrides.items()])
    summary = run_train(cfg)
    killer.join(timeout=60)
    assert victim.error is None, victim.error
    assert victim.killed.is_set()
    run = Path(summary["run_dir"])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if r["step"] >= 1}
    assert sorted(steps) == [1, 2]
    m1, m2 = steps[1], steps[2]

    # step 1 finished on engine 1: full batch, every drawn group accounted for once
    assert m1["rollout/engines_down"] == 1 and m2["rollout/engines_down"] == 0
    ledger = ("groups_in_batch", "filtered_all_correct", "filtered_all_wrong", "filtered_other",
              "surplus", "aborted")  # fmt: skip
    for m in (m1, m2):
        shown = {k: v for k, v in m.items() if k.startswith("rollout/")}
        assert m["rollout/groups_in_batch"] == GROUPS and m["rollout/prompts_drawn"] == GROUPS, shown
        assert sum(m[f"rollout/{k}"] for k in ledger) == GROUPS, shown
        assert m["actor/rollout_logprob_abs_diff"] < 1e-4, m["step"]  # step 2: after the sync
        assert m["sync/buckets"] >= 1
    logs = sorted((run / "sglang").glob("engine_*.log"))
    assert [p.name for p in logs] == ["engine_0.log", "engine_1.log"]
    # stopped at the end by a SIGTERM to each server's group, which SGLang takes for its scheduler's
    # crash: with its crash diagnostics on it slept 5 s before exiting (sglang/server.py)
    for log in logs:
        assert "before crash diagnostics" not in log.read_text(errors="replace"), log
    assert "abort" not in victim.finished
    name0 = victim.engine.name
    # step 1 ran on the initial weights (a server loaded from disk reports no version): its
    # samples all came from engine 1, each of the 4 x 4 exactly once
    step1 = [(name, v) for name, _, vs in victim.returned for v in vs if v is None]
    assert len(step1) == GROUPS * N and all(name != name0 for name, _ in step1), step1

    # the restarted engine got work again only with synced weights, and it did get work
    back = [v for name, after, vs in victim.returned if after and name == name0 for v in vs]
    assert back and all(v is not None and v >= 1 for v in back), back

    # its log-probs are the actor's: HF fp32 forward of the exported final weights
    ref = hf_sequence_logprobs(run / "hf" / "step_2", SEQUENCE)
    initial = hf_sequence_logprobs(assets.hf_dir, SEQUENCE)
    assert (ref - initial).abs().max() > 1e-3  # the training moved the weights: a missed sync shows
    for name, logprobs in final.items():
        diff = (torch.tensor(logprobs) - ref).abs().max().item()
        assert diff < 1e-5, f"{name} serves log-probs {diff:.3g} away from the actor's"
    assert name0 in final
