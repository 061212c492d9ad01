"""`megatron-dapo train`: place the actor ranks and the engines with Ray, then run the loop.

Placement on one Ray placement group:
- CPU (no CUDA): every actor rank and every HF engine gets a CPU bundle; threads per process are
  capped so that 2 ranks + 1 engine share a 2-core laptop without oversubscription.
- GPU, colocated: actor ranks and SGLang engines share the same GPUs; engines release memory
  while the actor trains and the actor's optimizer is the only resident state during generation.
- GPU, disaggregated: engines get `trainer.rollout_gpus` GPUs of their own.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from megatron_dapo.agent.from_config import multi_turn_runner, tool_schemas
from megatron_dapo.arch import load_hf_config
from megatron_dapo.config import ConfigError, load_config, to_container, to_yaml
from megatron_dapo.driver import cpu_warnings
from megatron_dapo.driver.actor_worker import ActorWorker
from megatron_dapo.driver.datasets import load_tokenizer, make_scorer, train_dataset, val_problems
from megatron_dapo.driver.engine_host import EngineHost, RemoteEngine, hf_frame, hf_slots
from megatron_dapo.driver.hub import resolve_hub_paths
from megatron_dapo.driver.plots import plot_run
from megatron_dapo.driver.preflight import preflight
from megatron_dapo.driver.rank_failures import RankCallError, dead_peers, rank_died
from megatron_dapo.driver.rank_group import RayRankGroup, bundle_slots
from megatron_dapo.driver.reward_model import ServedReward
from megatron_dapo.driver.run_dir import RunDir
from megatron_dapo.driver.stop import StopFlag, blocked_signals
from megatron_dapo.driver.trainer import DAPOTrainer
from megatron_dapo.driver.validation import make_validator
from megatron_dapo.rewards.served import settings_from_config
from megatron_dapo.rollout.dump import dump_rollouts
from megatron_dapo.rollout.manager import RolloutManager, RolloutManagerConfig
from megatron_dapo.sglang.engines import launch_planned_engines, start_sglang_engines, stop_sglang_engines
from megatron_dapo.sglang.placement import EnginePlan, plan_engines, plan_reward_servers, rank_order
from megatron_dapo.sync.protocol import WeightTransport
from megatron_dapo.sync.sglang_transports import sglang_transport
from megatron_dapo.sync.transports import RayObjectTransport

log = logging.getLogger(__name__)


def resolve_device(cfg: DictConfig) -> str:
    import torch

    if cfg.trainer.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.trainer.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but torch sees no CUDA device; use trainer.device=auto or cpu")
    return cfg.trainer.device


def resolve_engine(cfg: DictConfig, device: str) -> str:
    kind = cfg.rollout.engine
    if kind == "auto":
        kind = "sglang" if device == "cuda" else "hf"
    return kind


def init_ray(cfg: DictConfig, device: str, num_cpus: int) -> None:
    import ray

    if ray.is_initialized():
        return
    address = cfg.trainer.ray_address
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    routed = None
    if device == "cpu":
        run_dir = Path(cfg.trainer.runs_dir) / cfg.trainer.run_name
        routed = cpu_warnings.worker_runtime_env(run_dir)
        print(cpu_warnings.CPU_NOTE.format(log=cpu_warnings.route_driver(run_dir)), file=sys.stderr)
    # Ray starts workers at niceness +15 by default; here the workers are the trainer's ranks and
    # engines, so on a shared machine the run would crawl behind any other job. They keep the
    # driver's priority instead (the raylet reads this when it starts).
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Every process of the run is an actor, started in a worker of its own; the workers Ray
    # prestarts for tasks when the driver connects (one per CPU) would sit idle, each a Python
    # start-up and a Ray import taken from the run's CPUs (2 of 5 workers of a 3-actor cluster).
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    # A local cluster sized to what this run places; the object store only carries buckets and
    # batches on the CPU path. address="local": always our own, since with no address Ray joins
    # the newest cluster on the machine (RAY_ADDRESS, or /tmp/ray/ray_current_cluster, which any
    # other run writes) and then refuses num_cpus; joining one is what trainer.ray_address is for.
    # Its processes are started with SIGTERM/SIGINT blocked: a signal to the whole process group
    # (Slurm) must reach only the driver, which stops them after the checkpoint.
    with blocked_signals():
        _init_local_ray(num_cpus, device, routed)


def _init_local_ray(num_cpus: int, device: str, routed: dict | None = None) -> None:
    """``routed``: ``cpu_warnings.worker_runtime_env``, the workers' known library warnings to the
    run's log."""
    import ray

    routed = routed or {}
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=True,
        object_store_memory=(1 << 30) if device == "cpu" else None,
        runtime_env={
            **routed,
            "env_vars": {
                "TOKENIZERS_PARALLELISM": "false",
                "OMP_NUM_THREADS": "1",
                **routed.get("env_vars", {}),
            },
        },
    )


