"""Decisions that differ between the GPU path and the CPU path, as pure functions of what the
machine has (CUDA, Transformer Engine and its version, apex, compute capability), so that each is
tested on CPU. CPU/GPU differences of the actor live here and in :mod:`compat` (patches):

1. Sequence padding (:func:`seq_pad_multiple`): TP with sequence parallelism splits the sequence
   over TP ranks; FP8 GEMMs in Transformer Engine assert 16-aligned dims on each shard (MXFP8's
   1x32 scaling blocks need 32), so with FP8 lengths are padded to 16*TP (32*TP for MXFP8).
2. FP8 recipe support (:func:`fp8_recipe_problem`): delayed scaling works with any TE that
   megatron-core 0.16 accepts; tensorwise (current) scaling needs TE >= 2.1, blockwise >= 2.3,
   MXFP8 a Blackwell GPU (compute capability >= 10.0).
3. Transformer Engine (:func:`choose_te`): on CUDA the TE spec is required unless
   ``model.transformer_impl=local`` was asked for: the local spec computes attention as an fp32
   [batch, heads, seq, seq] matrix (no flash attention), which runs out of memory or crawls at
   DAPO's 20k-token responses, so silently falling back to it is a trap. On CPU TE cannot run.
4. Fusions (:func:`fusion_flags`): each is on only where its kernel exists: gradient-accumulation
   fusion needs CUDA and TE (its wgrad GEMM accumulates into main_grad), RoPE fusion needs TE,
   masked-softmax and persistent layer-norm fusions need apex's CUDA kernels, bias-SwiGLU fusion
   (torch.jit) needs CUDA. All are off on CPU, so there megatron loads without torch's compiler
   (its ``jit_fuser`` stays eager: :mod:`mcore_import`).
5. DP communication overlap (:func:`ddp_overlap`): overlap_grad_reduce (bucketed all-reduce /
   reduce-scatter started during backward) on by default on GPU, always off on CPU (gloo runs the
   plain path). overlap_param_gather (the distributed optimizer's parameter all-gather deferred
   to the next forward's pre-hooks) is on by default where megatron allows it: GPU, distributed
   optimizer and overlap_grad_reduce (megatron-LM's arguments assert both). Whatever reads the
   parameters outside a forward (weight sync, checkpoint save, HF export) would see the previous
   step's values, so the actor forces the all-gather once its update ends
   (``optimizer.sync_params_after_update``); the mini-batch steps inside an update keep the
   overlap. align_param_gather stays off (each pipeline stage gathers as its forward needs), so
   the schedule needs no ``param_sync_func``.
6. Context parallelism: on GPU the TE layer spec's ``TEDotProductAttention`` receives megatron's
   CP group (ring attention, megatron's default ``cp_comm_type``) and RoPE is sliced per CP rank
   inside megatron; on CPU the local spec's core attention is replaced by the exact stand-in
   ``cpu_cp_attention.CpuContextParallelAttention`` (``compat`` patch 8). With CP the actor pads
   lengths to ``2 * CP`` times :func:`seq_pad_multiple` (each of the 2*CP chunks stays aligned).
"""

from __future__ import annotations

from dataclasses import dataclass


class GpuSettingsError(ValueError):
    """A GPU-path setting the machine cannot honour."""


def seq_pad_multiple(tp: int, sequence_parallel: bool, fp8: str | None, fp8_recipe: str = "delayed") -> int:
    """The multiple every micro-batch's sequence length is padded to."""
    base = tp if sequence_parallel else 1
    if not fp8:
        return base
    return (32 if fp8_recipe == "mxfp8" else 16) * max(tp, 1)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


_RECIPE_MIN_TE = {"delayed": (0,), "tensorwise": (2, 1), "blockwise": (2, 3), "mxfp8": (2, 0)}


