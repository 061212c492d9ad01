"""`python -m megatron_dapo.train CONFIG [key=value ...]`: DAPO under torchrun, without Ray.

    torchrun --nnodes N --nproc-per-node G -m megatron_dapo.train CONFIG [key=value ...]
    (multi-node: launch/torchrun_multinode.sh)

Every rank loads the config and builds its Megatron rank (`ActorWorker.setup`). Rank 0 also
builds what the Ray driver builds (run directory, tokenizer, data, scorer, engines, rollout
manager; `launch.prepare_run` / `launch.drive`) and runs the same `DAPOTrainer`, reaching the
ranks through `SPMDRankGroup`; ranks > 0 execute those calls in `SPMDRankGroup.follow` until
rank 0 shuts the group down. The torch.distributed world is torchrun's, so
`parallel.actor_world_size` is taken from it.

Engines, chosen like the Ray path (`rollout.engine`, auto = SGLang on GPU, HF on CPU):
- SGLang: the servers at `rollout.sglang.urls` (started per node by the launch script), or
  servers that each node's LOCAL_RANK 0 launches on that node (sglang/torchrun.py); weights by `trainer.weight_sync.transport`
  (sglang/engines.py, sync/sglang_transports.py).
- HF (CPU): the HF engine inside rank 0's process, weights handed over in memory
  (`DirectTransport`), so the whole torchrun path runs on a laptop.

Signals: rank 0 handles SIGTERM/SIGINT like the Ray driver (finish the step, save, exit 0). The
other ranks ignore the first signal, because the save that rank 0 is about to do needs them; if
rank 0 dies instead, their next collective fails and they exit. A second signal stops any rank
at once.
"""

import sys

if __name__ == "__main__":
    # Only when run: the checkpoint writer's spawned helper re-imports this module, and must not
    # import the whole driver to do so.
    from megatron_dapo.driver.torchrun_launch import main

    sys.exit(main())
