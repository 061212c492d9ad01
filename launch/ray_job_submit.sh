#!/bin/bash
# Submit a training run to an existing Ray cluster (e.g. one started by the sbatch templates, a
# KubeRay cluster, or `ray start --head` by hand). Uploads this checkout as the job's working dir.
#   RAY_ADDRESS=http://HEAD_IP:8265 bash launch/ray_job_submit.sh CONFIG [key=value ...]
# Follow it with `ray job logs --address ... --follow JOB_ID`; stop it with `ray job stop`.
set -euo pipefail

# ---- what to change -------------------------------------------------------------------------
RAY_ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"  # the dashboard address of the cluster
JOB_ID="${JOB_ID:-dapo-$(date +%Y%m%d-%H%M%S)}"
NO_WAIT="${NO_WAIT:-0}"                              # 1: return after submitting
# Kept out of the upload (Ray limits the working dir to a few hundred MB).
RUNTIME_ENV='{"excludes": [".git", ".venv", "runs", "data", "*.parquet", "*.safetensors", "__pycache__"]}'
# ---------------------------------------------------------------------------------------------

[[ $# -ge 1 ]] || { echo "usage: $0 CONFIG [key=value ...]" >&2; exit 2; }
cd "$(dirname "${BASH_SOURCE[0]}")/.."
command -v ray >/dev/null || { echo "ray is not on PATH (pip install 'ray[default]')" >&2; exit 1; }

ARGS=(--address "$RAY_ADDRESS" --submission-id "$JOB_ID" --working-dir . --runtime-env-json "$RUNTIME_ENV")
[[ "$NO_WAIT" == 1 ]] && ARGS+=(--no-wait)
# The job's driver runs on the cluster; trainer.ray_address=auto makes it join that cluster.
ray job submit "${ARGS[@]}" -- megatron-dapo train "$@" trainer.ray_address=auto
