#!/bin/bash
# Start SGLang servers on this node: one per group of TP_SIZE GPUs (CUDA_VISIBLE_DEVICES), ports
# BASE_PORT, BASE_PORT+1, ...; wait until each answers /health_generate; print their URLs.
#   MODEL_PATH=/shared/Qwen2.5-32B TP_SIZE=4 bash launch/start_sglang_servers.sh          # start, return
#   MODEL_PATH=... TP_SIZE=4 bash launch/start_sglang_servers.sh --block                   # stay, own them
# With --block the script stays in the foreground and stops the servers when it is signalled or one
# of them exits (use it as a `srun` step). Without it the servers outlive the script; their PIDs
# are in $LOG_DIR/sglang_pids.
set -euo pipefail

# ---- what to change -------------------------------------------------------------------------
MODEL_PATH="${MODEL_PATH:?set MODEL_PATH to the HF checkpoint directory the servers load}"
TP_SIZE="${TP_SIZE:-1}"                        # GPUs per engine (rollout.tensor_parallel_size)
GPUS_PER_NODE="${GPUS_PER_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
FIRST_GPU="${FIRST_GPU:-0}"                    # disaggregated: leave GPUs 0..FIRST_GPU-1 to the actor
BASE_PORT="${BASE_PORT:-30000}"                # rollout.sglang.base_port
HOST="${HOST:-0.0.0.0}"                        # bind address; clients use this node's IP
MEM_FRACTION="${MEM_FRACTION:-0.7}"            # rollout.sglang.mem_fraction_static
STARTUP_TIMEOUT_S="${STARTUP_TIMEOUT_S:-900}"  # rollout.sglang.startup_timeout_s
LOG_DIR="${LOG_DIR:-runs/sglang_logs/$(hostname)}"
PYTHON="${PYTHON:-python}"
# Extra server flags, e.g. SGLANG_EXTRA_ARGS="--enable-memory-saver --api-key KEY".
read -r -a EXTRA <<<"${SGLANG_EXTRA_ARGS:-}"
# ---------------------------------------------------------------------------------------------

BLOCK=0
[[ "${1:-}" == "--block" ]] && BLOCK=1

log() { echo "[sglang $(hostname) $(date +%H:%M:%S)] $*" >&2; }

(( GPUS_PER_NODE > FIRST_GPU )) || { log "no GPUs to use (GPUS_PER_NODE=$GPUS_PER_NODE, FIRST_GPU=$FIRST_GPU)"; exit 1; }
(( (GPUS_PER_NODE - FIRST_GPU) % TP_SIZE == 0 )) \
  || { log "$((GPUS_PER_NODE - FIRST_GPU)) GPUs do not split into engines of TP_SIZE=$TP_SIZE"; exit 1; }
NUM_ENGINES=$(( (GPUS_PER_NODE - FIRST_GPU) / TP_SIZE ))
mkdir -p "$LOG_DIR"
: >"$LOG_DIR/sglang_pids"

PIDS=()
PORTS=()
for (( i = 0; i < NUM_ENGINES; i++ )); do
  first=$(( FIRST_GPU + i * TP_SIZE ))
  devices="$(seq -s, "$first" $(( first + TP_SIZE - 1 )))"
  port=$(( BASE_PORT + i ))
  log "engine $i: GPUs $devices, port $port, log $LOG_DIR/engine_$i.log"
  CUDA_VISIBLE_DEVICES="$devices" "$PYTHON" -m sglang.launch_server \
    --model-path "$MODEL_PATH" --tp-size "$TP_SIZE" --host "$HOST" --port "$port" \
    --mem-fraction-static "$MEM_FRACTION" --skip-server-warmup "${EXTRA[@]}" \
    >"$LOG_DIR/engine_$i.log" 2>&1 &
  PIDS+=("$!")
  PORTS+=("$port")
  echo "$!" >>"$LOG_DIR/sglang_pids"
done

stop_all() {
  local pid
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
}

start="$(date +%s)"
for i in "${!PORTS[@]}"; do
  until curl -sf -o /dev/null "http://127.0.0.1:${PORTS[$i]}/health_generate"; do
    if ! kill -0 "${PIDS[$i]}" 2>/dev/null; then
      log "engine $i (port ${PORTS[$i]}) exited during startup; last lines of its log:"
      tail -n 30 "$LOG_DIR/engine_$i.log" >&2 || true
      stop_all
      exit 1
    fi
    if (( $(date +%s) - start >= STARTUP_TIMEOUT_S )); then
      log "engine $i (port ${PORTS[$i]}) not healthy after ${STARTUP_TIMEOUT_S}s; see $LOG_DIR/engine_$i.log"
      stop_all
      exit 1
    fi
    sleep 5
  done
  log "engine $i healthy"
done

IP="$(hostname --ip-address | awk '{print $1}')"
for port in "${PORTS[@]}"; do echo "http://$IP:$port"; done

if (( BLOCK )); then
  trap 'stop_all; exit 0' TERM INT
  # Return (and stop the rest) as soon as any server exits: a dead engine should fail the job.
  wait -n "${PIDS[@]}" || true
  log "an engine exited; stopping the others"
  stop_all
  exit 1
fi
