"""Run megatron-core 0.16 on machines without CUDA (CPU tensors, gloo collectives).

Megatron-core assumes CUDA in a handful of places. When ``torch.cuda.is_available()`` is False,
:func:`apply_cpu_compat` installs the patches below, each as narrow as the assumption it removes;
with CUDA present it does nothing, so GPU runs execute megatron-core unmodified. Every patch wraps
the original object (nothing is copied out of megatron-core), and every CPU/GPU difference of the
actor lives in this file.

Patches (all installed together, once per process):

1. ``torch.cuda.current_device`` -> returns ``torch.device("cpu")``. Megatron creates buffers with
   ``device=torch.cuda.current_device()`` in RoPE (inv_freq), tensor-parallel all-gather/reduce
   scatter outputs (``tensor_parallel.mappings``), vocab-parallel embedding/linear layers, GPT
   rotary setup, attention and pipeline p2p shape tensors. On a CPU-only torch build the original
   can only raise, so redirecting it changes no working behaviour.
2. ``torch.cuda.synchronize`` -> no-op. Called after ``batch_isend_irecv`` in pipeline p2p
   (``pipeline_parallel.p2p_communication``) and in DDP buffer helpers; CPU ops are synchronous.
3. ``device="cuda"`` literals: the module-level name ``torch`` inside
   ``pipeline_parallel.schedules`` (``total_num_tokens`` counters), ``optimizer.optimizer``
   (``found_inf`` / ``_scale`` tensors of the fp32 and mixed-precision optimizers),
   ``optimizer.clip_grads`` (grad-norm buffers), ``transformer.utils`` (default causal mask of
   the local softmax) and ``megatron.core.utils`` (``local_multi_tensor_l2_norm``, the grad norm
   used without apex/TE) is replaced by a proxy that forwards everything to ``torch`` but rewrites
   ``device="cuda[:N]"`` to ``"cpu"`` in the tensor factories (tensor, zeros, ones, empty, full,
   arange). Only those five modules see the proxy.
4. CUDA RNG tracker: megatron's ``CudaRNGStatesTracker`` snapshots ``torch.cuda`` generator states.
   :class:`CpuRNGStatesTracker` keeps the same named streams (data-parallel, model-parallel,
   expert-parallel) as CPU generator states and is installed as megatron's tracker, so
   ``get_cuda_rng_tracker().fork()`` (dropout in TP regions, weight init) and
   ``model_parallel_cuda_manual_seed`` work. :func:`model_parallel_manual_seed` seeds it.
5. ``param.type() == 'torch.cuda.FloatTensor'`` checks: ``clip_grad_by_total_norm_fp32`` (grad
   clipping) and ``Float16OptimizerWithFloat16Params.__init__`` (bf16 params with fp32 main
   params) assert CUDA tensor type strings. They are wrapped so that, for the duration of that
   call only, ``Tensor.type()`` (no arguments) of a CPU tensor reports the CUDA type string of the
   same dtype.
6. ``LanguageModule.setup_embeddings_and_output_layer`` moves the tied embedding copy of the last
   pipeline stage with ``weight.data.cuda()`` before the first/last-stage all-reduce (tied
   embeddings with PP > 1). It is wrapped so that ``Tensor.cuda()`` returns the tensor itself
   during that call.

7. MoE (``_apply_moe_cpu_compat``, its own section at the end of this file). megatron-core 0.16's
   alltoall token dispatcher (the one ``variable_seq_lengths`` allows, so the one the train step
   uses) makes exactly two CUDA-stream calls on the training path:
   ``MoEAlltoAllTokenDispatcher.__init__`` creates the class-level ``cuda_dtoh_stream`` with
   ``torch.cuda.Stream()`` when it is None, and ``_maybe_dtoh_and_synchronize`` enters that
   stream, moves the split counts GPU -> CPU (``maybe_move_tensor_to_cpu``, identity for CPU
   tensors) and turns the all-to-all splits into numpy arrays there, then records/synchronises an
   event on it. On CPU the class attribute is set to :class:`CpuDtohStreamStandIn` (so no stream
   is created) and ``_maybe_dtoh_and_synchronize`` does only the numpy conversion (gloo's
   ``all_to_all_single`` takes split sequences, not tensors), without stream or event. The aux-loss tracker's ``device="cuda"`` zeros in
   ``transformer.moe.moe_utils`` get the proxy of patch 3. The router's
   ``torch.cuda.current_device()`` buffers are covered by patch 1; the expert-parallel all-to-all
   itself is ``all_to_all_single``, which gloo implements (uneven splits included).
8. Context parallelism (``cpu_context_parallel_spec``, its own section at the end of this file).
   megatron-core 0.16's local ``DotProductAttention`` asserts ``context_parallel_size == 1``; on
   CPU with CP > 1 the layer spec's core attention is ``cpu_cp_attention.CpuContextParallelAttention``,
   an exact (not fast) stand-in for TE's ring attention: K/V all-gathered over the CP group, causal
   mask from the global positions of the load-balanced chunks. On GPU TE's attention is used.
   RoPE's per-CP-rank slice (``rope_utils.get_pos_emb_on_this_cp_rank``) pins and ``.cuda()``-moves
   its chunk index: on CPU pinning is dropped and ``.cuda()`` is the identity for that call.
9. Sequence parallelism with the local spec (``_apply_sp_norm_cpu_compat``). megatron-core 0.16's
   ``WrappedTorchNorm`` (the local spec's norm without apex) asserts ``not sequence_parallel``:
   a torch norm does not mark its weight ``sequence_parallel``, so ``finalize_model_grads``
   would not sum its gradient over the TP ranks, each of which saw only its shard of the
   sequence. On CPU with SP it is built from the config with that flag off and its parameters
   are then marked ``sequence_parallel = True``, exactly what apex's ``FusedLayerNorm`` does on
   GPU. Needed because megatron's MoE layer trains with TP > 1 only under SP.
10. Uneven sequence-parallel gathers (``_apply_uneven_gather_cpu_compat``). With EP x TP the
   alltoall token dispatcher gathers and reduce-scatters the tokens of the expert-TP group with
   per-rank split sizes (``tensor_parallel.mappings._gather_along_first_dim`` /
   ``_reduce_scatter_along_first_dim`` with ``output_split_sizes`` / ``input_split_sizes``),
   as lists of uneven tensors, which NCCL takes and gloo refuses ("invalid tensor size"). On CPU
   those two calls, only when given split sizes, pad every piece to the largest and all-gather
   equal pieces, or all-reduce the whole input and keep this rank's rows: the same values.

11. The distributed optimizer (``use_distributed_optimizer``, the GPU default, so the CPU runs it
   too and its checkpoints are tested here). ``DistributedOptimizer.__init__`` asserts CUDA tensor
   type strings for the model parameters (``_build_model_and_main_param_groups``) and when it
   marks 16-bit parameters' main params as sharded: it runs under the ``Tensor.type()`` rewrite of
   patch 5. Its buffers are created on ``torch.cuda.current_device()`` (patch 1); its
   reduce-scatter of gradients and all-gather of parameters are gloo's, which implements both.

Not patched, because the CPU path does not use them: CUDA graphs, NCCL user buffers, overlapped grad reduce /
param gather streams, ``tensor_parallel.data.broadcast_data``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

_APPLIED = False

_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange")
_DEVICE_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.transformer.utils",
    "megatron.core.utils",
)


def on_cpu() -> bool:
    """True when this process has no CUDA device (the CPU/gloo path)."""
    return not torch.cuda.is_available()


def device() -> torch.device:
    """The device this rank's parameters and activations live on (``cuda:LOCAL_RANK`` or cpu)."""
    if on_cpu():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))


