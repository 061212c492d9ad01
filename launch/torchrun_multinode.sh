#!/bin/bash
# SPMD actor ranks under torchrun, no Ray: rank 0 drives rollouts against SGLang servers, either
# the URLs in the config (rollout.sglang.urls) or, without them, servers the trainer itself starts
# on every node (each node's LOCAL_RANK 0 starts the engines the plan puts there, restarts them if
# they die, stops them at the end; sglang/torchrun.py).
# Run once per node (same arguments everywhere):
#   srun --nodes=2 --ntasks-per-node=1 bash launch/torchrun_multinode.sh CONFIG [key=value ...]
#   # or by hand on each node:
#   NNODES=2 MASTER_ADDR=node0 bash launch/torchrun_multinode.sh CONFIG [key=value ...]
# DRY_RUN=1 prints the torchrun command instead of running it.
set -euo pipefail

# ---- what to change -------------------------------------------------------------------------
NNODES="${NNODES:-${SLURM_NNODES:-1}}"
NPROC_PER_NODE="${NPROC_PER_NODE:-8}"         # actor ranks per node
# Rendezvous: the first node of the Slurm allocation, or set MASTER_ADDR yourself.
if [[ -z "${MASTER_ADDR:-}" && -n "${SLURM_JOB_NODELIST:-}" ]]; then
  MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"
fi
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
RDZV_ID="${RDZV_ID:-${SLURM_JOB_ID:-megatron-dapo}}"  # same on every node, unique per job
# Servers the trainer starts (no rollout.sglang.urls); each knob, when set, becomes an override:
SGLANG_TP="${SGLANG_TP:-}"                     # GPUs per engine -> rollout.tensor_parallel_size
SGLANG_BASE_PORT="${SGLANG_BASE_PORT:-}"       # first port on each node -> rollout.sglang.base_port
# This node's address as the other nodes reach it (default: the route to MASTER_ADDR, else the
# host name's address); set it on multi-NIC nodes: MEGATRON_DAPO_NODE_IP=10.1.2.3
DRY_RUN="${DRY_RUN:-0}"
# ---------------------------------------------------------------------------------------------

[[ $# -ge 1 ]] || { echo "usage: $0 CONFIG [key=value ...]" >&2; exit 2; }
CONFIG="$1"
shift
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -f "${VENV_DIR:-.venv}/bin/activate" ]]; then
  # shellcheck disable=SC1091
  source "${VENV_DIR:-.venv}/bin/activate"
fi

OVERRIDES=("$@")
# START_SGLANG=1 used to start servers from this script; the trainer now does it on every node
# (with the node's GPUs, restarts, and logs in RUN_DIR/sglang/), so the knob only checks intent.
if [[ "${START_SGLANG:-0}" == 1 ]] && printf '%s\n' "$@" | grep -q '^rollout\.sglang\.urls=\[[^]]'; then
  echo "START_SGLANG=1 and rollout.sglang.urls both given: drop the URLs to let the trainer start the servers, or unset START_SGLANG" >&2
  exit 2
fi
if [[ -n "${SGLANG_FIRST_GPU:-}" && "${SGLANG_FIRST_GPU}" != "$NPROC_PER_NODE" ]]; then
  echo "SGLANG_FIRST_GPU=$SGLANG_FIRST_GPU: with trainer.placement=disaggregated the engines take the GPUs after the actor's (from NPROC_PER_NODE=$NPROC_PER_NODE); unset SGLANG_FIRST_GPU" >&2
  exit 2
fi
[[ -n "$SGLANG_TP" ]] && OVERRIDES+=("rollout.tensor_parallel_size=$SGLANG_TP")
[[ -n "$SGLANG_BASE_PORT" ]] && OVERRIDES+=("rollout.sglang.base_port=$SGLANG_BASE_PORT")

# On SIGTERM (Slurm's preemption) torchrun forwards the signal to its workers and SIGKILLs them
# this many seconds later (30 by default): leave room for trainer.stop_timeout_s (90 s) to save.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-110}"
exec_or_run=(torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE"
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID"
  -m megatron_dapo.train "$CONFIG" trainer.resume=auto "${OVERRIDES[@]}")
if [[ "$DRY_RUN" == 1 ]]; then
  echo "${exec_or_run[*]}"
  exit 0
fi
echo "[torchrun $(hostname)] ${exec_or_run[*]}" >&2
"${exec_or_run[@]}"
