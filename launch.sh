#!/usr/bin/env bash
# Start a job's process group: telemetry, the producer and every consumer of JOB.toml.
#
#   ./launch.sh                  build (once) and run the embedded demo job on the CPU, then evaluate it
#   ./launch.sh JOB.toml         run a job
#   ./launch.sh JOB.toml --dry-run           print the process list, the device map and each GPU's planned
#                                            memory peak (--device-memory GIB: the size of GPUs NVML cannot
#                                            report; --target-config DIR: the target's config.json elsewhere),
#                                            then each stage's time per batch, the bottleneck and samples/s
#                                            (--device h100|h200, --sample-tokens N); exit 3 when a GPU does not fit
#   options: --grace SECONDS (default 60)    how long a stop (SIGINT/SIGTERM/SIGHUP) waits for checkpoints before SIGKILL
#            --nnodes N --node-rank R --master-addr HOST --master-port PORT   (multi-node; or torchrun's env)
#   env:     PYTHON (default .venv/bin/python); DEMO_RUN_DIR (default runs/demo); DEMO_QUICK=1 (seconds-long demo)
#
# One log per process in <run_dir>/logs/ (written through common/log_tee.py, which keeps each process's last lines
# off the run folder's disk, so a process that fails on a full disk still shows why). SIGINT/SIGTERM/SIGHUP stop the group gracefully (consumers
# checkpoint at a step boundary, then exit 0; this script exits 0 when every process did). When a critical
# process (producer, consumer) fails, the rest is torn down and this script exits with its status.
# Telemetry is not critical: restarted if it crashes (exit 0: it was told to stop). If this script dies
# (SIGKILL), every process gets SIGTERM from the kernel (common/supervisor.py) and stops the same graceful way.
# The run folder is locked for the whole group (common/joblock.py): a second launch of the same job is
# refused at once (exit 75) with the holder's pid; the orphans of a launch that died are stopped first.
# When the group ends, the job's ring in /dev/shm and its socket files are removed (never while a process
# of the group still runs); stale ones of an earlier launch are removed at the start.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-$here/.venv/bin/python}
if [[ ! -x $PY ]]; then
  echo "launch.sh: no virtual environment yet; bootstrapping it with 'make install' (one time)" >&2
  make -C "$here" install >&2 || exit 1
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"

job="" dry=0 grace=60 memory_opts=()
nnodes=${NNODES:-1} node_rank=${NODE_RANK:-0}
while (($#)); do
  case $1 in
    --dry-run) dry=1 ;;
    --device-memory|--target-config|--device|--sample-tokens) memory_opts+=("$1" "$2"); shift ;;
    --grace) grace=$2; shift ;;
    --nnodes) nnodes=$2; shift ;;
    --node-rank) node_rank=$2; shift ;;
    --master-addr) export MASTER_ADDR=$2; shift ;;
    --master-port) export MASTER_PORT=$2; shift ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    -*) echo "launch.sh: unknown option $1" >&2; exit 2 ;;
    *) job=$1 ;;
  esac
  shift
done
export NNODES=$nnodes NODE_RANK=$node_rank

unwritable() {  # what, path, the failing command's message: one clear line instead of bash's own, exit 2
  echo "launch.sh: cannot write the run folder $run_dir: $1 $2: ${3##*: } (job.run_dir must be a folder" \
    "$(id -un) can write; fix its permissions or choose another run_dir)" >&2
  exit 2
}
lock_fd=""
take_job_lock() {  # the job lock (run_dir, lock_file), before anything in the run folder is touched; the processes
  # inherit it (and the launch id). Held: by a running launch or a demo build (refused, exit 75, the holder named),
  # or by the orphans of a launch that died (stopped, then the lock is ours).
  local err rc
  err=$(mkdir -p "$run_dir" 2>&1) || unwritable "cannot create" "$run_dir" "$err"
  err=$( { : >>"$lock_file"; } 2>&1) || unwritable "cannot open the job lock" "$lock_file" "$err"
  exec {lock_fd}>>"$lock_file"
  if ! flock -n "$lock_fd"; then
    "$PY" -m common.joblock reclaim "$run_dir" --node-rank "$node_rank" --grace "$grace" >&2
    rc=$?
    if ((rc == 75)) || ! flock -n "$lock_fd"; then
      echo "launch.sh: $run_dir is in use by a running launch of this job; not starting a second one. Holder(s):" >&2
      "$PY" -m common.joblock holders "$run_dir" --node-rank "$node_rank" | sed 's/^/    /' >&2
      exit 75
    fi
  fi
  DFLASH_LAUNCH_ID=$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')
  export DFLASH_LAUNCH_ID DFLASH_SUPERVISOR_PID=$$  # the processes stop when this script dies (common/supervisor.py)
  printf 'pid=%s start=%s launch=%s\n' "$$" "$(date +%Y-%m-%dT%H:%M:%S%z)" "$DFLASH_LAUNCH_ID" >"$lock_file"
}