def shutdown_local_ray() -> None:
    """`ray.shutdown()` of the cluster `init_ray` started, without Ray's graceful stop of its
    daemons. That stop sends each (raylet, GCS, agents) SIGTERM and waits up to a second for it
    to exit before SIGKILL; they were started with SIGTERM blocked, so it waited the full second
    each (5 s per run) and killed them anyway. They are killed at once instead. Ray's node object
    is private API: without it, the plain shutdown."""
    import ray

    try:
        from ray._private import worker as ray_worker
    except ImportError:
        ray_worker = None
    node = getattr(ray_worker, "_global_node", None)
    kill_all = getattr(node, "kill_all_processes", None)
    if kill_all is not None:

        def kill_without_sigterm(*args, **kwargs):
            kwargs["allow_graceful"] = False
            return kill_all(*args, **kwargs)

        node.kill_all_processes = kill_without_sigterm
    ray.shutdown()


def layout_gpus(cfg: DictConfig) -> int:
    """GPUs the run places: the actor's (colocated engines share them), disaggregated engines'
    (trainer.rollout_gpus) and the reward servers' own. The planner's rule (`plan.sizing`), which
    the driver may not import; a test holds the two equal."""
    m = cfg.reward.model
    reward = m.num_servers * m.gpus_per_server if m.kind and m.path and m.placement != "colocated" else 0
    rollout = cfg.trainer.rollout_gpus if cfg.trainer.placement == "disaggregated" else 0
    return int(cfg.parallel.actor_world_size + rollout + reward)


def check_cluster_size(cfg: DictConfig, device: str, bundles: list[dict], resources: dict) -> None:
    """Raise a one-line ConfigError when the Ray cluster has fewer GPUs (CPUs on a CPU run) than
    the run places: on GPUs the layout's (the actor's, plus disaggregated engines' and reward
    servers' own), on CPUs the bundles'. ``resources``: ``ray.cluster_resources()``."""
    kind = "CPU" if device == "cpu" else "GPU"
    need = layout_gpus(cfg) if kind == "GPU" else int(sum(b.get(kind, 0) for b in bundles))
    have = int(resources.get(kind, 0))
    if have >= need:
        return
    where = (
        f"the Ray cluster at {cfg.trainer.ray_address}" if cfg.trainer.ray_address else "this machine's Ray"
    )
    fix = (
        f"size the recipe to them with the overrides `megatron-dapo plan CONFIG --num-gpus {have}` prints, or add nodes"
        if kind == "GPU"
        else "lower parallel.actor_world_size or rollout.num_engines, or give the cluster more CPUs"
    )
    raise ConfigError(
        f"the layout places {need} {kind}s (parallel.actor_world_size={cfg.parallel.actor_world_size}, "
        f"rollout.num_engines={cfg.rollout.num_engines}, trainer.placement={cfg.trainer.placement}) but "
        f"{where} has {have}: {fix}"
    )


