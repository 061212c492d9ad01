#!/bin/bash
# Library sourced by the sbatch templates (after they cd to the repo): start a Ray cluster over the
# Slurm allocation, wait until every GPU has joined, run the trainer with preemption handling.
# Not meant to be run on its own. Expects GPUS_PER_NODE, RAY_PORT, RAY_DASHBOARD_PORT,
# RAY_WAIT_TIMEOUT_S and CONFIG to be set by the caller.

# Prints a line with a timestamp to stderr (Slurm's output file keeps stdout and stderr in order).
log() { echo "[launch $(date +%H:%M:%S)] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# Activates $VENV_DIR (default REPO/.venv) when it exists; otherwise the megatron-dapo on PATH is used
# (e.g. inside the project's container image).
activate_env() {
  local venv="${VENV_DIR:-$1/.venv}"
  if [[ -f "$venv/bin/activate" ]]; then
    # shellcheck disable=SC1091
    source "$venv/bin/activate"
  fi
  command -v megatron-dapo >/dev/null || die "megatron-dapo is not on PATH; set VENV_DIR or use the container image"
  command -v ray >/dev/null || die "ray is not on PATH (pip install 'ray[default]')"
}

# The allocation's hostnames, one per line, head (first) node first.
job_nodes() { scontrol show hostnames "$SLURM_JOB_NODELIST"; }

# The IP of a node as the other nodes see it: the first address of `hostname --ip-address` that is
# not loopback. Debian/Ubuntu map the host name to 127.0.1.1 in /etc/hosts; a Ray head there would
# listen where no other node reaches it, so a node with nothing else stops the job naming the fix.
node_ip() {
  local ips ip
  # shellcheck disable=SC2086 # RAY_NODE_IP_CMD is a command line
  ips="$(srun --nodes=1 --ntasks=1 --overlap -w "$1" ${RAY_NODE_IP_CMD:-hostname --ip-address})"
  for ip in $ips; do
    [[ "$ip" == 127.* || "$ip" == ::1 ]] || { echo "$ip"; return 0; }
  done
  die "node $1 resolves its host name only to loopback (${ips:-nothing}): other nodes cannot reach" \
    "its Ray. Fix /etc/hosts there, or set RAY_NODE_IP_CMD='hostname -I' (its first address is used)"
}

# GPUs registered with the Ray cluster at $1 (HEAD_IP:PORT), 0 when it does not answer yet.
ray_gpus() {
  local line
  line="$(ray status --address "$1" 2>/dev/null | grep -oE '[0-9.]+/[0-9.]+ GPU' | head -n1)"
  [[ -z "$line" ]] && { echo 0; return; }
  line="${line#*/}"
  echo "${line%%.*}"
}

# IPs of the Ray nodes that are alive, one per line.
ray_alive_ips() {
  ray list nodes --address "$1" --filter "state=ALIVE" --format yaml 2>/dev/null \
    | sed -n 's/^[ -]*node_ip: *//p' | tr -d "'\""
}

# start_ray_cluster NODE... : Ray head on the first node, workers on the others, each as a
# background `srun` step that blocks for the job's lifetime. Sets HEAD_IP and RAY_ADDRESS.
start_ray_cluster() {
  local head="$1"
  shift
  HEAD_IP="$(node_ip "$head")"
  [[ -n "$HEAD_IP" ]] || die "could not resolve the IP of head node $head"
  RAY_ADDRESS="$HEAD_IP:$RAY_PORT"
  export RAY_ADDRESS HEAD_IP
  log "Ray head on $head ($RAY_ADDRESS), dashboard :$RAY_DASHBOARD_PORT"
  srun --nodes=1 --ntasks=1 --overlap --gres="gpu:$GPUS_PER_NODE" -w "$head" "${CONTAINER_SRUN[@]}" \
    "${CONTAINER_EXEC[@]}" ray start --head --node-ip-address="$HEAD_IP" --port="$RAY_PORT" \
    --dashboard-host=0.0.0.0 --dashboard-port="$RAY_DASHBOARD_PORT" \
    --num-gpus="$GPUS_PER_NODE" --block &
  RAY_PIDS=("$!")
  # Workers must find the head's GCS listening; a short pause avoids their first-connect retries.
  sleep "${RAY_HEAD_SETTLE_S:-10}"
  local node
  for node in "$@"; do
    log "Ray worker on $node"
    srun --nodes=1 --ntasks=1 --overlap --gres="gpu:$GPUS_PER_NODE" -w "$node" "${CONTAINER_SRUN[@]}" \
      "${CONTAINER_EXEC[@]}" ray start --address="$RAY_ADDRESS" --num-gpus="$GPUS_PER_NODE" --block &
    RAY_PIDS+=("$!")
  done
}

# wait_for_ray EXPECTED_GPUS TIMEOUT_S NODE... : poll `ray status` until EXPECTED_GPUS have joined;
# on timeout name the nodes that did not.
wait_for_ray() {
  local want="$1" timeout="$2"
  shift 2
  local start have
  start="$(date +%s)"
  while true; do
    have="$(ray_gpus "$RAY_ADDRESS")"
    if (( have >= want )); then
      log "Ray cluster ready: $have/$want GPUs"
      return 0
    fi
    if (( $(date +%s) - start >= timeout )); then
      local alive missing=() node ip
      alive="$(ray_alive_ips "$RAY_ADDRESS")"
      for node in "$@"; do
        ip="$(node_ip "$node")"
        grep -qxF "$ip" <<<"$alive" || missing+=("$node ($ip)")
      done
      local hint="node(s) that did not join: ${missing[*]}"
      (( ${#missing[@]} )) || hint="every node joined but with fewer GPUs; check GPUS_PER_NODE and CUDA_VISIBLE_DEVICES"
      die "Ray cluster not ready after ${timeout}s: $have/$want GPUs. $hint." \
        "See their Ray logs (/tmp/ray/session_latest/logs) or exclude them (sbatch --exclude=NODE)."
    fi
    sleep "${RAY_POLL_S:-5}"
  done
}

stop_ray_cluster() {
  local pid
  for pid in "${RAY_PIDS[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
}

# run_trainer CMD... : run the trainer in the background so a SIGTERM from Slurm (time limit via
# --signal=B:TERM@..., or preemption) reaches the trap at once. The trap forwards it: the trainer
# finishes its step, checkpoints and exits 0; then the job requeues itself and, with
# trainer.resume=auto, continues from that checkpoint.
run_trainer() {
  STOP_REQUESTED=0
  "$@" &
  TRAIN_PID=$!
  trap on_sigterm TERM
  local rc=0
  wait "$TRAIN_PID" || rc=$?
  # `wait` returns early when the trap ran; wait again for the trainer's checkpoint and exit.
  while (( STOP_REQUESTED )) && kill -0 "$TRAIN_PID" 2>/dev/null; do
    rc=0
    wait "$TRAIN_PID" || rc=$?
  done
  trap - TERM
  if (( STOP_REQUESTED )); then
    if [[ "${REQUEUE_ON_STOP:-1}" == 1 && -n "${SLURM_JOB_ID:-}" ]]; then
      log "trainer stopped (rc=$rc); requeueing job $SLURM_JOB_ID (it resumes with trainer.resume=auto)"
      scontrol requeue "$SLURM_JOB_ID"
    fi
    return 0
  fi
  return "$rc"
}

on_sigterm() {
  STOP_REQUESTED=1
  log "SIGTERM: asking the trainer (pid $TRAIN_PID) to finish the step, checkpoint and stop"
  kill -TERM "$TRAIN_PID" 2>/dev/null || true
}

# multi_turn_key RESOLVED_YAML KEY : rollout.multi_turn.KEY of `megatron-dapo config`'s output
# (quotes removed), empty when the output has none.
multi_turn_key() {
  local value
  value="$(awk -v key="$2:" '
    /^  multi_turn:$/ { on = 1; next }
    on && /^    [a-z_]+:/ { if ($1 == key) { sub(/^    [a-z_]+: */, ""); print; exit } next }
    on { exit }' <<<"$1")"
  value="${value#[\"\']}"
  echo "${value%[\"\']}"
}

# check_tool_host RESOLVED_YAML : with rollout.multi_turn on, the tools run in processes of the
# trainer, i.e. on this (the head) node, not on the Ray workers: their YAML must be readable here,
# and the node needs a core for each of rollout.multi_turn.tool_workers besides its own work (a
# trainer rank and an SGLang scheduler per GPU, the driver, Ray's head: TOOL_CPU_RESERVE). Short of
# cores the run still works, but CPU-bound tool code then meets its time-out sooner.
check_tool_host() {
  [[ "$(multi_turn_key "$1" enable)" == true ]] || return 0
  local tools workers cores reserve
  tools="$(multi_turn_key "$1" tool_config_path)"
  workers="$(multi_turn_key "$1" tool_workers)"
  [[ -f "$tools" ]] || die "rollout.multi_turn.tool_config_path=$tools is not a file on the head node," \
    "where the tools run (a relative path in a YAML: beside that YAML, else relative to $PWD)"
  cores="$(nproc)"
  reserve="${TOOL_CPU_RESERVE:-$(( 2 * GPUS_PER_NODE + 8 ))}"
  log "tools run here: rollout.multi_turn.tool_workers=$workers, $cores cores ($reserve counted for the" \
    "node's GPU work), tool YAML $tools"
  if [[ "$workers" =~ ^[0-9]+$ ]] && (( cores < workers + reserve )); then
    local fit=$(( cores > reserve ? cores - reserve : 1 ))
    log "WARNING: rollout.multi_turn.tool_workers=$workers + $reserve for this node's GPU work > its $cores" \
      "cores: tool calls will share cores and time out sooner; set rollout.multi_turn.tool_workers=$fit" \
      "or give the batch step more CPUs"
  fi
  if ! { unshare -rn true || unshare -n true; } >/dev/null 2>&1; then
    log "WARNING: no network namespace here (unshare): the python tool's code is kept off the network" \
      "by its interpreter's audit hook only"
  fi
}

# Containers. CONTAINER_IMAGE set: every step of the job runs in it, the driver's too (config and
# train run as srun steps on the head node, not in the batch shell). CONTAINER_RUNTIME=pyxis (the
# default; Slurm's --container-* flags, enroot) or apptainer (`apptainer exec --nv IMAGE` inside each
# step). CONTAINER_MOUNTS (pyxis, e.g. /shared:/shared) must include the checkout and the data.
setup_container() {
  CONTAINER_SRUN=()
  CONTAINER_EXEC=()
  [[ -n "${CONTAINER_IMAGE:-}" ]] || return 0
  case "${CONTAINER_RUNTIME:-pyxis}" in
    pyxis)
      CONTAINER_SRUN=(--container-image="$CONTAINER_IMAGE" --container-workdir="$PWD")
      [[ -n "${CONTAINER_MOUNTS:-}" ]] && CONTAINER_SRUN+=(--container-mounts="$CONTAINER_MOUNTS")
      ;;
    apptainer) CONTAINER_EXEC=(apptainer exec --nv --pwd "$PWD" "$CONTAINER_IMAGE") ;;
    *) die "CONTAINER_RUNTIME=${CONTAINER_RUNTIME} is not one of: pyxis, apptainer" ;;
  esac
  log "container: ${CONTAINER_RUNTIME:-pyxis} $CONTAINER_IMAGE (driver and Ray nodes)"
}

# DRIVER: the prefix that runs a command where the trainer's driver runs: on the head node in the
# container when there is one (an srun step; srun forwards SIGTERM to it), else nothing (this batch
# shell, on the head node). A prefix, not a function: run_trainer signals the process it starts.
set_driver() {
  DRIVER=()
  if [[ -n "${CONTAINER_IMAGE:-}" ]]; then
    DRIVER=(srun --nodes=1 --ntasks=1 --overlap -w "$1" "${CONTAINER_SRUN[@]}" "${CONTAINER_EXEC[@]}")
  fi
}

# launch_ray_job [key=value ...] : the whole job: Ray over all nodes, then the trainer on the head
# (this batch step's node) with the overrides, requeue on SIGTERM. Before Ray starts, `megatron-dapo
# config` checks every input `train` checks and that the recipe's layout uses the allocation's GPUs
# (nodes x GPUS_PER_NODE): RESIZE=1 applies the overrides `megatron-dapo plan --num-gpus` gives
# for them; otherwise a recipe sized for another allocation stops here, naming those overrides.
launch_ray_job() {
  if [[ -z "${CONTAINER_IMAGE:-}" ]]; then
    activate_env "$PWD"
  fi
  [[ -f "$CONFIG" ]] || die "CONFIG=$CONFIG not found (relative to $PWD)"
  mapfile -t NODES < <(job_nodes)
  (( ${#NODES[@]} >= 1 )) || die "no nodes in SLURM_JOB_NODELIST"
  log "job ${SLURM_JOB_ID:-?} (restart ${SLURM_RESTART_COUNT:-0}) on ${#NODES[@]} node(s): ${NODES[*]}"
  setup_container
  set_driver "${NODES[0]}"
  local gpus=$(( ${#NODES[@]} * GPUS_PER_NODE )) resolved sized=()
  if [[ "${RESIZE:-0}" == 1 ]]; then
    local line
    line="$("${DRIVER[@]}" megatron-dapo plan "$CONFIG" "$@" --num-gpus "$gpus" --gpu "${PLAN_GPU:-h100}" --print-overrides)" \
      || die "RESIZE=1: the planner found no layout of $CONFIG for $gpus GPUs${line:+ (closest: $line)}; see megatron-dapo plan $CONFIG --num-gpus $gpus"
    read -r -a sized <<<"$line"
    log "RESIZE=1: $CONFIG sized to $gpus GPUs: ${sized[*]:-no change}"
  fi
  set -- "$@" "${sized[@]}"
  resolved="$("${DRIVER[@]}" megatron-dapo config "$CONFIG" "$@" --num-gpus "$gpus" --gpu "${PLAN_GPU:-h100}")" \
    || exit 2  # its one line (stderr) says why and the fix; nothing has started yet
  check_tool_host "$resolved"

  start_ray_cluster "${NODES[@]}"
  trap stop_ray_cluster EXIT
  wait_for_ray "$gpus" "$RAY_WAIT_TIMEOUT_S" "${NODES[@]}"

  run_trainer "${DRIVER[@]}" megatron-dapo train "$CONFIG" trainer.ray_address="$RAY_ADDRESS" trainer.resume=auto "$@"
}