demo=0
if [[ -z $job ]]; then
  demo=1
  demo_dir=${DEMO_RUN_DIR:-$here/runs/demo}
  if ((!dry)); then  # the lock first: a second demo launch never touches the assets this one builds or trains on
    run_dir=$(realpath -m "$demo_dir") lock_file=$(realpath -m "$demo_dir")/job-n$node_rank.lock
    take_job_lock
  fi
  echo "launch.sh: no job given: preparing the embedded demo job (cached in $demo_dir)"
  job=$("$PY" -m demo prepare "$demo_dir" ${DEMO_QUICK:+--quick}) || exit $?
fi

plan_from() {  # the process list: derived from the job, or (tests' stand-in processes) read from a file
  if [[ -n ${DFLASH_LAUNCH_PLAN_FILE:-} ]]; then cat "$DFLASH_LAUNCH_PLAN_FILE"; return; fi
  "$PY" -m common.launch_plan "$job" --node-rank "$node_rank" --nnodes "$nnodes" $( ((dry)) || echo --check-target)
}
plan=$(plan_from) || exit 2
if ((dry)); then
  printf '%s\n' "$plan" | while IFS=$'\t' read -r name critical log cmd; do
    printf '%-24s critical=%s log=%s\n    %s\n' "$name" "$critical" "$log" "$cmd"
  done
  [[ -n ${DFLASH_LAUNCH_PLAN_FILE:-} ]] && exit 0
  echo
  "$PY" -m common.launch_plan "$job" --device-map --memory "${memory_opts[@]}" --node-rank "$node_rank" --nnodes "$nnodes"
  exit $?  # 3: a device is planned over its memory
fi

info=$("$PY" -m common.joblock info "$job" --node-rank "$node_rank") || exit 2
IFS=$'\t' read -r run_dir lock_file ring_file <<<"$info"
[[ -n $lock_fd ]] || take_job_lock  # the demo took it before building its assets
err=$(mkdir -p "$run_dir/logs" 2>&1) || unwritable "cannot create" "$run_dir/logs" "$err"

remove_job_files() {  # the ring and sockets: only while this script holds the job lock and none of its processes runs
  [[ -n $ring_file ]] && rm -f "$ring_file" "$ring_file"p[0-9]*  # p<r>: the rings of target replicas r > 0
  find "$run_dir/sockets" -maxdepth 1 -type s -delete 2>/dev/null
  rm -f "$run_dir/sockets/control.sock.lock" "$run_dir/sockets/control.endpoint" \
    "$run_dir"/sockets/control-p[0-9]*.sock.lock "$run_dir"/sockets/control-p[0-9]*.endpoint
}
cleanup() {  # every way out of this script passes here (an untrapped signal too): stop what runs, then remove
  trap '' INT TERM HUP
  if alive; then
    echo "launch.sh: exiting while processes of the job run: stopping them first (grace ${grace}s)" >&2
    stop_all
  fi
  alive || remove_job_files
  [[ -n $tail_dir ]] && rm -rf "$tail_dir"
}
remove_job_files  # left by an earlier launch that was killed: the job lock says none of its processes runs
pids=()
trap cleanup EXIT

