"""One training rank: the Megatron actor plus what the driver asks of it between steps.

The same class serves as a Ray actor (`RayRankGroup`) and as the local object of a torchrun rank
(`SPMDRankGroup`); the driver calls every method on every rank at once. Only the bucket holder of
global rank 0 talks to the engines during weight sync; the other ranks take part in the gather.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from megatron_dapo.actor import compat, gpu_settings
from megatron_dapo.actor.actor import ActorConfig, build_actor
from megatron_dapo.actor.checkpoint import load_checkpoint, save_checkpoint
from megatron_dapo.actor.offload import check_params_offloadable, offload_actor, onload_actor
from megatron_dapo.actor.optimizer import OptimizerSettings
from megatron_dapo.actor.parallel import destroy_parallel, init_parallel
from megatron_dapo.driver.test_hold import hang_in_train_step
from megatron_dapo.sync.protocol import SyncStats, WeightTransport, bucket_nbytes
from megatron_dapo.weights.gather import gather_hf_state_dict, iter_hf_buckets
from megatron_dapo.weights.orphan_guard import die_with_forking_parent
from megatron_dapo.weights.save_hf import export_hf_checkpoint

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def actor_config_from(cfg: dict) -> Any:
    return ActorConfig.from_config(cfg)


def optimizer_settings_from(cfg: dict) -> Any:
    return OptimizerSettings.from_config(cfg)


def total_updates(cfg: dict) -> int:
    per_step = cfg["trainer"]["train_batch_size"] // cfg["actor"]["ppo_mini_batch_size"]
    return cfg["trainer"]["total_steps"] * per_step * cfg["actor"]["ppo_epochs"]


class ActorWorker:
    """A Megatron training rank. `cfg` is the resolved config as a plain dict."""

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.actor = None
        self.transport: WeightTransport | None = None  # global rank 0's, or every rank's (`every_rank`)
        self._train_steps = 0  # calls so far; the test-only hang hook counts them

    # ---------------------------------------------------------------- set-up
    def setup(self, threads: int | None = None) -> dict[str, Any]:
        import megatron_dapo.actor.mcore_import  # noqa: F401 - megatron first, without wandb (~1 s CPU per rank)

        # the checkpoint writers this rank forks hold its sockets: they must die with it
        die_with_forking_parent()
        if threads:
            torch.set_num_threads(threads)
        cfg = self.cfg
        par = cfg["parallel"]
        layout = init_parallel(
            tp=par["tensor_model_parallel_size"],
            pp=par["pipeline_model_parallel_size"],
            vpp=par["virtual_pipeline_model_parallel_size"],
            cp=par["context_parallel_size"],
            ep=par.get("expert_model_parallel_size", 1),
            seed=cfg["trainer"]["seed"],
        )
        dtype = cfg["model"]["dtype"]
        # On a GPU a missing TE is an error unless the local spec was asked for (defect 5).
        use_te = gpu_settings.choose_te(
            cfg["model"]["transformer_impl"],
            on_cuda=not compat.on_cpu(),
            te_import_error=None if compat.on_cpu() else gpu_settings.te_import_error(),
        )
        model_kwargs: dict[str, Any] = {
            "make_vocab_size_divisible_by": cfg["model"]["make_vocab_size_divisible_by"]
        }
        if cfg["model"]["fp8"]:
            model_kwargs.update(fp8=cfg["model"]["fp8"], fp8_recipe=cfg["model"]["fp8_recipe"])
        if cfg["model"]["recompute"]:
            model_kwargs["recompute"] = True
        if par["sequence_parallel"]:
            model_kwargs["sequence_parallel"] = True
        start_from = cfg["model"]["megatron_path"]
        self.actor = build_actor(
            cfg["model"]["path"],
            actor_config_from(cfg),
            optimizer_settings_from(cfg),
            total_updates=total_updates(cfg),
            params_dtype=_DTYPES[dtype],
            load_weights=start_from is None,
            use_te=use_te,
            model_kwargs=model_kwargs,
        )
        if start_from:
            self.actor.load_model_weights(start_from)
            if self.actor.reference is not None:
                self.actor.load_reference_weights(start_from)
        if not compat.on_cpu() and cfg["trainer"]["placement"] == "colocated":
            # Fail at start-up, not at the first weight sync.
            check_params_offloadable(self.actor.model)
        self.layout = layout
        return {
            "rank": layout.rank,
            "tp": layout.tp_size,
            "pp": layout.pp_size,
            "dp": layout.dp_size,
            "device": str(compat.device()),
            "pid": os.getpid(),
        }

    # ---------------------------------------------------------------- training
    def train_step(self, batch) -> dict[str, Any]:
        self._train_steps += 1
        hang_in_train_step(dist.get_rank(), self._train_steps)
        metrics = self.actor.update(batch)
        metrics.pop("updates", None)
        return metrics

    def compute_logprobs(self, batch, temperature: float | None = None) -> torch.Tensor:
        return self.actor.compute_logprobs(batch, temperature)

    def score_old_and_ref(self, batch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """pi_old's and the reference's log-probs of the batch (algorithm.use_kl_in_reward);
        global rank 0 returns them (every rank holds the same), the others None: at real sizes
        each is [responses x longest response] floats."""
        scores = self.actor.score_old_and_ref(batch)
        return scores if dist.get_rank() == 0 else None

    # ---------------------------------------------------------------- colocation
    def offload(self, params: bool = True) -> bool:
        """Free this rank's GPU memory for the colocated engines: gradient buffers are dropped,
        optimizer state (and with `params` the parameter buffers) goes to host memory, through
        megatron-core's own RL hooks. The weight sync needs the parameters, so the trainer first
        offloads without them. A no-op on the CPU path (there is no device memory)."""
        if compat.on_cpu():
            return False
        offload_actor(self.actor.model, self.actor.optimizer, params)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return True

    def onload(self) -> bool:
        """Undo `offload` before the actor trains (parameters back, grads re-allocated, zeroed)."""
        if compat.on_cpu():
            return False
        onload_actor(self.actor.model, self.actor.optimizer)
        torch.cuda.synchronize()
        return True

    # ---------------------------------------------------------------- weight sync
    def attach_transport(self, transport: WeightTransport) -> None:
        """Give a rank the engines' transport: global rank 0, or every rank for a per-rank one."""
        if not isinstance(transport, WeightTransport):
            raise TypeError(f"{type(transport).__name__} is not a sync.protocol.WeightTransport")
        self.transport = transport

    def reset_transport(self) -> None:
        """An engine was restarted: the transport drops per-server state (a weight-update group)."""
        if self.transport is not None:
            self.transport.reset()

    def drop_engines(self, names: list[str]) -> None:
        """Engines the run goes on without (servers given by URL that hung): no more syncs to them."""
        if self.transport is not None:
            self.transport.drop(set(names))

    def restart_node_server(self, index: int):
        """Under torchrun: restart SGLang engine `index` if this rank's node started it here
        (sglang/torchrun.py, `NodeServers.restart`); None on every other rank."""
        servers = getattr(self, "node_servers", None)
        return None if servers is None else servers.restart(index)

    def push_weights(self, version: int) -> dict[str, float]:
        """Every rank iterates the gather; global rank 0 (a bucket holder) feeds its transport."""
        sender = self.transport
        # a per-rank transport (CUDA IPC from the ranks on each engine's GPUs) runs on every rank
        every_rank = sender is not None and sender.every_rank
        if dist.get_rank() != 0 and not every_rank:
            sender = None
        stats = SyncStats()
        start = time.perf_counter()
        if sender is not None:
            sender.begin(version)
        bucket_bytes = int(self.cfg["trainer"]["weight_sync"]["bucket_mb"]) << 20
        for index, bucket in enumerate(iter_hf_buckets(self.actor.model, bucket_bytes=bucket_bytes)):
            if sender is not None and (bucket is not None or every_rank):
                sender.send(index, bucket if dist.get_rank() == 0 else None)
            if bucket is not None and dist.get_rank() == 0:
                stats.buckets += 1
                stats.tensors += len(bucket)
                stats.bytes += bucket_nbytes(bucket)
        if sender is not None:
            sender.finish()
        dist.barrier()
        stats.seconds = time.perf_counter() - start
        return stats.metrics()

    def gather_hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        sd = gather_hf_state_dict(self.actor.model)
        return sd if dist.get_rank() == 0 else None

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(
        self, root: str, step: int, trainer_state: dict, keep_last: int, extra_files: dict | None = None
    ) -> str:
        path = save_checkpoint(
            root,
            step,
            self.actor,
            trainer_state=trainer_state,
            hf_dir=self.cfg["model"]["path"],
            keep_last=keep_last,
            extra_files=extra_files,
        )
        return str(path)

    def load_checkpoint(self, root: str, resume: str = "auto", verify_checksums: bool = True) -> dict | None:
        """The saved trainer state (None when there is nothing to resume)."""
        record = load_checkpoint(self.actor, root, resume, verify_checksums=verify_checksums)
        return None if record is None else record["trainer_state"]

    def export_hf(self, out_dir: str) -> str | None:
        """Write the current weights as an HF checkpoint at `out_dir` (atomically; only the first
        DP replica gathers, global rank 0 writes)."""
        return export_hf_checkpoint(self.actor.model, out_dir, hf_metadata_dir=self.cfg["model"]["path"])

    def shutdown(self) -> None:

        destroy_parallel()
