#!/usr/bin/env bash
# Start a job's process group: telemetry, the producer and every consumer of JOB.toml.
#
#   ./launch.sh                  build (once) and run the embedded demo job on the CPU, then evaluate it
#   ./launch.sh JOB.toml         run a job
#   ./launch.sh JOB.toml --dry-run           print the process list and exit
#   options: --grace SECONDS (default 60)    how long SIGINT/SIGTERM waits for checkpoints before SIGKILL
#            --nnodes N --node-rank R --master-addr HOST --master-port PORT   (multi-node; or torchrun's env)
#   env:     PYTHON (default .venv/bin/python); DEMO_RUN_DIR (default runs/demo); DEMO_QUICK=1 (seconds-long demo)
#
# One log per process in <run_dir>/logs/. SIGINT/SIGTERM are forwarded (consumers checkpoint at a step
# boundary, then exit 0). When a critical process (producer, consumer) fails, the rest is torn down and
# this script exits with its status. Telemetry is not critical: it is restarted if it dies.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-$here/.venv/bin/python}
if [[ ! -x $PY ]]; then
  echo "launch.sh: no virtual environment yet; bootstrapping it with 'make install' (one time)" >&2
  make -C "$here" install >&2 || exit 1
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"

job="" dry=0 grace=60
nnodes=${NNODES:-1} node_rank=${NODE_RANK:-0}
while (($#)); do
  case $1 in
    --dry-run) dry=1 ;;
    --grace) grace=$2; shift ;;
    --nnodes) nnodes=$2; shift ;;
    --node-rank) node_rank=$2; shift ;;
    --master-addr) export MASTER_ADDR=$2; shift ;;
    --master-port) export MASTER_PORT=$2; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    -*) echo "launch.sh: unknown option $1" >&2; exit 2 ;;
    *) job=$1 ;;
  esac
  shift
done
export NNODES=$nnodes NODE_RANK=$node_rank

demo=0
if [[ -z $job ]]; then
  demo=1
  demo_dir=${DEMO_RUN_DIR:-$here/runs/demo}
  echo "launch.sh: no job given: preparing the embedded demo job (cached in $demo_dir)"
  job=$("$PY" -m demo prepare "$demo_dir" ${DEMO_QUICK:+--quick}) || exit 1
fi

plan=$("$PY" -m common.launch_plan "$job" --node-rank "$node_rank" --nnodes "$nnodes") || exit 2
if ((dry)); then
  printf '%s\n' "$plan" | while IFS=$'\t' read -r name critical log cmd; do
    printf '%-24s critical=%s log=%s\n    %s\n' "$name" "$critical" "$log" "$cmd"
  done
  exit 0
fi

# CPU threads: the cores shared out among the training processes (more threads than cores slow every step
# down); set OMP_NUM_THREADS yourself to override.
n_training=$(printf '%s\n' "$plan" | grep -vc '^telemetry')
threads=$(( $(nproc) / (n_training > 0 ? n_training : 1) ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}

declare -A name_of=() cmd_of=() log_of=() critical_of=()
declare -a pids=()
start() {  # name critical log cmd
  ( eval "exec $4" ) >>"$3" 2>&1 &
  local pid=$!
  name_of[$pid]=$1 critical_of[$pid]=$2 log_of[$pid]=$3 cmd_of[$pid]=$4
  pids+=("$pid")
  printf 'launch.sh: started %-24s pid %-7s log %s\n' "$1" "$pid" "$3"
}
alive() { local p out=(); for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && out+=("$p"); done; pids=("${out[@]}"); }

stop_all() {  # signal: TERM everyone, wait up to the grace period, then KILL what is left
  local sig=$1 deadline=$((SECONDS + grace)) p
  alive
  for p in "${pids[@]}"; do kill -"$sig" "$p" 2>/dev/null; done
  while ((SECONDS < deadline)); do
    alive
    ((${#pids[@]} == 0)) && return 0
    sleep 0.2
  done
  alive
  for p in "${pids[@]}"; do
    echo "launch.sh: ${name_of[$p]} (pid $p) still running after ${grace}s: SIGKILL" >&2
    kill -KILL "$p" 2>/dev/null
  done
  return 1
}

on_signal() {
  trap '' INT TERM
  echo "launch.sh: $1 received: stopping the job (grace ${grace}s)"
  local status=0 p
  stop_all TERM || status=137
  for p in "${!name_of[@]}"; do
    wait "$p" 2>/dev/null
    local st=$?
    [[ ${critical_of[$p]} == 1 && $st != 0 && $st != 127 ]] && status=$st
  done
  exit "$status"
}
trap 'on_signal SIGTERM' TERM
trap 'on_signal SIGINT' INT

while IFS=$'\t' read -r name critical log cmd; do
  start "$name" "$critical" "$log" "$cmd"
done <<<"$plan"

status=0 critical_left=0 telemetry_restarts=0
for p in "${pids[@]}"; do [[ ${critical_of[$p]} == 1 ]] && ((critical_left++)); done
while ((critical_left > 0)); do
  done_pid=""
  wait -n -p done_pid "${pids[@]}"
  st=$?
  alive
  [[ -z $done_pid ]] && continue
  name=${name_of[$done_pid]}
  if [[ ${critical_of[$done_pid]} == 0 ]]; then
    if ((telemetry_restarts < 20)); then
      telemetry_restarts=$((telemetry_restarts + 1))
      echo "launch.sh: $name exited with status $st; restarting it (training goes on)"
      sleep 1
      start "$name" 0 "${log_of[$done_pid]}" "${cmd_of[$done_pid]}"
    fi
    continue
  fi
  critical_left=$((critical_left - 1))
  if ((st != 0)); then
    echo "launch.sh: $name exited with status $st (log ${log_of[$done_pid]}); tearing the job down" >&2
    tail -n 5 "${log_of[$done_pid]}" | sed 's/^/    /' >&2
    status=$st
    stop_all TERM
    break
  fi
  echo "launch.sh: $name finished"
done
trap - INT TERM
((status == 0)) && stop_all TERM  # telemetry: flushes its sinks on SIGTERM

if ((status == 0 && demo)); then
  echo "launch.sh: evaluating the demo drafters by speculative decoding"
  "$PY" -m demo evaluate "$job" || status=$?
fi
exit "$status"