class Placement:
    """The Ray resources of one run: actor rank group, engines, and the weight transport."""

    def __init__(self, cfg: DictConfig, device: str, engine_kind: str):
        import ray
        from ray.util.placement_group import placement_group

        self.cfg = cfg
        self.device = device
        self.engine_kind = engine_kind
        world = cfg.parallel.actor_world_size
        n_engines = cfg.rollout.num_engines
        threads = max(1, (os.cpu_count() or 2) // (world + n_engines)) if device == "cpu" else None
        if device == "cpu":
            actor_bundles = [{"CPU": 1} for _ in range(world)]
        else:
            actor_bundles = [{"CPU": 2, "GPU": 1} for _ in range(world)]
        engine_bundles = [{"CPU": 1} for _ in range(n_engines)] if engine_kind == "hf" else []
        init_ray(cfg, device, num_cpus=len(actor_bundles) + len(engine_bundles) + 1)
        # before the placement group: a cluster too small for it would leave ray.get waiting 300 s
        check_cluster_size(cfg, device, actor_bundles + engine_bundles, ray.cluster_resources())
        self.pg = placement_group(actor_bundles + engine_bundles, strategy="PACK")
        ray.get(self.pg.ready(), timeout=300)
        container = to_container(cfg)
        # rank r on the r-th bundle by (node, GPU): a node's ranks are consecutive, whatever order
        # Ray numbered the bundles in
        slots = bundle_slots(self.pg, world)
        order = rank_order(slots)
        self.actor_slots = [slots[b] for b in order]
        self.ranks = RayRankGroup(
            ActorWorker,
            world,
            placement_group=self.pg,
            bundles=order,
            init_args=(container,),
            num_gpus_per_rank=0 if device == "cpu" else 1,
            num_cpus_per_rank=1 if device == "cpu" else 2,
        )
        self.engines: list[Any] = []
        if engine_kind == "sglang":
            # before the actor takes GPU memory: SGLang sizes its KV pool from what is free at start
            self.engines = self._start_sglang()
        try:
            self.layouts = self.ranks.call("setup", threads, timeout_s=1800)
        except BaseException:
            self._stop_sglang()
            raise
        if engine_kind == "hf":
            self.engines = self._start_engines(engine_kind, len(actor_bundles), threads)

    def _start_sglang(self) -> list[Any]:
        """Servers given by URL, else one per plan on every node of the cluster (`plan_engines`)."""
        import ray

        cfg = self.cfg
        if cfg.rollout.sglang.urls:
            return start_sglang_engines(cfg)
        log_dir = Path(cfg.trainer.runs_dir).resolve() / cfg.trainer.run_name / "sglang"
        if self.device == "cpu":
            # CPU servers (tests, the demo): on this node, no GPUs, free ports
            here = ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
            plans = [EnginePlan(i, *here, (), 0) for i in range(int(cfg.rollout.num_engines))]
            return launch_planned_engines(cfg, plans, log_dir, cpu=True)
        nodes = [n for n in ray.nodes() if n["Alive"]]
        plans = plan_engines(
            cfg.trainer.placement,
            self.actor_slots,
            {n["NodeID"]: int(n["Resources"].get("GPU", 0)) for n in nodes},
            int(cfg.rollout.num_engines),
            int(cfg.rollout.tensor_parallel_size),
            int(cfg.rollout.sglang.base_port),
            node_ips={n["NodeID"]: n["NodeManagerAddress"] for n in nodes},
        )
        return launch_planned_engines(cfg, plans, log_dir)

    def _start_engines(self, kind: str, bundle_offset: int, threads: int | None) -> list[Any]:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cfg = self.cfg
        host_cls = ray.remote(EngineHost)
        engines = []
        for i in range(cfg.rollout.num_engines):
            name = f"hf-{i}"
            handle = host_cls.options(
                num_cpus=1,
                # every turn in flight is a call (an episode's later turns, one request each, meet
                # in the engine's batches) and abort must still find a thread: one per request the
                # manager may have in flight on it, and some for abort, health and the weights
                max_concurrency=int(cfg.rollout.max_concurrency_per_engine) + 16,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=bundle_offset + i
                ),
            ).remote(
                cfg.model.path,
                name,
                cfg.trainer.seed + i,
                hf_slots(cfg),
                threads or 1,
                record_routing=cfg.actor.routing_replay == "rollout",
                frame=hf_frame(cfg),
            )
            engines.append(RemoteEngine(name, handle, cfg.rollout.request_timeout_s))
        return engines

    def reward_plans(self) -> list[EnginePlan] | None:
        """Where ``reward.model.path``'s servers go (None: no servers to start): on a CPU, this
        node; on GPUs, the cluster's (``plan_reward_servers``: GPUs of their own, or the
        planned rollout engines' own)."""
        import ray

        settings = settings_from_config(self.cfg.reward)
        if settings is None or settings.path is None:
            return None
        if self.device == "cpu":
            here = ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
            return [EnginePlan(i, *here, (), 0) for i in range(settings.num_servers)]
        nodes = [n for n in ray.nodes() if n["Alive"]]
        # the engines the run launched on planned GPUs (none when they are given by URL)
        planned = (
            [e.plan for e in self.engines]
            if self.engine_kind == "sglang" and not self.cfg.rollout.sglang.urls
            else []
        )
        return plan_reward_servers(
            settings.placement,
            self.actor_slots,
            {n["NodeID"]: int(n["Resources"].get("GPU", 0)) for n in nodes},
            planned,
            settings.num_servers,
            settings.gpus_per_server,
            node_ips={n["NodeID"]: n["NodeManagerAddress"] for n in nodes},
        )

    def weight_transport(self) -> WeightTransport:
        timeout = self.cfg.trainer.weight_sync.timeout_s
        if self.engine_kind == "hf":  # `EngineHost` actors: buckets through the object store
            return RayObjectTransport([(e.name, e.handle) for e in self.engines], timeout)
        # gloo carries the distributed update between CPU processes
        return sglang_transport(self.cfg, self.engines, backend="gloo" if self.device == "cpu" else "nccl")

    def _stop_sglang(self) -> None:
        if self.engines and self.engine_kind == "sglang":
            stop_sglang_engines(self.engines)

    def shutdown(self, failed: bool = False) -> None:
        """Stop ranks and engines. After a failure a rank may be stuck in a collective with a
        peer that is gone, so the ranks are killed rather than asked to tidy up."""
        from ray.util.placement_group import remove_placement_group

        try:
            if failed:
                self.ranks.shutdown()
            else:
                self.ranks.call("shutdown", timeout_s=60)
        except Exception as e:  # noqa: BLE001 - best effort on the way out
            log.warning("actor shutdown: %s", e)
        self._stop_sglang()
        remove_placement_group(self.pg)
        if not self.cfg.trainer.ray_address:
            shutdown_local_ray()


