"""sampling_seed: SGLang 0.5.23 applies it only under --enable-deterministic-inference, which the
launcher passes by default (rollout.sglang.deterministic) except with the CPU attention backend,
for which the real server refuses the flag at start ("only ascend, fa3, fa4, flashinfer,
intel_xpu, triton attention backends are supported for deterministic inference")."""

from __future__ import annotations

import logging

from omegaconf import OmegaConf

from megatron_dapo.config import load_config, to_container
from megatron_dapo.sglang.engines import server_configs
from megatron_dapo.sglang.server import build_launch_command


def _launch(*overrides):
    cfg = OmegaConf.create(to_container(load_config(None, ["model.path=/m", *overrides])))
    (c,) = server_configs(cfg, [[0]], "/tmp")
    return build_launch_command(c)


def test_launcher_passes_the_flag_so_seeds_act():
    assert "--enable-deterministic-inference" in _launch()


def test_flag_can_be_turned_off():
    assert "--enable-deterministic-inference" not in _launch("rollout.sglang.deterministic=false")


def test_cpu_attention_backend_gets_no_flag_and_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        cmd = _launch("rollout.sglang.extra_args=[--attention-backend,torch_native]")
    assert "--enable-deterministic-inference" not in cmd
    assert "ignores sampling_seed" in caplog.text
