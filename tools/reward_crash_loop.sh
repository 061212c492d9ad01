#!/bin/bash
# A served reward model that dies every time it has served for a while: the demo with a tiny
# classifier served by SGLang, its server killed (SIGKILL) KILL_AFTER_S seconds after each time it
# answers /health, until the run stops. What it measures: the run survives
# reward.model.max_restarts restarts with every sample scored, then stops in one line naming the
# server, its log and its restarts, the last checkpoint kept (docs/reward_models.md).
#
#   tools/reward_crash_loop.sh [KILL_AFTER_S=45]
set -u
cd "$(dirname "$0")/.."
repo=$PWD
after=${1:-45}
out=runs/crash_loop_tool
rm -rf "$out" runs/crash_loop
mkdir -p "$out"
PYTHONPATH=$repo:$repo/tests .venv/bin/python -c "
from reward_model_fixtures import make_tiny_classifier
make_tiny_classifier('$out/classifier')
" > /dev/null 2>&1 || { echo "could not build the tiny classifier"; exit 1; }
start=$(date +%s)
PYTHONPATH=$repo .venv/bin/python -m megatron_dapo.cli demo --bar-gain 0 --bar-final 0 \
  reward.model.kind=classifier reward.model.path="$out/classifier" trainer.total_steps=40 \
  trainer.run_name=crash_loop trainer.save_freq=1 > "$out/demo.log" 2>&1 &
demo=$!
kills=0
while kill -0 $demo 2>/dev/null; do
  pid=$(pgrep -f "sglang.launch_server --model-path $repo/runs/crash_loop/reward_model_served" | head -1)
  if [ -z "$pid" ]; then sleep 1; continue; fi
  args=$(tr '\0' ' ' < /proc/$pid/cmdline 2>/dev/null)
  host=$(echo "$args" | sed -n 's/.*--host \([^ ]*\).*/\1/p')
  port=$(echo "$args" | sed -n 's/.*--port \([0-9]*\).*/\1/p')
  until curl -s -o /dev/null -m 2 "http://$host:$port/health" || ! kill -0 $pid 2>/dev/null; do sleep 1; done
  kill -0 $pid 2>/dev/null || continue
  sleep "$after"
  if kill -0 $pid 2>/dev/null; then
    kill -9 $pid; kills=$((kills + 1))
    echo "$(( $(date +%s) - start )) s: killed the reward server (pid $pid, kill $kills)"
  fi
done
wait $demo
echo "demo exit $? after $(( $(date +%s) - start )) s, $kills kills; its last line:"
grep -a "^failed:\|^error:" "$out/demo.log" | tail -1