def dist_backend() -> str:
    """torch.distributed backend for this machine: nccl with CUDA, gloo without."""
    return "gloo" if on_cpu() else "nccl"


def _cpu_if_cuda(dev: Any) -> Any:
    if isinstance(dev, str) and dev.startswith("cuda"):
        return "cpu"
    if isinstance(dev, torch.device) and dev.type == "cuda":
        return torch.device("cpu")
    return dev


class _TorchFactoriesRewritten:
    """Stand-in for the ``torch`` module inside one megatron module: same attributes, except that
    the tensor factories' keyword arguments go through the subclass's ``fix_kwargs`` first."""

    def __init__(self, real: Any) -> None:
        self._real = real
        for name in _FACTORIES:
            setattr(self, name, self._wrap(getattr(real, name)))

    def _wrap(self, factory: Callable) -> Callable:
        @functools.wraps(factory)
        def call(*args: Any, **kwargs: Any) -> Any:
            self.fix_kwargs(kwargs)
            return factory(*args, **kwargs)

        return call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _CudaLiteralsOnCpu(_TorchFactoriesRewritten):
    """``torch`` whose tensor factories place ``device="cuda"`` tensors on the CPU."""

    @staticmethod
    def fix_kwargs(kwargs: dict[str, Any]) -> None:
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])


