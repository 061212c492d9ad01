"""Shared pytest fixtures.

``tiny_hf_checkpoint`` is a factory: ``tiny_hf_checkpoint(family="qwen2", tie_word_embeddings=False,
num_layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, seed=0, max_shard_size=None)`` writes a
random tiny HF checkpoint (config.json + safetensors + tokenizer) into a fresh tmp dir and
returns its Path. Identical arguments within one test session return the same directory (the
checkpoint is written once), so treat it as read-only. The same function without caching is
``helpers.make_tiny_hf_checkpoint(path, ...)`` (tests/helpers.py; tests import it as ``from helpers import ...``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from built import missing  # noqa: E402
from helpers import make_tiny_hf_checkpoint  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "needs_built(present, what): the test needs something make test provides; when `present` is "
        "false it skips naming `what`, and in CI fails (tests/built.py)",
    )


def pytest_runtest_setup(item):
    for mark in item.iter_markers("needs_built"):
        present, what = mark.args
        if not present:
            missing(what)


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory):
    cache: dict[tuple, Path] = {}

    def make(**kwargs) -> Path:
        key = tuple(sorted(kwargs.items()))
        if key not in cache:
            target = tmp_path_factory.mktemp("tiny_hf") / "model"
            cache[key] = make_tiny_hf_checkpoint(target, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session", autouse=True)
def _end_own_shm_manager():
    """At the end of the session, the torch_shm_manager this pytest process started (tests that
    pickle CPU tensors for SGLang's weight updates start one as its child and use it until the
    process ends; it would outlive the session). Each pytest-xdist worker ends its own."""
    yield
    import psutil

    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if child.name() == "torch_shm_manager":
                child.terminate()


@pytest.fixture(scope="module")
def sglang_cpu_server(tiny_hf_checkpoint, tmp_path_factory):
    """One real SGLang 0.5.23 server per test module, on the default tiny Qwen2 (fp32, CPU).

    Module-scoped: tests may change its weights, so modules do not share it. Skips when
    ``.venv-sglang`` is not built (``make setup-sglang``), fails so in CI (tests/built.py). Yields
    ``sglang_fixtures.CPUServer``.
    """
    from sglang_fixtures import real_sglang_server

    with real_sglang_server(tiny_hf_checkpoint(), tmp_path_factory.mktemp("sglang")) as handle:
        yield handle


@pytest.fixture
def sglang_server_factory(tmp_path_factory):
    """``start(model_path, **kwargs)`` -> a running ``CPUServer`` (other flags, more servers);
    every server started is stopped at the end of the test."""
    from sglang_fixtures import start_cpu_server, stop_cpu_server

    started = []

    def start(model_path, **kwargs):
        handle = start_cpu_server(model_path, tmp_path_factory.mktemp("sglang"), **kwargs)
        started.append(handle)
        return handle

    yield start
    for handle in started:
        stop_cpu_server(handle)


def _demo_assets_shared_by_workers(tmp_path_factory, name: str, build=None, **kwargs):
    """prepare_demo_assets (or ``build``, with the same contract) in a directory every pytest-xdist
    worker of this run shares: the first worker builds it under a file lock, the others wait and
    reuse it (the builder reuses a directory whose manifest matches). Without xdist it is the
    session's own tmp dir."""
    from filelock import FileLock

    from megatron_dapo.demo.assets import prepare_demo_assets

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # xdist gives each worker its own basetemp under one run directory
    root = base / name
    with FileLock(str(root) + ".lock"):
        return (build or prepare_demo_assets)(root, **kwargs)


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """The demo's model and data for the driver's end-to-end tests, built once per session.

    The demo's full warm start (~800 steps, ~30 s): the runs with dynamic sampling on need mixed
    groups to fill a batch. After a few SFT steps almost every group is all-wrong, and one step
    drew ~3600 prompts in ~900 generation rounds (minutes per step)."""
    return _demo_assets_shared_by_workers(tmp_path_factory, "demo_assets", eval_problems=8)


@pytest.fixture(scope="session")
def calculator_assets(tmp_path_factory):
    """The calculator demo's model and data (`megatron-dapo demo --task calculator`), its full warm
    start (~250 steps, 20-60 s), built once per session: the end-to-end test needs groups whose
    episodes differ, which a policy that calls the tool part of the time and copies its answer
    gives."""
    from megatron_dapo.demo.calculator.assets import prepare_calculator_assets

    tools = Path(__file__).resolve().parents[1] / "configs" / "tools" / "calculator.yaml"
    return _demo_assets_shared_by_workers(
        tmp_path_factory,
        "calculator_assets",
        build=prepare_calculator_assets,
        tool_config=tools,
        eval_problems=8,
    )


