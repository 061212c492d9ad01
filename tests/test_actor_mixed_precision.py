"""bf16 mixed precision on CPU: megatron-core's Float16Optimizer (fp32 master copies of bf16
weights) runs here, so its defects are caught without a GPU.

Tolerances: bf16 keeps 8 significant bits, so one rounding of a weight of magnitude |w| moves it
by at most 2^-9 * |w| (half an ulp). The tiny model's weights are below 1 in magnitude (HF init,
std 0.02; norms 1.0), so a weight that only went through rounding differs by at most 2^-9 ~ 2e-3
from its fp32 value, and an update with lr=1e-6 moves a weight by ~lr (Adam's step is ~lr per
coordinate), far below one bf16 ulp of any weight >= 2^-10: the first step must leave the loaded
bf16 weights bitwise unchanged, except weights so small that lr is above their ulp (bounded by
lr + their ulp).
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch

from megatron_dapo.actor.optimizer import guarded_step
from megatron_dapo.actor.spawn import run_ranks

MODEL = dict(family="qwen2", tie_word_embeddings=False, num_layers=2, vocab=200, seed=5)


def _batch():
    from megatron_dapo.actor.batch import make_actor_batch

    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 200, (4,), generator=gen).tolist() for _ in range(4)]
    responses = [torch.randint(0, 200, (5,), generator=gen).tolist() for _ in range(4)]
    return make_actor_batch(
        prompts, responses, advantages=torch.randn(4, generator=gen), group_index=[0, 0, 1, 1]
    )


def _actor(hf_dir, load_weights, lr=1e-6):
    from megatron_dapo.actor.actor import ActorConfig, build_actor
    from megatron_dapo.actor.optimizer import OptimizerSettings

    cfg = ActorConfig(ppo_mini_batch_size=2, micro_batch_max_tokens=64, shuffle=False, seed=1)
    # The non-distributed mixed-precision optimizer (Float16OptimizerWithFloat16Params) is the
    # one under test; the distributed one keeps its masters elsewhere (test_checkpoint_distributed_optimizer).
    optim = OptimizerSettings(
        lr=lr, weight_decay=0.0, adam_eps=1e-8, lr_warmup_steps=0, use_distributed_optimizer=False
    )
    return build_actor(
        hf_dir, cfg, optim, total_updates=4, params_dtype=torch.bfloat16, load_weights=load_weights
    )


def _float16_optimizers(optimizer):
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o for o in inner if isinstance(o, Float16OptimizerWithFloat16Params)]


def _master_gap(optimizer) -> float:
    """max |model param - its fp32 master| over every bf16 param the optimizer owns."""
    gap = 0.0
    for opt in _float16_optimizers(optimizer):
        for models, masters in zip(opt.float16_groups, opt.fp32_from_float16_groups):
            for p, m in zip(models, masters):
                gap = max(gap, float((p.detach().float() - m.detach()).abs().max()))
    return gap


def _params(actor) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for c in actor.model for n, p in c.named_parameters()}


def _rank(rank, world, hf_dir, work):
    from megatron_dapo.actor.checkpoint import load_checkpoint, save_checkpoint
    from megatron_dapo.actor.parallel import init_parallel
    from megatron_dapo.weights.dist_ckpt import load_model_checkpoint, save_model_checkpoint

    init_parallel(tp=world, pp=1, seed=3)
    out = {}
    src = _actor(hf_dir, load_weights=True)
    out["optimizers"] = len(_float16_optimizers(src.optimizer))
    out["dtypes"] = sorted({str(p.dtype) for c in src.model for p in c.parameters()})
    save_model_checkpoint(src.model, Path(work) / "model", hf_dir=hf_dir)
    loaded = _params(src)

    # Start from a megatron checkpoint (model.megatron_path): the model is built at random init.
    fresh = _actor(hf_dir, load_weights=False)
    # The model-only load as such (what the worker did before the fix) leaves the masters behind.
    load_model_checkpoint(fresh.model, Path(work) / "model")
    out["gap_raw_load"] = _master_gap(fresh.optimizer)
    fresh.load_model_weights(Path(work) / "model")
    out["gap_after_load"] = _master_gap(fresh.optimizer)
    fresh.update(_batch())
    after = _params(fresh)
    out["moved_by_first_step"] = max(
        float((after[k].float() - loaded[k].float()).abs().max()) for k in loaded
    )

    # A training checkpoint (after one update, so Adam has state) loaded without its optimizer.
    src.update(_batch())
    save_checkpoint(Path(work) / "train", 0, src, hf_dir=hf_dir)
    other = _actor(hf_dir, load_weights=False)
    load_checkpoint(other, Path(work) / "train", "auto", load_optimizer=False)
    out["gap_after_model_only_resume"] = _master_gap(other.optimizer)

    # Resume with optimizer in bf16: the resumed step equals the uninterrupted one bitwise.
    src.update(_batch())
    again = _actor(hf_dir, load_weights=False)
    load_checkpoint(again, Path(work) / "train", "auto")
    again.update(_batch())
    a, b = _params(src), _params(again)
    out["resume_max_diff"] = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def result(tiny_hf_checkpoint, tmp_path_factory):
    hf_dir = str(tiny_hf_checkpoint(**MODEL))
    work = tmp_path_factory.mktemp("bf16")
    raw = run_ranks(_rank, 2, hf_dir, str(work), timeout_s=900)
    return torch.load(io.BytesIO(raw[0]), weights_only=False)


def test_bf16_on_cpu_uses_fp32_master_params(result):
    assert result["dtypes"] == ["torch.bfloat16"]
    assert result["optimizers"] >= 1


def test_model_only_load_refreshes_master_params(result):
    # A bare model load leaves the masters at the random init (the issue measured a gap of 0.64).
    assert result["gap_raw_load"] > 0.05
    assert result["gap_after_load"] == 0.0
    assert result["gap_after_model_only_resume"] == 0.0


def test_first_step_after_load_keeps_the_loaded_weights(result):
    # lr=1e-6: a step moves a weight by ~1e-6 in fp32, i.e. by at most one bf16 ulp of the
    # smallest weights (see the module docstring); writing the random init back moves it by ~0.1.
    assert result["moved_by_first_step"] < 1e-3


def test_bf16_resume_is_bitwise_identical(result):
    assert result["resume_max_diff"] == 0.0


# ---------------------------------------------------------------- defect 2: fp16 double unscale
class _Config:
    clip_grad = 0.0
    use_precision_aware_optimizer_no_fp8_or_ds_fp8 = False


class _ScalingOptimizer:
    """The call structure of megatron's MixedPrecisionOptimizer with a loss scale of 2**16:
    prepare_grads unscales the main grad and updates the scaler, step() = prepare_grads + clip +
    step_with_ready_grads."""

    def __init__(self):
        self.config = _Config()
        self.scale = 2.0**16
        self.main_grad = 3.0 * self.scale  # the scaled gradient backward left behind
        self.scaler_updates = 0
        self.applied = None

    def prepare_grads(self):
        self.main_grad /= self.scale
        self.scaler_updates += 1
        return False

    def get_grad_norm(self):
        return abs(self.main_grad)

    def get_parameters(self):
        return []

    def step_with_ready_grads(self):
        self.applied = self.main_grad
        return True

    def step(self):
        self.prepare_grads()
        return self.step_with_ready_grads(), self.get_grad_norm(), 0

    def zero_grad(self):
        self.main_grad = 0.0


class _Scheduler:
    steps = 0

    def step(self, n):
        self.steps += n


def test_guarded_step_unscales_once():
    opt, sched = _ScalingOptimizer(), _Scheduler()
    outcome = guarded_step(opt, sched, loss=0.5)
    assert outcome.updated and math.isclose(outcome.grad_norm, 3.0)
    assert opt.applied == 3.0  # not 3 / 2**16
    assert opt.scaler_updates == 1
    assert sched.steps == 1