@dataclass
class RunInputs:
    """What every launch mode builds before placing ranks and engines (Ray or torchrun rank 0)."""

    run: RunDir
    tokenizer: Any
    dataset: Any
    problems: list
    scorer: Any


def prepare_run(cfg: DictConfig) -> RunInputs:
    """The run directory (with the resolved config), tokenizer, training data, validation set, scorer.
    With rollout.multi_turn the prompts carry the tools' schemas (the chat template renders them)."""
    # every input checked before anything is written: a config error leaves no run directory
    preflight(cfg, Path(cfg.trainer.runs_dir) / cfg.trainer.run_name / "checkpoints")
    run = RunDir.create(cfg.trainer.runs_dir, cfg.trainer.run_name)
    run.config.write_text(to_yaml(cfg))
    tokenizer = load_tokenizer(cfg)
    tools = tool_schemas(cfg)
    dataset = train_dataset(cfg, tokenizer, tools)
    problems = val_problems(cfg, tokenizer, tools)
    return RunInputs(run, tokenizer, dataset, problems, make_scorer(cfg))


def drive(
    cfg: DictConfig,
    inputs: RunInputs,
    ranks,
    engines: list[Any],
    stop: StopFlag,
    reward_plans: list[EnginePlan] | None = None,
) -> dict[str, Any]:
    """Run the step loop over placed `ranks` (a rank group) and `engines`, then export and plot.

    The caller has attached the weight transport to global rank 0's worker; `ranks.call` reaches
    every rank the same way whether they are Ray actors or torchrun processes. `reward_plans`:
    where the reward model's servers go on a Ray cluster (None: this node).
    """
    tokenizer = inputs.tokenizer
    mcfg = RolloutManagerConfig.from_config(cfg)
    mcfg.stop_token_ids = [int(t) for t in _stop_ids(tokenizer)]
    # multi-turn tool use: the episode runner (its tool processes end with the run)
    episodes = (
        multi_turn_runner(cfg, tokenizer, _max_context(cfg), inputs.run.root)
        if cfg.rollout.multi_turn.enable
        else None
    )
    rewards = ServedReward.start(cfg, inputs.run.root, reward_plans)
    try:
        return _drive(cfg, inputs, ranks, engines, stop, mcfg, episodes, rewards)
    finally:
        if episodes is not None:
            episodes.close()
        rewards.close()


def _max_context(cfg: DictConfig) -> int:
    """Prompt + response tokens the model takes (an episode's turns stop short of it)."""
    context = getattr(load_hf_config(cfg.model.path), "max_position_embeddings", None)
    return int(context) if isinstance(context, int) else 1 << 30


