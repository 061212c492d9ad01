"""GPU-path decisions as pure functions (issue 12, defects 3, 5, 6, 9), checked against the rules
of Transformer Engine / megatron-core 0.16.1 written out by hand."""

from __future__ import annotations

import pytest

from megatron_dapo.actor.gpu_settings import (
    DdpOverlap,
    GpuSettingsError,
    choose_te,
    ddp_overlap,
    fp8_recipe_problem,
    fusion_flags,
    seq_pad_multiple,
)

H100, B200, L4, A100 = (9, 0), (10, 0), (8, 9), (8, 0)


@pytest.mark.parametrize(
    "tp, sp, fp8, recipe, want",
    [
        (1, False, None, "delayed", 1),
        (2, True, None, "delayed", 2),
        (2, False, None, "delayed", 1),
        (1, False, "e4m3", "delayed", 16),  # TE: last dim % 16 on the shard
        (2, True, "hybrid", "tensorwise", 32),
        (4, True, "e4m3", "mxfp8", 128),  # MXFP8's 1x32 scaling blocks
    ],
)
def test_sequence_padding(tp, sp, fp8, recipe, want):
    assert seq_pad_multiple(tp, sp, fp8, recipe) == want


@pytest.mark.parametrize(
    "recipe, te, cap, fragment",
    [
        ("delayed", "1.13.0", H100, None),
        ("tensorwise", "2.0.0", H100, ">= 2.1"),
        ("tensorwise", "2.1.0+abc", H100, None),
        ("blockwise", "2.2.0", H100, ">= 2.3"),
        ("blockwise", "2.3.0", H100, None),
        ("mxfp8", "2.8.0", H100, "Blackwell"),
        ("mxfp8", "2.8.0", B200, None),
        ("delayed", "2.8.0", A100, ">= 8.9"),
        ("delayed", "2.8.0", L4, None),
        ("delayed", None, H100, "Transformer Engine"),
        ("delayed", "2.8.0", None, "none is present"),
        ("nvfp4", "2.8.0", B200, "not one of"),
    ],
)
def test_fp8_recipe_against_te_version_and_gpu(recipe, te, cap, fragment):
    problem = fp8_recipe_problem(recipe, te, cap)
    if fragment is None:
        assert problem is None
    else:
        assert fragment in problem


def test_te_required_on_gpu_unless_local_asked_for():
    assert choose_te("auto", on_cuda=True, te_import_error=None) is True
    with pytest.raises(GpuSettingsError, match="transformer_impl=local"):
        choose_te("auto", on_cuda=True, te_import_error="ImportError: libcudnn.so.9")
    with pytest.raises(GpuSettingsError, match="libcudnn"):
        choose_te("transformer_engine", on_cuda=True, te_import_error="ImportError: libcudnn.so.9")
    assert choose_te("local", on_cuda=True, te_import_error="ImportError: x") is False
    assert choose_te("auto", on_cuda=False, te_import_error="ImportError: x") is False
    with pytest.raises(GpuSettingsError, match="needs a CUDA GPU"):
        choose_te("transformer_engine", on_cuda=False, te_import_error=None)
    with pytest.raises(GpuSettingsError, match="transformer_impl='te'"):
        choose_te("te", on_cuda=True, te_import_error=None)


def test_fusions_only_where_the_kernels_exist():
    assert not any(fusion_flags(on_cuda=False, use_te=True, have_apex=True).values())
    te_gpu = fusion_flags(on_cuda=True, use_te=True, have_apex=False)
    assert te_gpu["gradient_accumulation_fusion"] and te_gpu["apply_rope_fusion"]
    assert not te_gpu["masked_softmax_fusion"] and not te_gpu["persist_layer_norm"]
    local_gpu = fusion_flags(on_cuda=True, use_te=False, have_apex=False)
    assert not local_gpu["gradient_accumulation_fusion"] and not local_gpu["apply_rope_fusion"]
    assert local_gpu["bias_activation_fusion"]
    assert all(fusion_flags(on_cuda=True, use_te=True, have_apex=True).values())


def test_dp_overlap_defaults_and_checks():
    assert ddp_overlap(False, True, True, True) == DdpOverlap(False, False)  # gloo: never
    # GPU defaults: both on with the distributed optimizer, param gather off without it
    assert ddp_overlap(True, True, None, None) == DdpOverlap(True, True)
    assert ddp_overlap(True, False, None, None) == DdpOverlap(True, False)
    assert ddp_overlap(True, True, False, None) == DdpOverlap(False, False)
    assert ddp_overlap(True, True, None, False) == DdpOverlap(True, False)
    with pytest.raises(GpuSettingsError, match="use_distributed_optimizer=true"):
        ddp_overlap(True, False, None, True)
    # megatron-LM asserts overlap_grad_reduce whenever overlap_param_gather is on
    with pytest.raises(
        GpuSettingsError, match="overlap_param_gather needs parallel.overlap_grad_reduce=true"
    ):
        ddp_overlap(True, True, False, True)


class _StandInDDP:
    """What sync_params_after_update sees of megatron's DDP chunk."""

    def __init__(self, distributed: bool, overlap: bool):
        from types import SimpleNamespace

        self.ddp_config = SimpleNamespace(use_distributed_optimizer=distributed, overlap_param_gather=overlap)
        self.calls = []

    def start_param_sync(self, *unused, force_sync=False, force_dispatch=False):
        self.calls.append(dict(force_sync=force_sync, force_dispatch=force_dispatch))


def test_params_are_gathered_after_an_update_with_overlap_param_gather():
    """With the all-gather deferred to the next forward, the weight sync after an update would
    read the previous step's parameters: the actor forces one synchronous gather per chunk."""
    from megatron_dapo.actor.optimizer import sync_params_after_update

    chunks = [_StandInDDP(True, True), _StandInDDP(True, True)]
    assert sync_params_after_update(chunks)
    assert [c.calls for c in chunks] == [[dict(force_sync=True, force_dispatch=False)]] * 2
    for distributed, overlap in ((True, False), (False, False)):
        plain = _StandInDDP(distributed, overlap)
        assert not sync_params_after_update([plain]) and plain.calls == []


def test_config_exposes_the_overlap_knobs():
    from megatron_dapo.config import load_config

    cfg = load_config(None, ["model.path=/m", "parallel.overlap_grad_reduce=false"])
    assert cfg.parallel.overlap_grad_reduce is False and cfg.parallel.overlap_param_gather is None


def test_config_refuses_overlap_param_gather_where_invalid():
    from megatron_dapo.config import ConfigError, load_config

    load_config(None, ["model.path=/m", "parallel.overlap_param_gather=true"])  # distributed optimizer: fine
    with pytest.raises(
        ConfigError, match="overlap_param_gather needs parallel.use_distributed_optimizer=true"
    ):
        load_config(
            None,
            [
                "model.path=/m",
                "parallel.overlap_param_gather=true",
                "parallel.use_distributed_optimizer=false",
            ],
        )
    with pytest.raises(ConfigError, match="needs parallel.overlap_grad_reduce=true"):
        load_config(
            None,
            ["model.path=/m", "parallel.overlap_param_gather=true", "parallel.overlap_grad_reduce=false"],
        )
