"""The model's output layer run inside the log-prob kernel, so no ``[tokens, V_local]`` logits
exist (:func:`megatron_dapo.actor.logprobs.fused_linear_logprobs`).

While :func:`hidden_states_out` is active, a GPTModel's output layer hands on its input, the final
hidden states, instead of logits, mapped over the TP ranks exactly as its ``ColumnParallelLinear``
maps its input: sequence-parallel shards are all-gathered (backward: reduce-scatter), otherwise
an identity whose backward all-reduces. GPTModel then returns ``[b, s, h]``. :func:`logprobs`
applies the weight GPTModel's output layer would use (the word embeddings when they are tied,
so their gradient reaches the embedding as before) chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from megatron_dapo.actor.logprobs import DEFAULT_CHUNK_TOKENS, fused_linear_logprobs
from megatron_dapo.weights.model_io import unwrap


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient. GPTModel transposes the output
    layer's result to ``[b, s, ...]``, so the gradient reaching the output layer is a transposed
    view; megatron's input-gradient all-reduce (``mappings._reduce``), next in the backward,
    reduces a contiguous copy of such a view and returns the view unreduced."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _tp_mapped_input(layer: Any, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` as ColumnParallelLinear's matmul sees it, with its input-gradient reduction."""
    from megatron.core import tensor_parallel

    if layer.sequence_parallel:
        hidden = tensor_parallel.gather_from_sequence_parallel_region(
            hidden, tensor_parallel_output_grad=True, group=layer.tp_group
        )
    elif layer.tp_group is not None and layer.tp_group.size() > 1:
        hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden, group=layer.tp_group)
    return _ContiguousGrad.apply(hidden)


@contextmanager
def hidden_states_out(model: Any) -> Iterator[None]:
    """Within it, ``model(...)`` returns the output layer's input ``[b, s, h]`` (every TP rank
    the whole sequence) instead of logits. A no-op on a chunk without the output layer."""
    gpt = unwrap(model)
    layer = getattr(gpt, "output_layer", None) if gpt.post_process else None
    if layer is None:
        yield
        return

    def forward(hidden, weight=None, runtime_gather_output=None):
        return _tp_mapped_input(layer, hidden), None

    layer.forward = forward
    try:
        yield
    finally:
        del layer.forward


def output_weight(model: Any) -> torch.Tensor:
    """The ``[V_local, h]`` weight GPTModel's output layer multiplies by (its ``_postprocess``)."""
    gpt = unwrap(model)
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def logprobs(
    model: Any,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float,
    tp_group,
    with_entropy: bool = True,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy ``labels.shape`` of the output layer applied to ``hidden`` (what
    ``model`` returned under :func:`hidden_states_out`)."""
    return fused_linear_logprobs(
        hidden,
        output_weight(model),
        labels,
        vocab_size=vocab_size,
        temperature=temperature,
        tp_group=tp_group,
        with_entropy=with_entropy,
        chunk_tokens=chunk_tokens,
    )
