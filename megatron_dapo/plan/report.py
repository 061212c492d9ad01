"""Render a Plan as rich tables (or plain text when the console is not a terminal)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from megatron_dapo.plan.memory import GIB
from megatron_dapo.plan.planner import Plan


def _g(x: float) -> str:
    return f"{x / GIB:.1f}"


def _hms(s: float) -> str:
    return f"{s / 60:.1f} min" if s >= 60 else f"{s:.0f} s"


def render(plan: Plan, console: Console) -> None:
    """Print the plan: model, roles, actor memory per stage, engine memory, checks, time, assumptions."""
    p, shape, roles = plan.inputs, plan.shape, plan.roles
    head = Table(
        title=f"megatron-dapo plan: {shape.name} on {roles.total_gpus} x {plan.gpu.name}", show_header=False
    )
    head.add_row("parameters", f"{plan.total_params:,} ({plan.total_params / 1e9:.2f} B)")
    if plan.shape.num_experts:
        head.add_row(
            "active parameters",
            f"{plan.active_params:,} ({plan.active_params / 1e9:.2f} B; top-{plan.shape.moe_topk} of "
            f"{plan.shape.num_experts} experts, EP={plan.inputs.ep})",
        )
    head.add_row(
        "shape",
        f"h={shape.hidden_size} ffn={shape.intermediate_size} layers={shape.num_layers} heads={shape.num_heads} "
        f"kv={shape.num_kv_heads} vocab={shape.vocab_size} tied={shape.tie_word_embeddings}",
    )
    place = "colocated (time-shared)" if roles.colocated else "disaggregated"
    head.add_row("placement", place)
    head.add_row(
        "actor",
        f"{roles.actor_gpus} GPUs: TP={p.tp} PP={p.pp}{f' VPP={p.vpp}' if p.vpp else ''} CP={p.cp} DP={p.dp}, "
        f"SP={p.sequence_parallel}, recompute={p.recompute}, dist-opt={p.use_distributed_optimizer}, "
        f"micro-batch {p.micro_batch_max_tokens} tokens, ~{plan.num_microbatches} micro-batches per mini-batch",
    )
    head.add_row("rollout", f"{roles.rollout_gpus} GPUs: {p.num_engines} SGLang engines x TP={p.engine_tp}")
    rs = plan.reward
    if rs is not None:
        head.add_row(
            "reward",
            (
                f"on {p.reward_gpus} rollout engine GPUs (colocated)"
                if p.reward_colocated
                else f"{roles.reward_gpus} GPUs of their own"
            )
            + f": {rs.servers} SGLang servers x TP={rs.tp}, {rs.kind} "
            f"{rs.model} ({rs.params / 1e9:.2f} B parameters)",
        )
    elif p.reward_kind is not None:
        head.add_row("reward", f"{p.reward_kind} at {p.reward_url} (not this job's GPUs)")
    console.print(head)

    if plan.stages:
        mem = Table(title=f"actor memory per GPU, train phase (GiB of {plan.gpu.memory_gib:g})")
        for col in (
            "stage",
            "params/GPU",
            "weights",
            "grads",
            "optimizer",
            "activations",
            "(recompute toggled)",
            "logits",
            "overhead",
            "reference",
            "total",
        ):
            mem.add_column(col, justify="right")
        for s in plan.stages:
            mem.add_row(
                s.stage,
                f"{s.params / 1e9:.2f} B",
                _g(s.state.weights),
                _g(s.state.grads),
                _g(s.state.optimizer),
                _g(s.activations),
                _g(s.activations_other),
                _g(s.logits),
                _g(s.overhead),
                _g(s.reference),
                _g(s.total),
            )
        console.print(mem)

    e = plan.engine
    eng = Table(title="SGLang engine memory per GPU", show_header=False)
    eng.add_row("static pool", f"{_g(e.static_pool)} GiB (mem_fraction_static={p.mem_fraction_static:g})")
    eng.add_row("weights", f"{_g(e.weights)} GiB (bf16 / TP={p.engine_tp})")
    eng.add_row(
        "KV cache", f"{_g(e.kv_room)} GiB at {e.kv_bytes_per_token:,} B/token/GPU = {e.kv_tokens:,} tokens"
    )
    if plan.rollout_phase_bytes is not None:
        eng.add_row(
            "generation phase total", f"{_g(plan.rollout_phase_bytes)} GiB with the actor's resident state"
        )
    console.print(eng)

    if rs is not None:
        m = rs.memory
        rew = Table(title="reward server memory per GPU", show_header=False)
        rew.add_row(
            "static pool", f"{_g(m.static_pool)} GiB (mem_fraction_static={p.reward_memory_fraction:g})"
        )
        rew.add_row("weights", f"{_g(m.weights)} GiB (bf16 / TP={rs.tp})")
        rew.add_row(
            "KV cache",
            f"{_g(m.kv_room)} GiB at {m.kv_bytes_per_token:,} B/token/GPU = {m.kv_tokens:,} tokens; a request "
            f"holds ~{rs.mean_request:,.0f} on average, at most {rs.longest_request:,}",
        )
        console.print(rew)

    checks = Table(title="fits?")
    for col in ("role", "ok", "check", "fix (overrides)"):
        checks.add_column(col)
    for c in plan.checks:
        checks.add_row(
            c.role, "yes" if c.ok else "NO", c.what, " ".join(c.fix) if c.fix else ("" if c.ok else "-")
        )
    console.print(checks)

    t, ts = plan.tokens, plan.times
    step = Table(title="one step (estimate)", show_header=False)
    step.add_row(
        "generated",
        f"{t.gen_rounds} round(s) x {p.gen_batch_size if p.filter_groups else p.train_batch_size}"
        f" prompts x n={p.n} = {t.generated_responses:,} responses, {t.decode_tokens / 1e6:.1f} M decode tokens"
        + (f" + {t.env_tokens / 1e6:.1f} M environment tokens (prefilled)" if t.env_tokens else ""),
    )
    if p.multi_turn:
        bound = (
            f"longer than decoding ({_hms(ts.decode_s)}): the tools bound the rollout; raise "
            "rollout.multi_turn.tool_workers"
            if ts.tool_s > ts.decode_s
            else f"within decoding's {_hms(ts.decode_s)}"
        )
        step.add_row(
            "tools",
            f"{t.tool_calls:,.0f} calls x {plan.tool_s_per_call:g} s / {p.tool_workers} tool workers = "
            f"{_hms(ts.tool_s)}, {bound}",
        )
    sc = plan.scoring
    if sc is not None:
        if p.reward_colocated:
            bound = f"added to decoding's {_hms(ts.decode_s)} on the shared GPUs"
        elif ts.score_s > ts.decode_s:
            bound = (
                f"longer than decoding ({_hms(ts.decode_s)}): scoring bounds the rollout; add reward servers"
            )
        else:
            bound = f"within decoding's {_hms(ts.decode_s)}"
        verdicts = f" + {sc.verdict_tokens / 1e6:.2f} M verdict tokens decoded" if sc.verdict_tokens else ""
        step.add_row(
            "scored",
            f"{sc.requests:,} requests, {sc.prefill_tokens / 1e6:.1f} M tokens prefilled{verdicts} on "
            f"{p.reward_gpus} reward GPUs = {_hms(sc.score_s)}, {bound}",
        )
    step.add_row(
        "trained",
        f"{t.train_sequences:,} sequences, {t.train_tokens / 1e6:.1f} M tokens, "
        f"{ts.train_flops / 1e15:,.0f} PFLOP",
    )
    if plan.a2a_bytes_per_gpu:
        step.add_row(
            "MoE all-to-all",
            f"{plan.a2a_bytes_per_gpu / 1e9:,.0f} GB sent per actor GPU (top-{plan.shape.moe_topk}, EP={p.ep}), "
            f"{_hms(ts.a2a_s)} of the train time",
        )
    step.add_row(
        "time",
        (
            f"max(rollout {_hms(ts.rollout_s)}, train {_hms(ts.train_s)}) = {_hms(ts.step_s)} "
            f"({p.mode}: they overlap; {ts.rollout_fraction:.0%} of the work is rollout)"
            if ts.overlapped
            else f"rollout {_hms(ts.rollout_s)} + train {_hms(ts.train_s)} = {_hms(ts.step_s)} "
            f"({ts.rollout_fraction:.0%} rollout)"
        )
        + "; weight sync and eval not included",
    )
    console.print(step)

    asm = Table(title="assumptions (override with the flags of `megatron-dapo plan --help`)")
    for col in ("assumption", "value", "why"):
        asm.add_column(col)
    for row in plan.assumptions:
        asm.add_row(*row)
    console.print(asm)
    console.print("[bold green]fits[/]" if plan.fits else "[bold red]does not fit: apply a fix above[/]")