# CPU threads: the cores shared out among the training processes (more threads than cores slow every step
# down); set OMP_NUM_THREADS yourself to override.
n_training=$(printf '%s\n' "$plan" | grep -vc '^telemetry')
threads=$(( $(nproc) / (n_training > 0 ? n_training : 1) ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}

declare -A name_of=() cmd_of=() log_of=() critical_of=() offset_of=() tail_of=() tee_of=()
declare -a pids=()  # started and not yet collected by `wait`: the only list the supervision trusts
exec {idle_fd}<> <(:)  # a pipe nobody writes: `read -t` on it pauses without a fork (closed in the processes)
# Each process writes into a pipe to common/log_tee.py, which appends to its log and keeps its last lines in
# tail_dir, off the run folder's disk: a process that fails because that disk is full still shows why.
tail_dir=$(mktemp -d "${XDG_RUNTIME_DIR:-/dev/shm}/dflash-tails.XXXXXX" 2>/dev/null || mktemp -d 2>/dev/null) || tail_dir=""
started=0
start() {  # name critical log cmd
  local offset tail="" tee_pid="" tee_fd
  offset=$(stat -c %s "$3" 2>/dev/null || echo 0)  # this launch's part of the log starts here
  if [[ -n $tail_dir ]]; then
    tail="$tail_dir/$((started += 1)).$1"
    exec {tee_fd}> >(exec "$PY" -I -S "$here/common/log_tee.py" "$3" "$tail" {idle_fd}>&- {lock_fd}>&-)
    tee_pid=$!
    ( eval "exec $4" ) >&"$tee_fd" 2>&1 {idle_fd}>&- {tee_fd}>&- &
    exec {tee_fd}>&-  # the process holds the pipe alone: its end is the tee's end
  else
    ( eval "exec $4" ) >>"$3" 2>&1 {idle_fd}>&- &
  fi
  local pid=$!
  name_of[$pid]=$1 critical_of[$pid]=$2 log_of[$pid]=$3 cmd_of[$pid]=$4 offset_of[$pid]=$offset
  tail_of[$pid]=$tail tee_of[$pid]=$tee_pid
  pids+=("$pid")
  printf 'launch.sh: started %-24s pid %-7s log %s\n' "$1" "$pid" "$3"
}
pause() { read -r -t "$1" -u "$idle_fd" _ || (($? > 128)) || sleep "$1"; }  # a trapped signal: acted on after
# Supervision polls: every process that is gone is collected by `wait PID`, once, and leaves the list. Not
# `wait -n`: bash 5.2 loses the status of a child that exits while a trapped signal interrupts `wait -n` (a later
# `wait PID` says -1; an interrupted `wait PID` can even record the signal as another child's status), and a
# signal whose trap runs just before `wait -n` starts leaves it blocked for as long as every process runs.
# Gone: kill -0 fails (bash has collected it) or it is a zombie (bash's collection on SIGCHLD can be put off
# for good); either way `wait` returns at once, with its status.
gone() {
  local stat
  kill -0 "$1" 2>/dev/null && { read -r stat <"/proc/$1/stat"; } 2>/dev/null || return 0
  stat=${stat##*) }
  [[ ${stat%% *} == Z ]]
}
exits=()  # "pid status" of each process the last reap collected
reap() {
  local p out=()
  exits=()
  for p in "${pids[@]}"; do
    if ! gone "$p"; then out+=("$p"); continue; fi
    wait "$p"
    exits+=("$p $?")
  done
  pids=("${out[@]}")
}
alive() { local p; for p in "${pids[@]}"; do gone "$p" || return 0; done; return 1; }
own_tail() {  # the last lines this launch's process wrote (an earlier run's lines are not its reason); a full disk named
  local t=${tail_of[$1]} i
  if [[ -n $t ]]; then
    for ((i = 0; i < 30; i++)); do gone "${tee_of[$1]}" && break; pause 0.1; done  # its last lines are in
  fi
  if [[ -n $t && -f $t ]]; then
    tail -n 5 "$t" | sed 's/^/    /' >&2
    [[ -f $t.lost ]] && sed 's/^/    (/; s/$/)/' "$t.lost" >&2
  else
    tail -c +"$((offset_of[$1] + 1))" "${log_of[$1]}" 2>/dev/null | tail -n 5 | sed 's/^/    /' >&2
  fi
  # grep reads the files itself: `cat | grep -q` under pipefail failed whenever grep's early exit cut cat's write
  if grep -qsiE 'no space left on device|errno 28|os error 28|ENOSPC|disk quota exceeded' "$t" "$t.lost"; then
    local free mount
    read -r free mount < <(df -P -k "$run_dir" 2>/dev/null | awk 'NR == 2 { print $4, $6 }')
    echo "launch.sh: ${name_of[$1]} failed on a full disk: $run_dir is on ${mount:-?}," \
      "$(( ${free:-0} / 1024 )) MiB free now. Free space there, then run the same command again: it resumes" \
      "from the last intact checkpoint" >&2
  fi
}

stop_all() {  # [report]: SIGTERM to every process, each collected as it exits, SIGKILL to what outlives the grace period
  local deadline=$((SECONDS + grace)) killed=0 p st e
  stop_status=0  # the first non-zero status of a critical process
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  while :; do
    reap
    for e in "${exits[@]}"; do
      read -r p st <<<"$e"
      [[ ${critical_of[$p]} == 1 && $st != 0 ]] || continue
      ((stop_status)) || stop_status=$st
      [[ ${1:-} == report ]] || continue
      echo "launch.sh: ${name_of[$p]} exited with status $st (log ${log_of[$p]})" >&2
      own_tail "$p"
    done
    ((${#pids[@]})) || break
    if ((SECONDS >= deadline)); then
      ((killed)) && { echo "launch.sh: still running 10 s after SIGKILL: pids ${pids[*]}" >&2; break; }
      for p in "${pids[@]}"; do
        echo "launch.sh: ${name_of[$p]} (pid $p) still running after ${grace}s: SIGKILL" >&2
        kill -KILL "$p" 2>/dev/null
      done
      killed=1 deadline=$((SECONDS + 10))
    fi
    pause 0.2
  done
  ((!killed))
}

# A signal only sets stop_sig; the loops act on it (the traps stay until no process of the group runs).
stop_sig=""
trap 'stop_sig=SIGTERM' TERM
trap 'stop_sig=SIGINT' INT
trap 'stop_sig=SIGHUP' HUP  # a closed SSH session: the same graceful stop, never a half-deleted running job
stop_on_signal() {
  trap '' INT TERM HUP
  echo "launch.sh: $stop_sig received: stopping the job (grace ${grace}s)"
  local status=0
  stop_all report || status=137
  ((stop_status)) && status=$stop_status
  exit "$status"
}

while IFS=$'\t' read -r name critical log cmd; do
  start "$name" "$critical" "$log" "$cmd"
done <<<"$plan"
# A progress line per drafter on this terminal (telemetry/progress.py; it only reads telemetry). Not one of the
# supervised processes: it ends when the drafters do, or is stopped (and collected) first thing on the way out.
"$PY" -m telemetry.progress "$job" {lock_fd}>&- &
progress_pid=$!
trap 'kill "$progress_pid" 2>/dev/null; wait "$progress_pid" 2>/dev/null; cleanup' EXIT

status=0 critical_left=0 telemetry_restarts=0
for p in "${pids[@]}"; do [[ ${critical_of[$p]} == 1 ]] && ((critical_left++)); done
while ((critical_left > 0 && status == 0)); do
  pause 0.2
  [[ -n $stop_sig ]] && stop_on_signal  # what exited with the signal is collected (and named) by the stop
  reap
  for e in "${exits[@]}"; do
    read -r done_pid st <<<"$e"
    name=${name_of[$done_pid]}
    if [[ ${critical_of[$done_pid]} == 0 ]]; then  # telemetry: exits 0 only when told to stop (a signal, launch.sh gone)
      if ((st != 0)) && ((telemetry_restarts < 20)); then
        pause 1
        [[ -n $stop_sig ]] && continue  # not while the group stops
        telemetry_restarts=$((telemetry_restarts + 1))
        echo "launch.sh: $name exited with status $st; restarting it (training goes on)"
        start "$name" 0 "${log_of[$done_pid]}" "${cmd_of[$done_pid]}"
      fi
      continue
    fi
    critical_left=$((critical_left - 1))
    if ((st != 0)); then
      echo "launch.sh: $name exited with status $st (log ${log_of[$done_pid]}); tearing the job down" >&2
      own_tail "$done_pid"
      status=$st
      stop_all
      break
    fi
    echo "launch.sh: $name finished"
  done
done
if ((status == 0)); then
  stop_all  # telemetry: flushes its sinks on SIGTERM
  [[ -n $stop_sig ]] && stop_on_signal  # a stop asked for as the job ended: no evaluation
fi
trap - INT TERM HUP

if ((status == 0 && demo)); then
  echo "launch.sh: evaluating the demo drafters by speculative decoding"
  "$PY" -m demo evaluate "$job" || status=$?
fi
# Pictures of the run (loss, τ, tokens/s; the demo's acceptance histogram), however it ended, never changing its
# status: for the demo and on a terminal; DFLASH_PLOTS=1 always, =0 never (later: dflash-stats RUN_DIR --plot).
if [[ ${DFLASH_PLOTS:-} == 1 ]] || { [[ ${DFLASH_PLOTS:-} != 0 ]] && { ((demo)) || [[ -t 1 ]]; }; }; then
  "$PY" -m telemetry.plot "$run_dir" 2>&1 | sed 's/^/launch.sh: plots: /'
fi
exit "$status"
