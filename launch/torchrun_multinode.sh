#!/bin/bash
# SPMD actor ranks under torchrun, no Ray: rank 0 drives rollouts against SGLang servers, either
# the URLs in the config (rollout.sglang.urls) or servers this script starts on every node first.
# Run once per node (same arguments everywhere):
#   srun --nodes=2 --ntasks-per-node=1 bash launch/torchrun_multinode.sh CONFIG [key=value ...]
#   # or by hand on each node:
#   NNODES=2 MASTER_ADDR=node0 bash launch/torchrun_multinode.sh CONFIG [key=value ...]
# With START_SGLANG=1 each node first starts its servers (launch/start_sglang_servers.sh) on GPUs
# SGLANG_FIRST_GPU.. and the actor uses GPUs 0..NPROC_PER_NODE-1 (disaggregated on each node).
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
START_SGLANG="${START_SGLANG:-0}"              # 1: start SGLang servers on every node first
SGLANG_TP="${SGLANG_TP:-1}"
SGLANG_FIRST_GPU="${SGLANG_FIRST_GPU:-$NPROC_PER_NODE}"
SGLANG_BASE_PORT="${SGLANG_BASE_PORT:-30000}"
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
if [[ "$START_SGLANG" == 1 ]]; then
  MODEL_PATH="${MODEL_PATH:-$(python -c 'import sys; from megatron_dapo.config import load_config
print(load_config(sys.argv[1], sys.argv[2:]).model.path)' "$CONFIG" "$@")}"
  TOTAL_GPUS="$(nvidia-smi -L | wc -l)"
  rm -f "/tmp/sglang_urls_$RDZV_ID"
  # Each node starts and health-checks its own servers; the rendezvous below then waits for all nodes.
  MODEL_PATH="$MODEL_PATH" TP_SIZE="$SGLANG_TP" FIRST_GPU="$SGLANG_FIRST_GPU" GPUS_PER_NODE="$TOTAL_GPUS" \
    BASE_PORT="$SGLANG_BASE_PORT" bash launch/start_sglang_servers.sh --block >"/tmp/sglang_urls_$RDZV_ID" &
  SGLANG_PID=$!
  trap 'kill "$SGLANG_PID" 2>/dev/null || true' EXIT
  until [[ -s "/tmp/sglang_urls_$RDZV_ID" ]]; do
    kill -0 "$SGLANG_PID" 2>/dev/null || { echo "SGLang servers failed to start on $(hostname)" >&2; exit 1; }
    sleep 5
  done
  # Rank 0 needs every node's servers: the same ports on each node of the allocation.
  ENGINES_PER_NODE=$(( (TOTAL_GPUS - SGLANG_FIRST_GPU) / SGLANG_TP ))
  URLS=()
  if [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
    mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  else
    # Without Slurm list the nodes yourself: SGLANG_HOSTS="node0 node1".
    read -r -a HOSTS <<<"${SGLANG_HOSTS:-$(hostname)}"
  fi
  for host in "${HOSTS[@]}"; do
    for (( i = 0; i < ENGINES_PER_NODE; i++ )); do URLS+=("http://$host:$(( SGLANG_BASE_PORT + i ))"); done
  done
  OVERRIDES+=("rollout.sglang.urls=[$(IFS=,; echo "${URLS[*]}")]" "rollout.num_engines=${#URLS[@]}"
              "rollout.tensor_parallel_size=$SGLANG_TP" "parallel.actor_world_size=$(( NNODES * NPROC_PER_NODE ))")
fi

# On SIGTERM (Slurm's preemption) torchrun forwards the signal to its workers and SIGKILLs them
# this many seconds later (30 by default): leave room for trainer.stop_timeout_s (90 s) to save.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-110}"
exec_or_run=(torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE"
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID"
  -m megatron_dapo.train "$CONFIG" trainer.resume=auto "${OVERRIDES[@]}")
echo "[torchrun $(hostname)] ${exec_or_run[*]}" >&2
"${exec_or_run[@]}"