class CpuRNGStatesTracker:
    """Megatron's named RNG streams (``add`` / ``fork`` / ``get_states`` / ``set_states``) kept as
    CPU generator states. ``fork(name)`` swaps the process CPU generator to stream ``name`` and
    back, exactly as the CUDA tracker does with the CUDA generator."""

    def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False):
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = is_inference_rng_tracker
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._current_state_name = "default-rng"

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"rng seed {seed} already used by another stream")
        if name in self.states_:
            raise ValueError(f"rng stream {name!r} already exists")
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"rng stream {name!r} was never added (seed the model-parallel RNG first)")
        orig = torch.get_rng_state()
        orig_name = self._current_state_name
        if orig_name != "default-rng":
            self.states_[orig_name] = orig
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if orig_name != "default-rng":
                orig = self.states_[orig_name]
            torch.set_rng_state(orig)
            self._current_state_name = orig_name


def _install_cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    if not isinstance(mrandom._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker):
        mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def model_parallel_manual_seed(seed: int) -> None:
    """Seed the default generator and megatron's data/model/expert-parallel RNG streams (what
    ``model_parallel_cuda_manual_seed`` does), on the CPU tracker when CUDA is absent. Call after
    parallel_state is initialised."""
    from megatron.core import tensor_parallel

    if on_cpu():
        apply_cpu_compat()
        _install_cpu_rng_tracker()
        torch.manual_seed(seed)
    else:
        torch.manual_seed(seed)
    # On CPU the tracker already exists, so megatron only resets and refills it; its
    # torch.cuda.manual_seed call is a lazy no-op without CUDA.
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    if on_cpu():
        _install_cpu_rng_tracker()


@contextlib.contextmanager
def _tensor_type_reports_cuda() -> Iterator[None]:
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


@contextlib.contextmanager
def _tensor_cuda_is_identity() -> Iterator[None]:
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _within(context: Callable[[], contextlib.AbstractContextManager], fn: Callable) -> Callable:
    if getattr(fn, "_megatron_dapo_compat", False):
        return fn

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with context():
            return fn(*args, **kwargs)

    call._megatron_dapo_compat = True
    return call


