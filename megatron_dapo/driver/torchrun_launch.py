"""One torchrun rank of a DAPO run (`python -m megatron_dapo.train`, whose docstring says how the
ranks divide the work): load the config, build this rank's Megatron actor, and either drive the
run (rank 0: engines, the rollout manager and the `DAPOTrainer`, reaching the others through
`SPMDRankGroup`) or follow rank 0's calls."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.config import ConfigError, to_container
from megatron_dapo.data.types import DataError
from megatron_dapo.driver.actor_worker import ActorWorker
from megatron_dapo.driver.engine_host import hf_frame, hf_slots
from megatron_dapo.driver.launch import drive, load_for_cli, prepare_run, resolve_device, resolve_engine
from megatron_dapo.driver.rank_group import SPMDRankGroup
from megatron_dapo.driver.stop import StopFlag
from megatron_dapo.errors import report, set_log_dir
from megatron_dapo.rollout.hf_engine import HFEngine
from megatron_dapo.sglang.engines import start_sglang_engines, stop_sglang_engines
from megatron_dapo.sglang.torchrun import launch_node_servers, rank0_engines
from megatron_dapo.sync.sglang_transports import sglang_transport
from megatron_dapo.sync.transports import DirectTransport

log = logging.getLogger("megatron_dapo.train")


def build_engines(
    cfg, engine_kind: str, servers=None, ranks=None
) -> tuple[list[Any], Any, Callable[[], None]]:
    """Rank 0's engines, the weight transport to them, and how to stop them.

    `servers`: the per-node launch (`sglang.torchrun.launch_node_servers`) when no URLs are given;
    `ranks`: the rank group through which another node restarts its servers."""
    if engine_kind == "hf":
        engines = [
            HFEngine(
                cfg.model.path,
                name=f"hf-{i}",
                seed=cfg.trainer.seed + i,
                max_batch_size=hf_slots(cfg),
                record_routing=cfg.actor.routing_replay == "rollout",
                frame=hf_frame(cfg),
            )
            for i in range(cfg.rollout.num_engines)
        ]
        return engines, DirectTransport(engines), lambda: None
    if servers is not None:
        engines = rank0_engines(cfg, servers, ranks)
    else:
        engines = start_sglang_engines(cfg)
    try:
        # on CPUs (servers launched without GPUs) the distributed update runs over gloo
        transport = sglang_transport(cfg, engines, backend="nccl" if torch.cuda.is_available() else "gloo")
    except BaseException:
        stop_sglang_engines(engines)
        raise
    return engines, transport, lambda: stop_sglang_engines(engines)


def run_rank0(cfg, worker, inputs, engine_kind: str, stop, servers=None) -> dict[str, Any]:
    """Drive the run from rank 0; the other ranks are in `SPMDRankGroup.follow`."""
    ranks = SPMDRankGroup(worker)  # pairs with the followers' group: the first collective after setup
    engines, transport, stop_engines = build_engines(cfg, engine_kind, servers, ranks)
    try:
        if transport.every_rank:
            # colocated CUDA IPC: each engine TP rank's payload is made by the rank on its GPU
            ranks.call("attach_transport", transport, timeout_s=300)
        else:
            worker.attach_transport(transport)
        summary = drive(cfg, inputs, ranks, engines, stop)
    finally:
        stop_engines()
    # Only after a clean run: after a failure the others may be inside a collective, and a stop
    # message would not match it; this process exiting non-zero ends them instead (torchrun).
    ranks.shutdown()
    return summary


def main(argv: list[str] | None = None) -> int:
    """Entry point of every torchrun rank; returns the process exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron_dapo.train",
        description="DAPO training under torchrun: SPMD actor ranks, rank 0 drives the rollouts.",
    )
    parser.add_argument("config", help="YAML recipe, e.g. configs/dapo_qwen2.5_32b.yaml")
    parser.add_argument(
        "overrides", nargs="*", help="key=value overrides, e.g. rollout.sglang.urls=[http://h:30000]"
    )
    args = parser.parse_args(argv)

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s",
    )
    inputs = None
    servers = None
    try:
        cfg = load_for_cli(args.config, list(args.overrides))
        if cfg.parallel.actor_world_size != world:
            log.info(
                "parallel.actor_world_size=%d -> %d (the torchrun world)",
                cfg.parallel.actor_world_size,
                world,
            )
            cfg.parallel.actor_world_size = world
        par = cfg.parallel
        model_parallel = (
            par.tensor_model_parallel_size * par.pipeline_model_parallel_size * par.context_parallel_size
        )
        if world % model_parallel:
            raise ConfigError(
                f"the torchrun world has {world} ranks, not a multiple of tensor x pipeline x context parallel "
                f"= {model_parallel}; launch with torchrun --nproc-per-node (x --nnodes) a multiple of it"
            )
        engine_kind = resolve_engine(cfg, resolve_device(cfg))
        if rank == 0:
            inputs = prepare_run(cfg)  # data errors surface before the model is built
            # a failure reported from a watchdog thread writes its traceback there too
            set_log_dir(Path(cfg.trainer.runs_dir) / cfg.trainer.run_name)
    except (ConfigError, DataError) as e:
        print(
            f"[rank {rank}] {'config' if isinstance(e, ConfigError) else 'data'} error: {e}", file=sys.stderr
        )
        return 2

    # rank 0 bounds its stop like the Ray driver; the others only wait for its calls
    stop = StopFlag(cfg.trainer.stop_timeout_s if rank == 0 else None).install()
    worker = ActorWorker(to_container(cfg))
    try:
        worker.setup()
        if engine_kind == "sglang" and not cfg.rollout.sglang.urls:
            servers = launch_node_servers(cfg)  # every node starts its own engines
            worker.node_servers = servers  # and restarts them when rank 0 asks (restart_node_server)
        if rank != 0:
            SPMDRankGroup.follow(worker)
            worker.shutdown()
            return 0
        summary = run_rank0(cfg, worker, inputs, engine_kind, stop, servers)
        worker.shutdown()
    except ConfigError as e:
        print(f"[rank {rank}] config error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - every failure ends as one line, the traceback in a file
        return _report_failure(e, rank, cfg)
    finally:
        if servers is not None:  # each node's launcher stops its own servers, after rank 0 saved
            servers.stop()
        stop.uninstall()
        if inputs is not None:
            inputs.scorer.close()
    print(json.dumps({k: summary.get(k) for k in ("run_dir", "step", "stopped_by", "hf_export")}, indent=2))
    return 0


def _report_failure(exc: BaseException, rank: int, cfg) -> int:
    """Rank 0 prints the one line the CLI would (`failed: ...` naming a dead rank and the
    checkpoint a resume uses); a follower, which only saw its peers disappear, prints one line
    prefixed with its rank. Tracebacks go to RUN/error.log (error.rankN.log for followers)."""
    set_log_dir(Path(cfg.trainer.runs_dir) / cfg.trainer.run_name)
    status, line = report(exc, log_name="error.log" if rank == 0 else f"error.rank{rank}.log")
    print(line if rank == 0 else f"[rank {rank}] stopped, {line}", file=sys.stderr, flush=True)
    return status