@pytest.fixture(scope="session")
def small_demo_assets(tmp_path_factory):
    """``small_demo_assets(sft_steps=5, eval_problems=4)`` -> the demo's model and data after a few
    warm-start steps, built once per session for each distinct set of arguments (the real-SGLang
    and torchrun modules need a model, not a good one). Read-only: runs write elsewhere."""
    cache: dict[tuple, object] = {}

    def make(sft_steps: int = 5, eval_problems: int = 4):
        key = (sft_steps, eval_problems)
        if key not in cache:
            name = f"demo_assets_sft{sft_steps}_eval{eval_problems}"
            cache[key] = _demo_assets_shared_by_workers(
                tmp_path_factory, name, sft_steps=sft_steps, eval_problems=eval_problems
            )
        return cache[key]

    return make


@pytest.fixture(scope="session")
def layout_hf_dir(tiny_hf_checkpoint):
    """The tiny Qwen2 of the actor-layout tests (tests/layout_harness.py)."""
    from layout_harness import MODEL

    return str(tiny_hf_checkpoint(**MODEL))


@pytest.fixture(scope="session")
def layout_data(layout_hf_dir):
    """(batch, pi_old log-probs, HF log-probs as a padded [n, max_response] float64 matrix)."""
    from layout_harness import make_batch

    return make_batch(layout_hf_dir)


# `make test` runs two pytest-xdist workers that take whole files in collection order, this one
# first and the rest by name. A stale entry costs only time.
# - The long files each take one to seven minutes on 2 cores (`tools/test_budget.py` lists the
#   costliest): run first, they overlap each other and the hundreds of short files fill the gaps
#   at the end, instead of the alphabetically late ones (test_sglang_real_*, test_torchrun_*)
#   running last with the other worker idle.
# - A file marked "waits" has tests that mostly wait (time-outs, hung and dying stand-ins,
#   retries); each comes right after a long file, so that one worker waits while the other
#   computes. By name they came last (the suite's last ~70 s at 4-50% of the cores, fresh-clone
#   runs r2, r3); all together after the long files, both workers waited at once (~70 s at 0-60%,
#   run s1 at e828ba1; sampled from /proc/stat, docs/results.md).
FILE_ORDER = (
    "test_driver_e2e.py",
    "test_rewards_served_failures.py",  # waits
    "test_sglang_real_restart.py",
    "test_sglang_client.py",  # waits
    "test_sglang_real_sigkill.py",
    "test_sglang_driver_transport.py",  # waits
    "test_sglang_real_torchrun_nodes.py",
    "test_reward_server_supervision.py",  # waits
    "test_torchrun_train.py",
    "test_sglang_hung_server.py",  # waits
    "test_demo_determinism.py",
    "test_torchrun_peer_restart.py",  # waits
    "test_sglang_real_demo.py",
    "test_sglang_weight_sync.py",  # waits
    "test_demo_calculator.py",
    "test_trainer_stop_resume.py",  # waits
    "test_agent_e2e.py",
    "test_rollout_hung_engine.py",  # waits
    "test_reward_model_e2e.py",
    "test_sglang_server.py",  # waits
    "test_convert_roundtrip.py",
    "test_torchrun_watchdog_attempts.py",  # waits
    "test_sglang_real_server.py",
    "test_sglang_driver_engines.py",  # waits
    "test_rewards_served_real_classifier.py",
    "test_survival_forked_children.py",  # waits
    "test_sglang_driver_cluster.py",
    "test_qwen3_e2e.py",
    "test_loss_types_e2e.py",
    "test_cli_bad_inputs.py",
    "test_sglang_routing_replay.py",
    "test_rewards_served_real_judge.py",
    "test_eval_reward_real_classifier.py",
    "test_eval_served.py",
    "test_gpu_check.py",
)


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(FILE_ORDER)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))


@pytest.fixture(scope="session")
def longhand_assets(tmp_path_factory):
    """The longhand demo's model and data (`megatron-dapo demo --task longhand`) after a short warm
    start (150 steps, no probe), built once per session: enough to write both styles, so that the
    long problems' counted-out responses run into the budget, which is what its end-to-end test
    needs; not enough to be a good policy."""
    from megatron_dapo.demo.longhand.assets import prepare_longhand_assets

    return _demo_assets_shared_by_workers(
        tmp_path_factory, "longhand_assets", build=prepare_longhand_assets, sft_steps=150, eval_problems=8
    )
