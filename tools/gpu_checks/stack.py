"""The two whole-stack GPU checks: the real SGLang server colocated on the actor's GPU with the
weight sync over CUDA IPC, and a 2-step colocated DAPO run through the whole stack (the demo
command with ``--engine sglang``: Ray driver, actor rank, SGLang server, weight sync, rewards).

Their CPU-checkable plumbing (the run's overrides validated by the project's config loader, the
transport that colocation on GPUs resolves to, the server's launch command, the mismatch figure)
is the ``stack_plumbing`` check, which also runs in the dry mode.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tools.gpu_checks.runner import CheckFailed, Figure, MissingPiece, check, time_left

# One bound for both checks: mean |log pi_actor - log pi_server| over the scored tokens after a
# sync. Both sides run bf16 kernels that differ (TE vs SGLang's), so bit equality is not expected;
# a sync that did not land leaves the server on the old weights, far above this.
MISMATCH_BOUND = 0.05
DAPO_STEPS = 2
# The demo run: 2 steps, small batches, a 5-step warm start (see dapo_run_main), no plots/export.
DAPO_OVERRIDES = [
    f"trainer.total_steps={DAPO_STEPS}",
    "trainer.train_batch_size=4",
    "rollout.gen_batch_size=4",
    "rollout.n=4",
    "actor.ppo_mini_batch_size=4",
    "data.val_max_samples=8",
    "trainer.save_freq=0",
    "trainer.hf_export_at_end=false",
    "logging.plots_at_end=false",
    "logging.progress=false",
    "algorithm.filter_groups.enable=false",
    "algorithm.allow_partial_batch=false",
    "trainer.placement=colocated",
    "trainer.weight_sync.transport=cuda_ipc",  # the path under test, not whatever auto picks
]


def mismatch(actor_lp, server_lp) -> tuple[float, float]:
    """Mean and max |difference| of two equal-length sequences of log-probs."""
    if len(actor_lp) != len(server_lp) or not len(actor_lp):
        raise CheckFailed(f"log-prob lengths differ or are empty: {len(actor_lp)} vs {len(server_lp)}")
    diffs = [abs(float(a) - float(b)) for a, b in zip(actor_lp, server_lp)]
    return sum(diffs) / len(diffs), max(diffs)


def server_config(hf_dir: str, work: Path, port: int):
    from megatron_dapo.sglang.server import SGLangServerConfig

    # Colocated: the actor (0.5B, bf16, Adam) holds a few GiB; the server's static pool stays small.
    return SGLangServerConfig(
        model_path=hf_dir, port=port, mem_fraction_static=0.3, dtype="bfloat16",
        log_file=str(work / "sglang_colocated.log"), startup_timeout_s=min(300.0, time_left()), max_total_tokens=65536,
    )  # fmt: skip


def server_prefill_logprobs(url: str, sequence: list[int]) -> list[float]:
    """The server's log-probs of tokens 1.. of ``sequence`` given the ones before (its prefill)."""
    import httpx

    body = {
        "input_ids": list(sequence),
        "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    reply = httpx.post(f"{url}/generate", json=body, timeout=300.0)
    reply.raise_for_status()
    return [float(item[0]) for item in reply.json()["meta_info"]["input_token_logprobs"][1:]]


def demo_argv(work: Path) -> list[str]:
    return [
        sys.executable, "-m", "tools.gpu_checks.stack", "--assets", str(work / "demo_assets"),
        f"trainer.runs_dir={work / 'runs'}", *DAPO_OVERRIDES,
    ]  # fmt: skip


def dapo_figures(metrics_jsonl: Path) -> dict:
    """Steps, mismatch per step and engines down from the run's metrics.jsonl; CheckFailed when
    the run did not do what the check asks."""
    if not metrics_jsonl.is_file():
        raise CheckFailed(f"the DAPO run wrote no {metrics_jsonl}")
    records = [json.loads(line) for line in metrics_jsonl.read_text().splitlines() if line.strip()]
    steps = [r for r in records if r.get("step", 0) >= 1]
    if [r["step"] for r in steps] != list(range(1, DAPO_STEPS + 1)):
        raise CheckFailed(f"the DAPO run logged steps {[r['step'] for r in steps]}, not 1..{DAPO_STEPS}")
    diffs = [float(r["actor/rollout_logprob_abs_diff"]) for r in steps]
    down = [int(r.get("rollout/engines_down", 0)) for r in steps]
    if any(d > MISMATCH_BOUND for d in diffs) or any(down):
        raise CheckFailed(
            f"rollout/actor log-prob mismatch per step {diffs} (bound {MISMATCH_BOUND}), engines down {down}"
        )
    return {"steps": len(steps), "rollout_logprob_abs_diff": diffs}


@check("stack_plumbing", needs_cuda=False, budget_s=15)
def stack_plumbing(ctx) -> Figure:
    """What the two stack checks rely on, without a GPU: the run's overrides pass the config
    loader on the demo config, colocation on GPUs resolves to CUDA IPC, the server command."""
    from megatron_dapo.commands.demo import demo_config_path
    from megatron_dapo.config.loader import load_config
    from megatron_dapo.sglang.server import build_launch_command
    from megatron_dapo.sync.sglang_transports import resolve_transport_kind

    hf_dir = ctx.hf_dir("tiny")
    cfg = load_config(demo_config_path(), [f"model.path={hf_dir}", "rollout.engine=sglang", *DAPO_OVERRIDES])
    kind = resolve_transport_kind(cfg, (), gpus=True)
    if kind != "cuda_ipc":
        raise CheckFailed(f"colocated SGLang on GPUs resolves to transport {kind!r}, not cuda_ipc")
    cmd = build_launch_command(server_config(hf_dir, ctx.work, 30000), python="python")
    if cmd[cmd.index("--model-path") + 1] != hf_dir:
        raise CheckFailed(f"server command does not serve {hf_dir}: {cmd}")
    return Figure(f"overrides valid, transport {kind}, server argv of {len(cmd)} items", {"transport": kind})


@check("sglang_colocated_ipc_sync", needs_cuda=True, budget_s=100, needs=("sglang",))
def sglang_colocated_ipc_sync(ctx) -> Figure:
    import torch

    from megatron_dapo.actor.batch import make_actor_batch
    from megatron_dapo.ports import free_port
    from megatron_dapo.sglang.client import SGLangEngine
    from megatron_dapo.sglang.ipc import push_weights_ipc
    from megatron_dapo.sglang.server import SGLangServer, check_launchable, default_server_python
    from megatron_dapo.weights.gather import iter_hf_buckets
    from tools.gpu_checks.checks import _actor, _batch, _parallel, _vocab

    try:
        check_launchable(default_server_python())
    except Exception as e:  # noqa: BLE001 - named as the missing piece
        raise MissingPiece(f"the SGLang server cannot be launched ({e}); use the project's image") from e
    _parallel()
    hf_dir = ctx.hf_dir(ctx.small)
    vocab = _vocab(ctx)
    gen = torch.Generator().manual_seed(3)
    sequence = torch.randint(0, vocab, (96,), generator=gen).tolist()
    prompt_len = 16
    with SGLangServer(server_config(hf_dir, ctx.work, free_port())) as server:
        server.wait_healthy()
        actor = _actor(hf_dir, torch.bfloat16, lr=1e-2)
        actor.update(
            _batch(vocab, [(9, 40), (12, 25), (7, 33), (15, 18)])
        )  # weights move off the served ones
        scored = make_actor_batch(
            [sequence[:prompt_len]], [sequence[prompt_len:]], advantages=torch.zeros(1), group_index=[0]
        )
        actor_lp = actor.compute_logprobs(scored, 1.0)[0, : len(sequence) - prompt_len].tolist()
        before, _ = mismatch(actor_lp, server_prefill_logprobs(server.cfg.url, sequence)[prompt_len - 1 :])
        engine = SGLangEngine(server.cfg.url, name="colocated-0", timeout_s=300.0)
        t0 = time.perf_counter()
        buckets = push_weights_ipc(engine, iter_hf_buckets(actor.model), version=1)
        torch.cuda.synchronize()
        sync_s = time.perf_counter() - t0
        after, worst = mismatch(actor_lp, server_prefill_logprobs(server.cfg.url, sequence)[prompt_len - 1 :])
    values = dict(
        mismatch_before=before, mismatch_after=after, max_abs_after=worst, sync_s=sync_s, buckets=buckets
    )
    if not after < MISMATCH_BOUND or not after < before:
        raise CheckFailed(
            f"after the CUDA-IPC sync mean |log-prob diff| {after:.4f} (bound {MISMATCH_BOUND}; before the sync "
            f"{before:.4f}): the server does not serve the actor's weights"
        )
    return Figure(
        f"mismatch {before:.4f} -> {after:.4f} (max {worst:.4f}) after a {sync_s:.2f} s IPC sync of {buckets} buckets",
        values,
    )


@check("dapo_2_steps_colocated", needs_cuda=True, budget_s=180, needs=("sglang",))
def dapo_2_steps_colocated(ctx) -> Figure:
    argv = demo_argv(ctx.work)
    print("         " + " ".join(argv), flush=True)
    t0 = time.perf_counter()
    log = ctx.work / "dapo_run.log"
    with open(log, "w") as out:
        code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=time_left()).returncode
    seconds = time.perf_counter() - t0
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise CheckFailed(f"the 2-step DAPO run exited {code} after {seconds:.0f} s; log {log}:\n{tail}")
    figures = dapo_figures(ctx.work / "runs" / "demo_dapo_sglang" / "metrics.jsonl")
    figures["seconds"] = seconds
    return Figure(
        f"{figures['steps']} steps in {seconds:.0f} s, rollout/actor mismatch {figures['rollout_logprob_abs_diff']}",
        figures,
    )


def dapo_run_main(argv: list[str]) -> int:
    """``python -m tools.gpu_checks.stack --assets DIR overrides...``: the demo command with the
    real SGLang server and a 5-step warm start (the full demo's warm start is the slow part and
    not what is checked)."""
    import megatron_dapo.demo.assets as assets_module
    from megatron_dapo.cli import main

    build = assets_module.prepare_demo_assets

    def quick_warm_start(out_dir, seed=0, force=False, **kw):
        return build(out_dir, seed, force, **{**kw, "sft_steps": 5, "eval_problems": 8})

    assets_module.prepare_demo_assets = quick_warm_start
    assets = argv[argv.index("--assets") + 1]
    rest = [a for a in argv if a not in ("--assets", assets)]
    return main(
        ["demo", "--engine", "sglang", "--assets", assets, "--bar-gain", "0", "--bar-final", "0", *rest]
    )


if __name__ == "__main__":
    sys.exit(dapo_run_main(sys.argv[1:]))
