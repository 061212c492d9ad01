"""bf16 mixed precision on CPU: megatron-core's Float16Optimizer (fp32 master copies of bf16
weights) runs here, so its defects are caught without a GPU.

Tolerances: bf16 keeps 8 significant bits, so one rounding of a weight of magnitude |w| moves it
by at most 2^-9 * |w| (half an ulp). The tiny model's weights are below 1 in magnitude (HF init,
std 0.02; norms 1.0), so a weight that only went through rounding differs by at most 2^-9 ~ 2e-3
from its fp32 value, and an update with lr=1e-6 moves a weight by ~lr (Adam's step is ~lr per
coordinate), far below one bf16 ulp of any weight >= 2^-10: the first step must leave the loaded
bf16 weights bitwise unchanged, except weights so small that lr reaches half their ulp (bounded by
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


LR = 1e-6


def _actor(hf_dir, load_weights, lr=LR):
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
    out["first_step"] = {k: (loaded[k], after[k]) for k in loaded}  # bf16, this rank's shards

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
    """Adam's first step moves an fp32 master by at most lr (lr * g / (|g| + eps)); its bf16
    weight is that master rounded, so it stays bitwise unless lr reaches half the bf16 spacing
    below it (a quarter ulp at a power of two). Those weights stay bitwise; the few smaller ones
    move by at most lr + their ulp. Writing the random init back would move them by ~0.1."""
    total = bitwise = 0
    for name, (loaded, after) in result["first_step"].items():
        w, a = loaded.float(), after.float()
        _, exponent = torch.frexp(w)  # |w| = m 2^e with m in [0.5, 1): its bf16 ulp is 2^(e-8)
        ulp = torch.where(w == 0, 0.0, torch.ldexp(torch.ones_like(w), exponent - 8))
        large = ulp / 4 > LR
        assert torch.equal(a[large], w[large]), f"{name}: a weight far above lr moved"
        assert ((a - w).abs()[~large] <= LR * (1 + 2**-7) + ulp[~large]).all(), name
        total, bitwise = total + w.numel(), bitwise + int(large.sum())
    assert bitwise > 0.9 * total, (bitwise, total)  # the bitwise claim covers nearly every weight


def test_bf16_resume_is_bitwise_identical(result):
    assert result["resume_max_diff"] == 0.0


# ---------------------------------------------------------------- defect 2: fp16 double unscale
def _scaling_optimizer():
    """megatron-core's own MixedPrecisionOptimizer (its prepare_grads, step_with_ready_grads and
    step run as they are) with a loss scale of 2**16, on one float instead of tensors: only the
    leaves that touch tensors or process groups are replaced. A change in how megatron composes
    them (what prepare_grads unscales, what step calls) reaches this test."""
    from types import SimpleNamespace

    from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

    class Scaled(MixedPrecisionOptimizer):
        def __init__(self):  # megatron's needs model chunks and process groups
            self.config = SimpleNamespace(
                clip_grad=0.0,
                timers=None,
                log_num_zeros_in_grad=False,
                reuse_grad_buf_for_mxfp8_param_ag=False,
                use_precision_aware_optimizer_no_fp8_or_ds_fp8=False,
            )
            self.is_stub_optimizer = False
            self.scale = 2.0**16
            self.model_grad = 3.0 * self.scale  # the scaled gradient backward left behind
            self.main_grad = None
            self.grad_scaler = SimpleNamespace(updates=0)
            self.grad_scaler.update = lambda found_inf: setattr(
                self.grad_scaler, "updates", self.grad_scaler.updates + 1
            )
            self.applied = None
            self.optimizer = SimpleNamespace(step=lambda: setattr(self, "applied", self.main_grad))

        def _copy_model_grads_to_main_grads(self):
            self.main_grad = self.model_grad

        def _unscale_main_grads_and_check_for_nan(self):
            self.main_grad /= self.scale
            return False

        def _copy_main_params_to_model_params(self):
            pass

        def get_grad_norm(self):
            return abs(self.main_grad)

        def get_parameters(self):
            return []

        def zero_grad(self, set_to_none=True):
            self.model_grad = self.main_grad = 0.0

        # abstract in megatron, not reached by a step
        def _collect_main_grad_data_for_unscaling(self):
            raise AssertionError("not reached")

        def _get_model_and_main_params_data_float16(self):
            raise AssertionError("not reached")

        def sharded_state_dict(self, *args, **kwargs):
            raise AssertionError("not reached")

        def state_dict(self):
            raise AssertionError("not reached")

        def load_state_dict(self, state_dict):
            raise AssertionError("not reached")

        def reload_model_params(self, state_dict=None):
            raise AssertionError("not reached")

    return Scaled()


class _Scheduler:
    steps = 0

    def step(self, n):
        self.steps += n


def test_guarded_step_unscales_once():
    opt, sched = _scaling_optimizer(), _Scheduler()
    outcome = guarded_step(opt, sched, loss=0.5)
    assert outcome.updated and math.isclose(outcome.grad_norm, 3.0)  # decided on the unscaled norm
    assert opt.applied == 3.0  # not 3 / 2**16
    assert opt.grad_scaler.updates == 1
    assert sched.steps == 1
