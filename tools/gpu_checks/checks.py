"""The checks, in the order they run. Each builds what it needs from the repo alone (random
weights at real Qwen2.5 shapes on GPU, a tiny shape in dry mode) and returns a :class:`Figure`
or raises :class:`CheckFailed` / :class:`MissingPiece`.

The whole-stack checks (the real SGLang server colocated with CUDA-IPC weight sync, a 2-step
colocated DAPO run) live in :mod:`tools.gpu_checks.stack`, registered after these.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path

from tools.gpu_checks.runner import PIECES, CheckFailed, Figure, MissingPiece, check
from tools.gpu_checks.shapes import MFU_FORMULA, QWEN25, peak_tflops, train_step_flops, write_random_qwen2


@dataclass
class Context:
    work: Path
    dry: bool

    @property
    def small(self) -> str:  # model for correctness checks
        return "tiny" if self.dry else "0.5B"

    def hf_dir(self, size: str) -> str:
        return str(write_random_qwen2(self.work / f"qwen2.5-{size}", size))


def _torch():
    import torch

    return torch


def _parallel():
    from megatron_dapo.actor.parallel import init_parallel

    return init_parallel(tp=1, pp=1, seed=7)


def _batch(vocab: int, lengths: list[tuple[int, int]], seed: int = 0):
    from megatron_dapo.actor.batch import make_actor_batch

    torch = _torch()
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (p,), generator=gen).tolist() for p, _ in lengths]
    responses = [torch.randint(0, vocab, (r,), generator=gen).tolist() for _, r in lengths]
    n = len(lengths)
    return make_actor_batch(
        prompts, responses, advantages=torch.randn(n, generator=gen), group_index=[i // 2 for i in range(n)]
    )


def _actor(
    hf_dir: str, dtype, *, lr: float, adam_eps: float = 1e-8, load_weights: bool = True, **model_kwargs
):
    from megatron_dapo.actor.actor import ActorConfig, build_actor
    from megatron_dapo.actor.optimizer import OptimizerSettings

    cfg = ActorConfig(ppo_mini_batch_size=2, micro_batch_max_tokens=1 << 16, shuffle=False)
    optim = OptimizerSettings(
        lr=lr, weight_decay=0.0, clip_grad=1.0, lr_warmup_steps=0, adam_eps=adam_eps,
        use_distributed_optimizer=True,
    )  # fmt: skip
    return build_actor(
        hf_dir, cfg, optim, total_updates=4, params_dtype=dtype, load_weights=load_weights,
        model_kwargs=model_kwargs or None,
    )  # fmt: skip


def _weights(actor) -> dict:
    from megatron_dapo.weights.model_io import unwrap

    return {n: p.detach().float().clone() for n, p in unwrap(actor.model[0]).named_parameters()}


def _vocab(ctx: Context) -> int:
    return QWEN25[ctx.small]["vocab_size"]


@check("environment", needs_cuda=False, budget_s=15)
def environment(ctx: Context) -> Figure:
    """Versions, and whether Transformer Engine and SGLang are here (their checks say UNAVAILABLE
    when not; that is no failure of this one)."""
    torch = _torch()
    import megatron.core

    values = {"torch": torch.__version__, "megatron_core": megatron.core.__version__}
    if not ctx.dry:
        if not torch.cuda.is_available():
            raise MissingPiece("no CUDA device visible to torch (check the driver and --gpus all)")
        values["gpu"] = torch.cuda.get_device_name(0)
        values["capability"] = list(torch.cuda.get_device_capability(0))
    for key, (_name, module) in PIECES.items():
        values[key] = importlib.util.find_spec(module) is not None
    return Figure(", ".join(f"{k} {v}" for k, v in values.items()), values)


@check("te_vs_local_logits", needs_cuda=True, budget_s=30, needs=("te",))
def te_vs_local_logits(ctx: Context) -> Figure:
    torch = _torch()
    from megatron_dapo.actor.model import build_gpt_model
    from megatron_dapo.weights.load import load_hf_weights

    _parallel()
    hf_dir = ctx.hf_dir(ctx.small)
    ids = torch.randint(0, _vocab(ctx), (2, 257), device="cuda")
    pos = torch.arange(ids.shape[1], device="cuda").unsqueeze(0).expand_as(ids)
    logits = {}
    for name, use_te in (("local", False), ("te", True)):
        chunks = build_gpt_model(hf_dir, params_dtype=torch.float32, use_te=use_te)
        load_hf_weights(chunks, hf_dir)
        with torch.no_grad():
            logits[name] = chunks[0].eval()(ids, pos, None).float()
        del chunks
    diff = float((logits["te"] - logits["local"]).abs().max())
    scale = float(logits["local"].abs().max())
    # fp32 both ways; TE fuses differently (and may use TF32 in attention): 1e-3 of the logit scale.
    if diff > 1e-3 * scale:
        raise CheckFailed(f"max |TE - local| logit = {diff:.3e} > 1e-3 * {scale:.2f}")
    return Figure(
        f"max |TE - local| logit {diff:.2e} (logit scale {scale:.1f})", {"max_abs_diff": diff, "scale": scale}
    )


# Budgets: the H200 run at e4d4e7a measured bf16_step_vs_fp32 28 s and offload_roundtrip 29 s
# in-process; each now also pays its own interpreter start and imports (~10 s).
@check("bf16_step_vs_fp32", needs_cuda=False, budget_s=45)
def bf16_step_vs_fp32(ctx: Context) -> Figure:
    """One update in bf16 (fp32 masters; the distributed optimizer on GPU) against the same update
    in fp32. lr=0.1, adam_eps=1e-2: the first Adam step is ~lr*g/eps, proportional to the gradient
    and far above a bf16 ulp of the weights, so the relative update error measures bf16's gradient
    error (8-bit mantissa: ~2^-8 per op, a few percent after a forward and backward)."""
    torch = _torch()
    _parallel()
    hf_dir = ctx.hf_dir(ctx.small)
    batch = _batch(_vocab(ctx), [(5, 9), (7, 3), (4, 11), (6, 6)])
    deltas = {}
    for dtype in (torch.float32, torch.bfloat16):
        actor = _actor(hf_dir, dtype, lr=0.1, adam_eps=1e-2)
        before = _weights(actor)
        metrics = actor.update(batch)
        if metrics["num_updates"] != 1:
            raise CheckFailed(f"the {dtype} update was skipped: {metrics}")
        after = _weights(actor)
        deltas[dtype] = torch.cat([(after[k] - before[k]).flatten() for k in sorted(before)])
        del actor
    ref = deltas[torch.float32]
    rel = float((deltas[torch.bfloat16] - ref).norm() / ref.norm())
    if not rel < 0.1:
        raise CheckFailed(f"bf16 update differs from fp32 by {rel:.3f} (relative norm) > 0.1")
    return Figure(f"|dW_bf16 - dW_fp32| / |dW_fp32| = {rel:.4f}", {"relative_update_error": rel})


# Ran past 20 s on the H200 (not measured further); it builds two 0.5B actors like the bf16 check.
@check("load_then_step_keeps_weights", needs_cuda=False, budget_s=45)
def load_then_step(ctx: Context) -> Figure:
    """Defect 1: a model-only load must refresh the fp32 masters, so a lr=0 step keeps the loaded
    weights bit for bit."""
    torch = _torch()
    from megatron_dapo.weights.dist_ckpt import save_model_checkpoint

    _parallel()
    hf_dir = ctx.hf_dir(ctx.small)
    src = _actor(hf_dir, torch.bfloat16, lr=0.0)
    ckpt = ctx.work / "defect1"
    save_model_checkpoint(src.model, ckpt)
    wanted = _weights(src)
    fresh = _actor(hf_dir, torch.bfloat16, lr=0.0, load_weights=False)
    fresh.load_model_weights(ckpt)
    fresh.update(_batch(_vocab(ctx), [(5, 9), (7, 3), (4, 11), (6, 6)]))
    after = _weights(fresh)
    moved = max(float((after[k] - wanted[k]).abs().max()) for k in wanted)
    if moved != 0.0:
        raise CheckFailed(f"a lr=0 step after the load moved the weights by up to {moved:.3e}")
    return Figure("max |W after lr=0 step - W loaded| = 0", {"max_moved": moved})


@check("fp8_step_odd_lengths", needs_cuda=True, budget_s=30, needs=("te",))
def fp8_step(ctx: Context) -> Figure:
    torch = _torch()
    _parallel()
    hf_dir = ctx.hf_dir(ctx.small)
    recipe = "mxfp8" if torch.cuda.get_device_capability(0)[0] >= 10 else "delayed"
    actor = _actor(hf_dir, torch.bfloat16, lr=1e-5, fp8="hybrid", fp8_recipe=recipe)
    metrics = actor.update(_batch(_vocab(ctx), [(13, 37), (5, 101), (29, 7), (3, 59)]))
    if metrics["num_updates"] != 1:
        raise CheckFailed(f"FP8 ({recipe}) update with odd sequence lengths was skipped: {metrics}")
    return Figure(
        f"FP8 {recipe} step ok, grad norm {metrics['grad_norm_max']:.3f}",
        {"recipe": recipe, "grad_norm": metrics["grad_norm_max"]},
    )


@check("offload_roundtrip", needs_cuda=True, budget_s=45)
def offload_roundtrip(ctx: Context) -> Figure:
    torch = _torch()
    from megatron_dapo.actor.offload import offload_actor, onload_actor

    _parallel()
    actor = _actor(ctx.hf_dir(ctx.small), torch.bfloat16, lr=1e-5)
    actor.update(_batch(_vocab(ctx), [(5, 9), (7, 3), (4, 11), (6, 6)]))  # optimizer state exists
    before = _weights(actor)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    offload_actor(actor.model, actor.optimizer, params=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    freed = held - torch.cuda.memory_allocated()
    onload_actor(actor.model, actor.optimizer)
    torch.cuda.synchronize()
    after = _weights(actor)
    same = all(torch.equal(before[k], after[k]) for k in before)
    n_params = sum(v.numel() for v in before.values())
    # bf16 params (2 B) + fp32 masters and Adam moments (12 B) + grads leave: at least 14 B/param.
    if freed < 14 * n_params * 0.9 or not same:
        raise CheckFailed(
            f"offload freed {freed / 2**30:.2f} GiB for {n_params / 1e9:.2f} B params; weights equal after onload: {same}"
        )
    return Figure(
        f"freed {freed / 2**30:.2f} GiB ({freed / n_params:.1f} B/param), weights restored",
        {"bytes_freed": freed, "params": n_params},
    )


# Not measured: it ran out of memory on the H200 before the SDPA attention (issue 27).
@check("mfu_bf16_1.5B", needs_cuda=True, budget_s=60)
def mfu(ctx: Context) -> Figure:
    torch = _torch()
    from megatron_dapo.actor.model import build_gpt_model

    _parallel()
    shape = QWEN25["1.5B"]
    (model,) = build_gpt_model(ctx.hf_dir("1.5B"), params_dtype=torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    mbs, seq = 4, 4096
    ids = torch.randint(0, shape["vocab_size"], (mbs, seq), device="cuda")
    pos = torch.arange(seq, device="cuda").unsqueeze(0).expand(mbs, seq)
    labels = torch.roll(ids, -1, dims=1)

    def step():
        model(ids, pos, None, labels=labels).float().mean().backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    iters = 10
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / iters
    flops = train_step_flops(n_params, shape["num_hidden_layers"], shape["hidden_size"], seq, mbs * seq)
    tflops = flops / dt / 1e12
    peak = peak_tflops(torch.cuda.get_device_name(0))
    mfu_v = tflops / peak if peak else float("nan")
    print(
        f"         {MFU_FORMULA}; N={n_params}, L={shape['num_hidden_layers']}, h={shape['hidden_size']}, s={seq}, tokens={mbs * seq}, step={dt:.4f} s, peak={peak} TFLOP/s"
    )
    return Figure(
        f"{tflops:.0f} TFLOP/s, MFU {100 * mfu_v:.1f}%",
        {"tflops": tflops, "mfu": mfu_v, "step_s": dt, "formula": MFU_FORMULA},
    )


# Registered last: they start servers and a whole run, after the cheaper checks have passed.
from tools.gpu_checks import routing, run, stack  # noqa: E402, F401