def fp8_recipe_problem(recipe: str, te_version: str | None, capability: tuple[int, int] | None) -> str | None:
    """Why ``recipe`` cannot run here (None when it can). ``capability``: the GPU's (major,
    minor) compute capability, None without CUDA."""
    if recipe not in _RECIPE_MIN_TE:
        return f"fp8_recipe={recipe!r} is not one of {sorted(_RECIPE_MIN_TE)}"
    if capability is None:
        return "fp8 needs a CUDA GPU with compute capability >= 8.9; none is present"
    if capability < (8, 9):
        return (
            f"fp8 needs compute capability >= 8.9 (Ada/Hopper); this GPU is {capability[0]}.{capability[1]}"
        )
    if recipe == "mxfp8" and capability[0] < 10:
        return (
            f"fp8_recipe=mxfp8 needs a Blackwell GPU (>= 10.0); this GPU is {capability[0]}.{capability[1]}"
        )
    if te_version is None:
        return "fp8 needs Transformer Engine (pip install transformer-engine[pytorch])"
    need = _RECIPE_MIN_TE[recipe]
    if _version_tuple(te_version) < need:
        return (
            f"fp8_recipe={recipe} needs Transformer Engine >= {'.'.join(map(str, need))}; "
            f"installed: {te_version} (upgrade TE or use fp8_recipe=delayed)"
        )
    return None


def choose_te(transformer_impl: str, on_cuda: bool, te_import_error: str | None) -> bool:
    """Whether to build the TE layer spec. ``transformer_impl``: auto | transformer_engine |
    local; ``te_import_error``: why ``import transformer_engine.pytorch`` failed (None if it
    worked)."""
    if transformer_impl == "local":
        return False
    if transformer_impl not in ("auto", "transformer_engine"):
        raise GpuSettingsError(
            f"model.transformer_impl={transformer_impl!r}; use auto, transformer_engine or local"
        )
    if not on_cuda:
        if transformer_impl == "transformer_engine":
            raise GpuSettingsError(
                "model.transformer_impl=transformer_engine needs a CUDA GPU; use auto or local on CPU"
            )
        return False
    if te_import_error is not None:
        raise GpuSettingsError(
            f"Transformer Engine is required on a GPU but cannot be imported ({te_import_error}); the local "
            "spec's fp32 [b, heads, s, s] attention runs out of memory or crawls at long sequences. Install "
            "transformer-engine[pytorch], or set model.transformer_impl=local to accept that"
        )
    return True


def fusion_flags(on_cuda: bool, use_te: bool, have_apex: bool) -> dict[str, bool]:
    """TransformerConfig fusion switches, each on only where its kernel exists here."""
    return {
        "gradient_accumulation_fusion": on_cuda and use_te,
        "apply_rope_fusion": on_cuda and use_te,
        "masked_softmax_fusion": on_cuda and have_apex,
        "persist_layer_norm": on_cuda and have_apex,
        "bias_activation_fusion": on_cuda,
        "bias_dropout_fusion": on_cuda,
    }


@dataclass(frozen=True)
class DdpOverlap:
    overlap_grad_reduce: bool
    overlap_param_gather: bool


def ddp_overlap(
    on_cuda: bool, use_distributed_optimizer: bool, grad_reduce: bool | None, param_gather: bool | None
) -> DdpOverlap:
    """Resolve the overlap knobs (None = the default for this machine: both on where valid)."""
    if not on_cuda:
        return DdpOverlap(False, False)
    grad = True if grad_reduce is None else grad_reduce
    param = use_distributed_optimizer and grad if param_gather is None else param_gather
    if param and not use_distributed_optimizer:
        raise GpuSettingsError(
            "parallel.overlap_param_gather needs parallel.use_distributed_optimizer=true (it overlaps the "
            "distributed optimizer's parameter all-gather); set it to false or turn the distributed optimizer on"
        )
    if param and not grad:
        raise GpuSettingsError(
            "parallel.overlap_param_gather needs parallel.overlap_grad_reduce=true (megatron requires both); "
            "set overlap_param_gather=false or overlap_grad_reduce=true"
        )
    return DdpOverlap(grad, param)


def te_import_error() -> str | None:
    """Why Transformer Engine's pytorch module cannot be imported here (None when it can)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # ImportError, or OSError/RuntimeError from a broken CUDA install
        return f"{type(e).__name__}: {e}"
    return None


def te_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("transformer-engine")
    except Exception:
        try:
            import transformer_engine

            return str(transformer_engine.__version__)
        except Exception:
            return None


def apex_available() -> bool:
    try:
        import fused_layer_norm_cuda  # noqa: F401
        import scaled_masked_softmax_cuda  # noqa: F401
    except Exception:
        return False
    return True
