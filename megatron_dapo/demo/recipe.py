"""The demo's measured DAPO recipe: model shape, warm start and RL values for configs/demo.yaml.

Measured with a pure-torch DAPO prototype on this task (HF ``generate`` rollouts at T=1.0,
top_p=1.0, math_dapo +-1 reward, ``megatron_dapo.algo`` advantages / policy loss / overlong
penalty, mixed-group filter with up to 3 generation rounds, AdamW), 1 CPU thread per run.

Evaluation protocol (the project's, i.e. the DAPO paper's AIME one): avg@4 sampled at
temperature 1.0 with top_p 0.7 on the 200 held-out problems, sampling seed 1234; the same
protocol gives the "before" (step 0, what ``prepare_demo_assets`` records) and "after" numbers.

The recipe below (warm start until a 200-problem training probe scored the same way, k=1,
reaches 50%; then P=64 prompts x n=8, 8 mini-batches, lr 3e-4 constant, clip 0.2/0.28,
token-mean, 80 steps), held-out accuracy at steps 0, 10, ..., 80:

    seed 0 (warm start stops at 450 steps, probe 52%):
        51.0 66.7 73.3 71.0 79.5 81.6 84.0 84.1 81.8   -> +30.8; >= 80% from step 50
        (T=1.0/top_p=1.0: 40.1 -> 75.0; greedy: 56.5 -> 81.0)
    seed 1 (stops at 475 steps, probe 50.5%):
        43.8 71.5 78.7 83.3 81.2 85.8 81.5 83.9 85.5   -> +41.7; >= 80% from step 30
        (T=1.0/top_p=1.0: 33.9 -> 82.8; greedy: 47.5 -> 86.5)
    seed 2 (stops at 525 steps, probe 55.5%):
        46.0 70.1 82.9 86.0 88.1 90.5 89.7 91.9 86.9   -> +40.9; >= 80% from step 20
        (T=1.0/top_p=1.0: 38.8 -> 85.4; greedy: 50.5 -> 87.5)
    seed 3 (stops at 550 steps, probe 54.5%) MISSES the target:
        45.1 58.6 61.9 64.4 68.8 66.4 67.1 64.9 68.8   -> +23.7, plateau near 67%
        (greedy: 50.0 -> 70.5; its rollouts' train accuracy stalls at ~73% too, against 87-93%
        for seeds 0-2). Nothing tried fixes it: 2 PPO epochs per step -> 70.6% at 80; lr 5e-4
        with warm-up: 57.8% at step 30; lr 2e-4: 62.4 64.4 69.5 69.8 70.8 73.1 (60); n=16 x 64
        prompts: 59.9 58.3 by step 20; probe target 60% (575 steps, start 52.1%): 70.1 69.4 72.8
        74.8 69.9 73.6 (60). Its warm start is lopsided (train accuracy 80% on additions without
        carry, 37.5% on subtractions without borrow; seed 2: 49-57% on all four kinds).
    So 3 of 4 seeds meet "+30 points and >= 80%" within 80 steps; the seed-0 margin is thin.

Consecutive evaluations differ by up to ~5 points (sampling noise on 200 problems plus RL
noise), so the end point is read from the whole curve, not one number. Prototype speed: 1.3-1.7
s per RL step (two generation rounds ~0.7 s, update ~0.6 s) while the machine was lightly
loaded, i.e. ~2 minutes for 80 steps; 4-10 s per step when 5-11 processes shared the 2 cores.
The warm start is 450-550 steps (seeds 0-3): 51-92 s in the prototype under that contention.

Through the real stack (Ray, TP=2, HF engine) with requirements/cpu.lock, same protocol, each
seed from fresh assets (`megatron-dapo demo --seed S`), held-out avg@4 at steps 0, 10, ..., 80:

    seed 0 (warm start stops at 425 steps): 42.6 53.8 60.1 64.2 63.9 69.4 67.6 65.5 70.8
        -> +28.1, MISSES the bar (the issue-11 report: 42.6 -> 71.8 / 73.1)
    seed 2 (475 steps): 45.0 54.8 57.5 61.6 62.6 67.2 65.8 70.0 76.4 -> +31.4, MISSES (< 80%)
    seed 3 (825 steps): 49.2 69.4 75.9 76.1 72.5 77.6 78.2 80.9 82.4 -> +33.1, meets it
    So the prototype's seed-0 result (51.0 -> 81.8) does not carry over: with the locked
    packages its warm start stops at 425 steps instead of 450 and starts seed 0 at 42.6%. The open lever is
    the warm start (a higher or per-kind-balanced probe target), not yet measured on all seeds.

Why these values (same protocol, other runs):
    Warm-start length: the accuracy jumps within ~50 SFT steps around step 400-500 and where
        depends on the seed (fixed 450 steps: seed 0 51.0%, seed 1 33.0%), hence the probe
        target. A lower start does not pay back in 80 steps: target 45% stopped seed 0 at 425
        steps (probe 46%, held-out 36.1%) -> 52.6 62.4 65.1 70.3 68.4 76.4 74.1 76.9 (no 80%);
        seed 1 from 33.0% with lr 5e-4 -> 65.2% at step 80.
    lr: 4e-4 with 40 warm-up updates is behind 3e-4 on both seeds (seed 0: 63.7 71.5 68.4 73.5
        by step 40; seed 1: 65.1 74.6 65.2 73.0 77.2 by step 50); 5e-4 oscillates (seed 1:
        53.0 at 20, 43.6 at 30). (Earlier, at T=1.0/top_p=1.0: 1e-4 is slower, 2e-3 collapses
        in 2 steps: Adam's first updates move every weight by ~lr.)
    n=16 x 32 prompts (same rollouts per step), seed 1: 61.0 63.0 73.3 74.4 by step 40, behind
        n=8 x 64 prompts; 32 prompts x n=8 plateaued near 60% (T=1.0/top_p=1.0 runs).
    16 mini-batches (more, smaller updates): behind 8 on both seeds (seed 1: 60.5 64.0 67.0
        69.1 79.9 by step 50).
    hidden 96 (302k parameters): the warm start needs 575 steps (~2.5x the SFT time) to reach
        the probe and starts at 35.1%; not pursued, since the real stack runs every step on CPU.
    Not varied, because they do not bind here: clip_ratio_high (clip fraction <= 3% at lr
        3e-4) and the overlong buffer (responses are 21-25 tokens, the penalty starts at 28).
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
    # Warm start: a lazy teacher (right worked line, first operand as the answer in sft_lazy_rate
    # of the examples), until the greedy worked line is right on sft_stop_accuracy of the probe.
    sft_steps: int = 2400  # at most; it stops when the probe reaches sft_stop_accuracy
    sft_stop_accuracy: float = 0.9
    sft_min_steps: int = 800
    sft_check_every: int = 100
    sft_probe_problems: int = 200  # training problems, greedy worked line checked
    sft_batch_size: int = 64
    sft_lr: float = 3e-3
    sft_lazy_rate: float = 0.5
    # DAPO
    train_prompts_per_step: int = 64  # data.train_batch_size
    n_samples: int = 8  # rollout.n
    mini_batches_per_step: int = 8  # ppo_mini_batch_size = 64 / 8 = 8 prompts (64 responses)
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
    steps: int = 40
    val_every: int = 10
    # Evaluation protocol (the DAPO paper's AIME one): avg@val_k sampled at val_temperature / val_top_p.
    val_k: int = 4
    val_temperature: float = 1.0
    val_top_p: float = 0.7
    val_seed: int = 1234  # sampling seed of the held-out check, so its "before" matches the curves above


DEMO_RECIPE = DemoRecipe()
