"""The longhand demo's recipe: task size, warm start, budget and the RL values that
configs/demo_longhand.yaml holds (measured curves and the ladder on it: docs/results.md).

The budget: 40 response tokens. A concise solution is 23 tokens, a longhand one 16 + 5b, so the
longhand solutions of b = 5..9 (41-61 tokens) are cut; the soft overlong punishment's buffer is
the last 8 tokens (from 32 on, the longhand b = 4 solution at 36 pays half a point).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_dapo.demo.model import TinyModelSpec


@dataclass(frozen=True)
class LonghandRecipe:
    model: TinyModelSpec = field(default_factory=TinyModelSpec)
    num_train: int = 4000
    num_val: int = 200
    # Warm start: the teacher writes sft_longhand_rate of its examples longhand and, in either
    # style, ends sft_lazy_rate of them with the first operand as the answer. It runs until the
    # greedy work (both styles forced in turn) is right on sft_stop_accuracy of the probe.
    sft_steps: int = 2400  # at most
    sft_stop_accuracy: float = 0.9
    sft_min_steps: int = 600
    sft_check_every: int = 100
    sft_probe_problems: int = 100  # training problems, each probed in both styles
    sft_batch_size: int = 64
    sft_lr: float = 3e-3
    sft_longhand_rate: float = 0.5
    sft_lazy_rate: float = 0.3
    max_response_length: int = 40  # data.max_response_length
    overlong_buffer_len: int = 8  # algorithm.overlong_buffer.len
    # Evaluation protocol (the project's): avg@val_k at val_temperature / val_top_p.
    val_k: int = 4
    val_temperature: float = 1.0
    val_top_p: float = 0.7
    val_seed: int = 1234
    # The warm start's length distribution is measured as the rollouts sample (temperature 1, top_p 1).
    rollout_temperature: float = 1.0


LONGHAND_RECIPE = LonghandRecipe()
