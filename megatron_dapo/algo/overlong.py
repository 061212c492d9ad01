"""DAPO soft overlong punishment (paper Eq. 13, as verl's DAPO reward manager computes it)."""

from __future__ import annotations

import torch


def overlong_penalty(
    response_lengths: torch.Tensor,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """Per-sample penalty ``min(-(len - (L_max - L_buffer)) / L_buffer * factor, 0)`` (always <= 0).

    Zero up to the expected length ``L_max - L_buffer``, then linear down to ``-factor`` at
    ``L_max``. ``response_lengths`` counts every generated token including the EOS token (verl
    uses the response-mask sum). The penalty is added to the +-1 score.

    Args:
        response_lengths: (B,) integer or float tensor of response lengths.
        max_response_length: L_max, the rollout's max new tokens.
        overlong_buffer_len: L_buffer, 0 < L_buffer <= L_max.
        penalty_factor: scale of the maximal penalty, >= 0.

    Returns:
        (B,) float32 tensor (float64 if the lengths are float64).
    """
    if overlong_buffer_len <= 0:
        raise ValueError(
            f"overlong_buffer_len must be > 0, got {overlong_buffer_len}; disable the overlong penalty "
            "instead of setting its buffer to 0"
        )
    if overlong_buffer_len > max_response_length:
        raise ValueError(
            f"overlong_buffer_len ({overlong_buffer_len}) must be <= max_response_length "
            f"({max_response_length})"
        )
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
    if response_lengths.dim() != 1:
        raise ValueError(f"response_lengths must be 1-D, got shape {tuple(response_lengths.shape)}")
    dtype = torch.promote_types(response_lengths.dtype, torch.float32)
    expected_len = max_response_length - overlong_buffer_len
    exceed = response_lengths.to(dtype) - expected_len
    return torch.clamp(-exceed / overlong_buffer_len * penalty_factor, max=0.0)
