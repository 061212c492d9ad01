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
    assert ddp_overlap(True, True, None, None) == DdpOverlap(True, False)
    assert ddp_overlap(True, True, False, True) == DdpOverlap(False, True)
    with pytest.raises(GpuSettingsError, match="use_distributed_optimizer=true"):
        ddp_overlap(True, False, None, True)


def test_config_exposes_the_overlap_knobs():
    from megatron_dapo.config import load_config

    cfg = load_config(None, ["model.path=/m", "parallel.overlap_grad_reduce=false"])
    assert cfg.parallel.overlap_grad_reduce is False and cfg.parallel.overlap_param_gather is None