def _drive(
    cfg: DictConfig, inputs: RunInputs, ranks, engines, stop, mcfg, episodes, rewards
) -> dict[str, Any]:
    run, tokenizer = inputs.run, inputs.tokenizer

    def sync(version: int) -> dict[str, float]:
        return ranks.call("push_weights", version, timeout_s=cfg.trainer.weight_sync.timeout_s + 60)[0]

    manager = RolloutManager(
        engines,
        inputs.scorer,
        mcfg,
        tokenizer,
        episodes=episodes,
        reward_model=rewards.model,
        combiner=rewards.combiner,
    )
    validate = None
    if inputs.problems:
        # the pool: engines the run goes on without leave it, and validation with it; a held-out
        # set is judged by the reward model as the rollouts are
        scorer = inputs.scorer if rewards.model is None else rewards.val_scorer(inputs.scorer)
        validate = make_validator(cfg, manager.pool, scorer, inputs.problems, tokenizer, episodes)
    trainer = DAPOTrainer(
        cfg,
        run=run,
        ranks=ranks,
        manager=manager,
        dataset=inputs.dataset,
        transport_sync=sync,
        validate=validate,
        stop=stop,
        dump_rollouts=dump_rollouts if cfg.rollout.dump_rollouts else None,
        colocated_engines=_colocated_gpu_engines(cfg, engines),
    )
    summary = trainer.fit()
    if summary.get("stopped_by"):
        _fail_if_a_rank_died(ranks, trainer)
    if cfg.trainer.hf_export_at_end:
        summary["hf_export"] = ranks.call("export_hf", str(run.hf / f"step_{trainer.state.step}"))[0]
    if cfg.logging.plots_at_end:
        summary["plots"] = [str(p) for p in plot_run(run.root)]
    summary["run_dir"] = str(run.root)
    return summary


def _fail_if_a_rank_died(ranks: Any, trainer: DAPOTrainer) -> None:
    """Under torchrun a worker's death makes the agent SIGTERM the others: rank 0 may take that for
    a preemption and stop cleanly before any collective shows the death. Name the dead rank, and
    where a resume continues, instead of going on to the export with it."""
    peers = getattr(ranks, "peers", None)
    dead = dead_peers(peers) if peers else []
    if not dead:
        return
    step = trainer.state.step
    causes: list[BaseException] = [rank_died(rank, pid, f"step {step + 1}") for rank, pid in dead]
    error = RankCallError("; ".join(map(str, causes)), causes)
    error.megatron_dapo_context = (
        f"after step {step}; trainer.resume=auto continues from {trainer.last_checkpoint()}"
    )
    raise error


def _colocated_gpu_engines(cfg: DictConfig, engines: list[Any]) -> list[Any]:
    """Engines whose memory must make room for training: SGLang on the actor's GPUs."""
    import torch

    if cfg.trainer.placement != "colocated" or not torch.cuda.is_available():
        return []
    return [e for e in engines if not hasattr(e, "handle")]  # HF engine hosts hold no GPU memory here


def run_train(cfg: DictConfig) -> dict[str, Any]:
    """Run DAPO as configured; returns the run summary (also in RUN_DIR/summary.json)."""
    device = resolve_device(cfg)
    engine_kind = resolve_engine(cfg, device)
    inputs = prepare_run(cfg)
    stop = StopFlag(cfg.trainer.stop_timeout_s, lambda: _resume_hint(inputs.run)).install()
    try:
        placement = Placement(cfg, device, engine_kind)
        # ray.init replaced the SIGTERM handler with its own (sys.exit): take it back
        stop.install()
        failed = True
        try:
            transport = placement.weight_transport()
            if transport.every_rank:
                placement.ranks.call("attach_transport", transport, timeout_s=300)
            else:
                placement.ranks.workers[0].attach_transport.remote(transport)
            summary = drive(cfg, inputs, placement.ranks, placement.engines, stop, placement.reward_plans())
            failed = False
            return summary
        finally:
            inputs.scorer.close()
            placement.shutdown(failed)
    finally:
        stop.uninstall()


def _resume_hint(run: RunDir) -> str:
    latest = run.checkpoints / "latest"
    if latest.is_file():
        return f"trainer.resume=auto continues from {run.checkpoints / latest.read_text().strip()}"
    return f"no checkpoint under {run.checkpoints} yet"


def _stop_ids(tokenizer) -> list[int]:
    ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return list(ids) if isinstance(ids, (list, tuple)) else [ids]


def load_for_cli(config: str | None, overrides: list[str]) -> DictConfig:
    if config and "=" in config and not config.endswith((".yaml", ".yml")):
        overrides = [config, *overrides]
        config = None
    cfg = load_config(config, overrides)
    # hub ids to local snapshots once, here: the ranks and servers get directories
    return OmegaConf.create(to_container(resolve_hub_paths(cfg)))


__all__ = ["run_train", "prepare_run", "drive", "RunInputs", "load_for_cli"]
