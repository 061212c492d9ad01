"""Which SGLang engines the driver uses: connecting to given URLs (health-checked, dead URL named),
and for launched servers the GPU/port/flag plan per placement (pure; no sglang, no GPU)."""

from __future__ import annotations

import time

import pytest
from omegaconf import OmegaConf
from test_sglang_driver_transport import FakeSGLangServer

from megatron_dapo.config import ConfigError, load_config, to_container
from megatron_dapo.ports import free_port
from megatron_dapo.rollout.engine import EngineError
from megatron_dapo.sglang.engines import server_configs, start_sglang_engines, stop_sglang_engines
from megatron_dapo.sglang.placement import engine_gpu_ids, local_actor_gpus
from megatron_dapo.sglang.server import build_launch_command


def cfg_with(**overrides):
    cfg = load_config(None, ["model.path=/models/qwen"] + [f"{k}={v}" for k, v in overrides.items()])
    return OmegaConf.create(to_container(cfg))


def test_connects_to_given_urls_and_takes_tp_size_from_the_server():
    servers = [FakeSGLangServer(tp_size=2), FakeSGLangServer(tp_size=2)]
    try:
        urls = ",".join(s.url for s in servers)
        cfg = cfg_with(**{"rollout.sglang.urls": f"[{urls}]", "rollout.tensor_parallel_size": 2})
        engines = start_sglang_engines(cfg)
        try:
            assert [e.client.base_url for e in engines] == [s.url for s in servers]
            assert [e.tp_size for e in engines] == [2, 2]
            assert len({e.name for e in engines}) == 2 and all(e.health() for e in engines)
        finally:
            stop_sglang_engines(engines)
    finally:
        for s in servers:
            s.close()


def test_dead_url_fails_clearly_within_the_startup_timeout():
    alive = FakeSGLangServer()
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        cfg = cfg_with(
            **{"rollout.sglang.urls": f"[{alive.url},{dead}]", "rollout.sglang.startup_timeout_s": 1.5}
        )
        start = time.monotonic()
        with pytest.raises(
            EngineError, match=rf"sglang-1@127.0.0.1:\d+ at {dead} is not healthy after .*ConnectError"
        ):
            start_sglang_engines(cfg)
        # the 1.5 s configured, not the 900 s default: generous for a loaded machine
        assert time.monotonic() - start < 60
    finally:
        alive.close()


def test_malformed_url_names_the_config_field():
    with pytest.raises(ConfigError, match=r"rollout.sglang.urls\[0\]='localhost:30000'"):
        start_sglang_engines(cfg_with(**{"rollout.sglang.urls": "[localhost:30000]"}))


def test_gpu_plan_colocated_shares_the_actor_gpus():
    assert engine_gpu_ids("colocated", [0, 1, 2, 3], 4, 2, 2) == [[0, 1], [2, 3]]
    assert engine_gpu_ids("colocated", [0, 1, 2, 3, 4, 5, 6, 7], 8, 8, 1) == [[i] for i in range(8)]
    with pytest.raises(ConfigError, match=r"needs 4 GPUs, but trainer.placement=colocated leaves 2"):
        engine_gpu_ids("colocated", [0, 1], 8, 2, 2)


def test_gpu_plan_disaggregated_takes_the_gpus_after_the_actor():
    assert engine_gpu_ids("disaggregated", [0, 1, 2, 3], 8, 2, 2) == [[4, 5], [6, 7]]
    assert engine_gpu_ids("disaggregated", [0, 1, 2, 3, 4, 5], 8, 1, 2) == [[6, 7]]
    with pytest.raises(ConfigError, match=r"leaves 2: the GPUs after the actor's \(6..7 of 8\)"):
        engine_gpu_ids("disaggregated", list(range(6)), 8, 2, 2)


def test_actor_gpus_from_torchrun_local_world(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert local_actor_gpus(16, 8) == [0, 1, 2, 3]  # 4 ranks per node of a 16-rank world
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert local_actor_gpus(16, 8) == list(range(8))
    assert local_actor_gpus(2, 8) == [0, 1]


def test_server_configs_per_placement(tmp_path):
    cfg = cfg_with(
        **{
            "model.dtype": "bf16",
            "trainer.placement": "disaggregated",
            "trainer.rollout_gpus": 4,
            "rollout.sglang.base_port": 31000,
            "rollout.sglang.api_key": "k",
            "rollout.sglang.mem_fraction_static": 0.8,
            "rollout.sglang.extra_args": "[--context-length,4096]",
        }
    )
    configs = server_configs(cfg, [[4, 5], [6, 7]], tmp_path)
    assert [(c.port, c.base_gpu_id, c.tp_size) for c in configs] == [(31000, 4, 2), (31001, 6, 2)]
    cmd = build_launch_command(configs[1], python="py")
    flag = {a: cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a.startswith("--")}
    assert flag["--model-path"] == "/models/qwen" and flag["--dtype"] == "bfloat16"
    assert flag["--base-gpu-id"] == "6" and flag["--tp-size"] == "2" and flag["--api-key"] == "k"
    assert flag["--mem-fraction-static"] == "0.8" and cmd[-2:] == ["--context-length", "4096"]
    assert "--enable-memory-saver" not in cmd  # its own GPUs: nothing to release for the trainer
    assert configs[0].log_file == str(tmp_path / "engine_0.log")

    colocated = server_configs(cfg_with(**{"trainer.placement": "colocated"}), [[0]], tmp_path)
    assert colocated[0].enable_memory_saver and "--enable-memory-saver" in build_launch_command(colocated[0])