def apply_cpu_compat() -> None:
    """Install the CPU patches listed in the module docstring; idempotent; no-op with CUDA."""
    global _APPLIED
    if _APPLIED or not on_cpu():
        return
    import importlib

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None

    for name in _DEVICE_LITERAL_MODULES:
        module = importlib.import_module(name)
        if not isinstance(module.torch, _CudaLiteralsOnCpu):
            module.torch = _CudaLiteralsOnCpu(torch)

    clip_grads = sys.modules["megatron.core.optimizer.clip_grads"]
    optimizer = sys.modules["megatron.core.optimizer.optimizer"]
    wrapped_clip = _within(_tensor_type_reports_cuda, clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = wrapped_clip
    optimizer.clip_grad_by_total_norm_fp32 = wrapped_clip
    f16 = optimizer.Float16OptimizerWithFloat16Params
    f16.__init__ = _within(_tensor_type_reports_cuda, f16.__init__)
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer").DistributedOptimizer
    distrib.__init__ = _within(_tensor_type_reports_cuda, distrib.__init__)

    from megatron.core.models.common.language_module.language_module import LanguageModule

    LanguageModule.setup_embeddings_and_output_layer = _within(
        _tensor_cuda_is_identity, LanguageModule.setup_embeddings_and_output_layer
    )
    _install_cpu_rng_tracker()
    _apply_moe_cpu_compat()
    _apply_cp_cpu_compat()
    _apply_sp_norm_cpu_compat()
    _apply_uneven_gather_cpu_compat()
    _APPLIED = True


# ---- MoE on CPU (patch 7): megatron-core's alltoall token dispatcher without CUDA streams ----


class CpuDtohStreamStandIn:
    """Placeholder for ``MoEAlltoAllTokenDispatcher.cuda_dtoh_stream`` on CPU. Megatron creates a
    CUDA stream there when the attribute is None; with this object set, it creates none. The only
    method that would use it is replaced on CPU (see ``_apply_moe_cpu_compat``), so any use is a
    bug and raises."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"CpuDtohStreamStandIn.{name}: the CPU path must not use a CUDA stream")


def _dtoh_and_synchronize_on_cpu(self: Any, point: str, tokens_per_expert: Any = None) -> Any:
    # The original, at the dispatcher's dtoh point, copies the split counts device -> host on the
    # side stream and turns the all-to-all splits into numpy arrays (all_to_all_single takes
    # sequences, not tensors); then it synchronises on an event. On CPU the counts are host
    # tensors already, so only the numpy conversion is left to do, without stream or event.
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _apply_moe_cpu_compat() -> None:
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = CpuDtohStreamStandIn()
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _dtoh_and_synchronize_on_cpu
    if not isinstance(moe_utils.torch, _CudaLiteralsOnCpu):
        moe_utils.torch = _CudaLiteralsOnCpu(torch)


# ---- Context parallelism on CPU (patch 8): a stand-in for TE's CP attention ----


def cpu_context_parallel_spec(spec: Any, config: Any) -> Any:
    """Patch 8. megatron-core's local attention refuses ``context_parallel_size > 1`` (only TE's
    attention takes a CP group, and TE needs a GPU). On CPU with CP > 1 the layer spec's core
    attention becomes :class:`megatron_dapo.actor.cpu_cp_attention.CpuContextParallelAttention`
    (exact attention over K/V all-gathered across CP); with CUDA, or CP 1, ``spec`` is returned
    unchanged, so the GPU path keeps TE's attention with megatron's CP group."""
    if not on_cpu() or config.context_parallel_size == 1:
        return spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_dapo.actor.cpu_cp_attention import CpuContextParallelAttention

    attention = spec.submodules.self_attention.submodules
    if attention.core_attention is not DotProductAttention:
        raise ValueError(
            f"context parallelism on CPU needs the local spec's DotProductAttention, got {attention.core_attention}"
        )
    attention.core_attention = CpuContextParallelAttention
    return spec


class _NoPinnedMemory(_TorchFactoriesRewritten):
    """``torch`` whose tensor factories drop ``pin_memory=True`` (CPU-only torch has no
    pinned-memory allocator)."""

    @staticmethod
    def fix_kwargs(kwargs: dict[str, Any]) -> None:
        kwargs.pop("pin_memory", None)


def _apply_cp_cpu_compat() -> None:
    """Patch 8, RoPE part: ``rope_utils.get_pos_emb_on_this_cp_rank`` (the CP rank's RoPE chunks)
    builds its chunk index with ``pin_memory=True`` and moves it with ``.cuda()``: on CPU the
    factory drops ``pin_memory`` and ``Tensor.cuda()`` is the identity during that call."""
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    if not isinstance(rope_utils.torch, _NoPinnedMemory):
        rope_utils.torch = _NoPinnedMemory(rope_utils.torch)
    wrapped = _within(_tensor_cuda_is_identity, rope_utils.get_pos_emb_on_this_cp_rank)
    rope_utils.get_pos_emb_on_this_cp_rank = wrapped
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = wrapped


# ---- Sequence parallelism with the local spec's torch norms on CPU (patch 9) ----


def _apply_sp_norm_cpu_compat() -> None:
    import dataclasses

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__
    if getattr(original, "_sp_marked", False):
        return

    def new(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, *args, **kwargs)
        # A shallow copy with SP off only to pass the assertion; the norm keeps no config.
        norm = original(cls, dataclasses.replace(config, sequence_parallel=False), *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    new._sp_marked = True
    WrappedTorchNorm.__new__ = new


# ---- Uneven gathers / reduce-scatters of the EP x TP token dispatcher on gloo (patch 10) ----


def _gather_uneven(input_: torch.Tensor, group: Any, sizes: list[int]) -> torch.Tensor:
    import torch.distributed as dist

    longest = max(sizes)
    padded = input_.new_zeros((longest, *input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    out = input_.new_empty((longest * len(sizes), *input_.shape[1:]))
    dist.all_gather_into_tensor(out, padded.contiguous(), group=group)
    return torch.cat([out[r * longest : r * longest + n] for r, n in enumerate(sizes)])


def _reduce_scatter_uneven(input_: torch.Tensor, group: Any, sizes: list[int]) -> torch.Tensor:
    import torch.distributed as dist

    total = input_.contiguous().clone()
    dist.all_reduce(total, group=group)
    start = sum(sizes[: group.rank()])
    return total[start : start + sizes[group.rank()]].clone()


def _apply_uneven_gather_cpu_compat() -> None:
    from megatron.core.tensor_parallel import mappings

    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim
    if getattr(gather, "_uneven_on_cpu", False):
        return

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        return _gather_uneven(input_, group, list(output_split_sizes))

    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        return _reduce_scatter_uneven(input_, group, list(input_split_sizes))

    gather_along_first_dim._uneven_on_cpu = True
    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim
