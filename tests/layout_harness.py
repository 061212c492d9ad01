"""The actor-layout harness shared by the layout tests (fp32, bf16, context parallel): one fixed
rollout batch (4 groups x 2 samples, ragged prompts/responses, one sample masked out of the loss,
pi_old and rollout log-probs near the true ones so clipping, dual-clip and TIS all act), its HF
transformers log-probs, and the actor settings every layout trains with."""

from __future__ import annotations

from dataclasses import replace

import torch

MODEL = dict(family="qwen2", tie_word_embeddings=False, num_layers=2, vocab=250, seed=5)
TEMPERATURE = 0.8
CLIP = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
TIS_CAP = 1.5
BIG, SMALL = 10_000, 24  # token budgets: one micro-batch vs four (checked below)
# environment (tool) tokens inside three responses of the layout batch: sample -> positions
ENV_TOKENS = {0: [2, 3], 2: [3, 4, 5], 5: [1]}
MODES = ("token-mean", "seq-mean-token-mean")


def hf_logprobs(hf_dir, prompts, responses):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p, r in zip(prompts, responses):
            ids = torch.tensor([p + r])
            logits = model(ids).logits[0, len(p) - 1 : len(p) - 1 + len(r)].double() / TEMPERATURE
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1))
    return out


def make_batch(hf_dir):
    from megatron_dapo.actor.batch import make_actor_batch

    gen = torch.Generator().manual_seed(11)
    n = 8
    p_lens = [3, 5, 4, 6, 2, 5, 3, 4]
    r_lens = [6, 2, 8, 3, 5, 7, 1, 4]
    prompts = [torch.randint(0, 250, (k,), generator=gen).tolist() for k in p_lens]
    responses = [torch.randint(0, 250, (k,), generator=gen).tolist() for k in r_lens]
    hf = hf_logprobs(hf_dir, prompts, responses)
    rollout = [(lp + 0.05 * torch.randn(lp.shape, generator=gen, dtype=torch.float64)).tolist() for lp in hf]
    batch = make_actor_batch(
        prompts,
        responses,
        advantages=torch.randn(n, generator=gen),
        group_index=[0, 0, 1, 1, 2, 2, 3, 3],
        rollout_logprobs=rollout,
        loss_mask=[True, True, True, False, True, True, True, True],
    )
    # three samples are multi-turn episodes: tool answers inside the response (sample 0: tokens
    # 2-3, sample 2: 3-5, sample 5: 1) are read by the model but sampled by no one (loss mask 0,
    # rollout log-prob 0.0, as the episode runner writes them), so every layout test also checks
    # that the environment's tokens stay out of every loss, metric and normaliser
    sampled = batch.response_mask.clone()
    for i, gap in ENV_TOKENS.items():
        sampled[i, gap] = False
        batch.rollout_logprobs[i, gap] = 0.0
    batch = replace(batch, response_mask=batch.response_mask & sampled, sampled_mask=sampled)
    r = batch.max_response_len
    old = torch.zeros(n, r, dtype=torch.float64)
    hf_mat = torch.zeros(n, r, dtype=torch.float64)
    for i, lp in enumerate(hf):
        old[i, : len(lp)] = lp + 0.25 * torch.randn(lp.shape, generator=gen, dtype=torch.float64)
        hf_mat[i, : len(lp)] = lp
    return batch, old, hf_mat


def layout_actor(hf_dir, budget, mode, mini_batch=4, params_dtype=torch.float32, lr=1e-2, **extra):
    from megatron_dapo.actor.actor import ActorConfig, build_actor
    from megatron_dapo.actor.optimizer import OptimizerSettings

    settings = dict(
        ppo_mini_batch_size=mini_batch,
        micro_batch_max_tokens=budget,
        loss_agg_mode=mode,
        temperature=TEMPERATURE,
        tis_cap=TIS_CAP,
        shuffle=False,
        **CLIP,
    )
    cfg = ActorConfig(**{**settings, **extra})  # extra may replace a default (tis_cap=None)
    # Adam's first step is lr * g / (|g| + eps): with a small eps, a gradient entry near zero
    # turns fp32 summation-order noise (~1e-7 absolute between layouts) into weight differences
    # of order lr. eps=1e-2, above the clipped gradients, makes the step ~ lr * g / eps: well
    # conditioned, and sensitive to the gradient's scale (a wrong normaliser shows).
    # fully_reshardable: test_context_parallel_resume resumes a CP=2 checkpoint at CP=1, which the
    # distributed optimizer's default dp_reshardable refuses (test_checkpoint_distributed_optimizer).
    optim = OptimizerSettings(
        lr=lr,
        weight_decay=0.1,
        clip_grad=1.0,
        lr_warmup_steps=0,
        adam_eps=1e-2,
        checkpoint_format="fully_reshardable",
    )
    return build_actor(hf_dir, cfg, optim, total_updates=8, params_dtype=params_dtype)


def close(a: float, b: float, rel: float = 1e-6) -> bool:
    """Equal within ``rel`` of the larger magnitude: fp32 summation-order noise between layouts."""
    return abs(a - b) <= rel * max(abs(a), abs(b))
