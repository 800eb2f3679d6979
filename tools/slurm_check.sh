#!/bin/bash
# Run recipes/launch/slurm-cpu.sbatch (the GPU template with only the CPU changes, tests/test_slurm.py)
# on a real SLURM: Debian's slurmctld + two slurmd + munge on this machine, state under a temporary
# folder, daemons stopped at the end (also on failure or Ctrl-C). Needs root and
#   apt-get install -y slurmctld slurmd slurm-client munge
#
#   tools/slurm_check.sh                 # every case; prints one line per case with its figures
#   CASES="baseline scancel" tools/slurm_check.sh
#
# Cases (each a job of 2 tasks × 4 simulated CPU devices, `tiny`, STEPS steps, --ckpt-every 10):
#   baseline  uninterrupted: the losses the others must reproduce bit for bit; one line per process
#             naming it, Gloo's connection lines summarised
#   scancel   `scancel --signal=TERM` mid-run → save, exit 99, `scontrol requeue`, resume, same losses
#   startup   the same SIGTERM before the first step → exit at once (nothing to save), requeue
#   timelimit `--time=2 --signal=TERM@30`, each step 1 s slower: SLURM's own time-limit warning → requeue(s) → same losses
#   kill9     `kill -9` of task 1 → the job script retries (same allocation) → completes, same losses
#   nodes     `sbatch --nodes=1`: the mesh follows (data=1 × fsdp=4), no edit
# One run of all six on 2 busy cores: 1656 s, most of it SLURM's ~2-minute hold on each requeued job
# (README, "On SLURM", has the figures per case).
# Environment: MESHTRAIN_PYTHON (the python with meshtrain; default python3), SLURM_CHECK_DIR (the
# work folder; default a new temporary one, removed at the end unless KEEP=1), STEPS (default 100).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${MESHTRAIN_PYTHON:-python3}
STEPS=${STEPS:-100}
CASES=${CASES:-"baseline scancel startup timelimit kill9 nodes"}
T=${SLURM_CHECK_DIR:-$(mktemp -d /tmp/slurm-check.XXXXXX)}
T=$(cd "$T" && pwd)/slurm
H=$(hostname)
START=$(date +%s)
FAILED=0

say() { printf '[slurm_check %4ss] %s\n' "$(( $(date +%s) - START ))" "$*"; }
fail() { say "FAIL: $*"; FAILED=1; }
die() { say "FATAL: $*"; exit 1; }

for tool in munged slurmctld slurmd sbatch scontrol; do
  command -v "$tool" >/dev/null || die "$tool not found: apt-get install -y slurmctld slurmd slurm-client munge"
done
[ "$(id -u)" = 0 ] || die "run as root (the daemons run as root with their state under $T)"
getent hosts "$H" >/dev/null || die "this machine's name $H does not resolve: the coordinator is the first node"

# -- the cluster --------------------------------------------------------------------------------------
stop_daemons() {
  trap - EXIT INT TERM
  if [ -f "$T/slurmctld.pid" ] && [ -n "$(squeue -h -o %i 2>/dev/null)" ]; then   # jobs outlive slurmd
    scancel --partition=check 2>/dev/null
    for _ in $(seq 60); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 1; done
  fi
  for f in "$T"/slurmd-*.pid "$T/slurmctld.pid" "$T/munged.pid"; do
    [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null
  done
  sleep 1
  if [ "${KEEP:-0}" != 1 ] && [ -z "${SLURM_CHECK_DIR:-}" ]; then rm -rf "$(dirname "$T")"; fi
}
trap stop_daemons EXIT
trap 'stop_daemons; exit 143' INT TERM   # (a trap alone would go on with the next case)

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

mkdir -p "$T"/{state,spool,log,bin,work}
chmod 700 "$T"
dd if=/dev/urandom of="$T/munge.key" bs=1024 count=1 status=none && chmod 400 "$T/munge.key"
munged --force --key-file="$T/munge.key" --socket="$T/munge.sock" --pid-file="$T/munged.pid" \
  --log-file="$T/log/munged.log" --seed-file="$T/munge.seed" || die "munged did not start"
# Two slurmd on this host: node 1 is named after it (the coordinator is the first node of a job and
# must resolve); node 2 only ever comes second. Cores are oversubscribed: each node says 2 CPUs.
cat > "$T/slurm.conf" <<CONF
ClusterName=meshtrain-check
SlurmctldHost=$H(127.0.0.1)
SlurmctldPort=$(free_port)
AuthType=auth/munge
AuthInfo=socket=$T/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$T/state
SlurmdSpoolDir=$T/spool/%n
SlurmctldPidFile=$T/slurmctld.pid
SlurmdPidFile=$T/slurmd-%n.pid
SlurmctldLogFile=$T/log/slurmctld.log
SlurmdLogFile=$T/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=3600
NodeName=$H NodeAddr=127.0.0.1 CPUs=2 RealMemory=4000 Port=$(free_port)
NodeName=${H}x2 NodeHostname=$H NodeAddr=127.0.0.1 CPUs=2 RealMemory=4000 Port=$(free_port)
PartitionName=check Nodes=$H,${H}x2 Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF=$T/slurm.conf
slurmctld -f "$SLURM_CONF" || die "slurmctld did not start: $(tail -3 "$T/log/slurmctld.log")"
slurmd -f "$SLURM_CONF" -N "$H" && slurmd -f "$SLURM_CONF" -N "${H}x2" || die "slurmd did not start"
for _ in $(seq 60); do
  [ "$(sinfo -h -o '%T' -t idle | wc -l)" -ge 1 ] && [ "$(sinfo -h -N -o '%T' | grep -c idle)" = 2 ] && break
  sleep 1
done
[ "$(sinfo -h -N -o '%T' | grep -c idle)" = 2 ] || die "the nodes did not come up: $(sinfo -N)"
say "SLURM $(sinfo -V | cut -d' ' -f2) up: 2 nodes ($H, ${H}x2) on this machine, state in $T"

# `meshtrain` for the jobs: this checkout with the given python (the template calls `meshtrain train`).
printf '#!/bin/sh\nexec "%s" -m meshtrain "$@"\n' "$(command -v "$PY")" > "$T/bin/meshtrain"
chmod +x "$T/bin/meshtrain"
export PATH="$T/bin:$PATH" PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" STEPS

# -- helpers ------------------------------------------------------------------------------------------
cd "$T/work" || die "no $T/work"
submit() { sbatch --parsable --job-name="$1" "${@:2}" "$ROOT/recipes/launch/slurm-cpu.sbatch" | cut -d';' -f1; }
field() { scontrol show job "$1" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$2=//p" | head -1; }
rundir() { echo "$T/work/runs/$(field "$1" JobName)-$1"; }
log() { echo "$T/work/$(field "$1" JobName)-$1.out"; }
last_step() { "$PY" - "$1" <<'PY'
import json, sys
steps = [0]
try:
    steps += [json.loads(l).get("step") or 0 for l in open(sys.argv[1] + "/metrics.jsonl") if '"loss"' in l]
except OSError:
    pass
print(max(steps))
PY
}
losses() { "$PY" - "$1" <<'PY'
import json, sys
by_step = {}
for line in open(sys.argv[1] + "/metrics.jsonl"):
    r = json.loads(line)
    if "loss" in r and "step" in r:
        by_step[r["step"]] = r["loss"]   # a resumed run rewrites the steps after its checkpoint
print(json.dumps([by_step[s] for s in sorted(by_step)]))
PY
}
# wait_state JOB STATE SECONDS: until the job is in STATE (COMPLETED, RUNNING, ...)
wait_state() {
  local until=$(( $(date +%s) + $3 )) s
  while [ "$(date +%s)" -lt "$until" ]; do
    s=$(field "$1" JobState)
    [ "$s" = "$2" ] && return 0
    case $s in FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY) [ "$2" != "$s" ] && return 1 ;; esac
    sleep 1
  done
  return 1
}
wait_step() {   # wait_step JOB STEP SECONDS: until the run's metrics reach STEP
  local until=$(( $(date +%s) + $3 ))
  while [ "$(date +%s)" -lt "$until" ]; do
    [ "$(last_step "$(rundir "$1")")" -ge "$2" ] && return 0
    [ "$(field "$1" JobState)" = RUNNING ] || [ "$(field "$1" JobState)" = PENDING ] || return 1
    sleep 0.5
  done
  return 1
}
has() { grep -q -- "$2" "$(log "$1")" || { fail "$3: no \"$2\" in $(log "$1")"; return 1; }; }
same_losses() {
  if [ "$(losses "$(rundir "$1")")" = "$BASELINE" ]; then say "  losses of all $STEPS steps bit-identical to the baseline"
  else fail "$2: losses differ from the baseline: $(losses "$(rundir "$1")") vs $BASELINE"; fi
}
elapsed() { echo $(( $(date +%s) - $1 )); }
# task_pid JOB PROCID: the pid of the training process of that task
task_pid() {
  local pid
  for pid in $(pgrep -f "meshtrain train"); do
    if tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx "SLURM_JOB_ID=$1" &&
       tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx "SLURM_PROCID=$2" &&
       [ "$(cat "/proc/$pid/comm")" != sh ]; then echo "$pid"; return 0; fi
  done
  return 1
}
report() {   # one summary line: requeues, attempts, state
  say "  $(field "$1" JobState), Restarts=$(field "$1" Restarts); log $(log "$1") ($(grep -c '' "$(log "$1")") lines)"
}

# -- the cases ----------------------------------------------------------------------------------------
case_baseline() {
  local t0 job; t0=$(date +%s); job=$(submit baseline)
  wait_state "$job" COMPLETED 900 || { fail "baseline: job $job is $(field "$job" JobState)"; return; }
  BASELINE=$(losses "$(rundir "$job")")
  say "baseline: job $job COMPLETED in $(elapsed "$t0") s, $STEPS steps"
  has "$job" "process 0 of 2, coordinator $H:" baseline; has "$job" "process 1 of 2" baseline
  has "$job" "4 local of 8 devices" baseline; has "$job" 'Gloo "connected to N peer ranks" lines' baseline
  grep -q '\[Gloo\] Rank' "$(log "$job")" && fail "baseline: raw Gloo lines in the log"
  report "$job"
}

case_scancel() {
  local t0 job; t0=$(date +%s); job=$(submit scancel)
  wait_step "$job" $(( STEPS / 2 )) 900 || { fail "scancel: job $job never reached step $(( STEPS / 2 ))"; return; }
  local sent; sent=$(date +%s); scancel --signal=TERM "$job"
  say "scancel: job $job at step $(last_step "$(rundir "$job")"): scancel --signal=TERM"
  wait_state "$job" COMPLETED 900 || { fail "scancel: job $job is $(field "$job" JobState)"; return; }
  say "  COMPLETED $(elapsed "$sent") s after the signal ($(elapsed "$t0") s in all)"
  [ "$(field "$job" Restarts)" -ge 1 ] || fail "scancel: job $job was not requeued"
  has "$job" "SIGTERM: stopped after step" scancel; has "$job" "requeueing" scancel
  has "$job" "requeue 1, attempt 0" scancel; has "$job" "from step" scancel
  same_losses "$job" scancel; report "$job"
}

case_startup() {   # SIGTERM once the plan is written, before step 1 (initialisation, compilation)
  local job; job=$(submit startup)
  wait_state "$job" RUNNING 300 || { fail "startup: job $job did not start"; return; }
  local run; run=$(rundir "$job")
  for _ in $(seq 6000); do [ -e "$run/plan.json" ] && break; sleep 0.05; done
  local pid; pid=$(task_pid "$job" 1) || { fail "startup: no process for task 1 of job $job"; return; }
  local sent; sent=$(date +%s.%N); scancel --signal=TERM "$job"
  local at; at=$(last_step "$run")
  for _ in $(seq 1200); do [ -d "/proc/$pid" ] || break; sleep 0.05; done
  local took; took=$("$PY" -c "import sys, time; print(f'{time.time() - float(sys.argv[1]):.1f}')" "$sent")
  say "startup: job $job, SIGTERM once plan.json was written (last logged step: $at): task 1 gone ${took} s later"
  wait_state "$job" COMPLETED 900 || { fail "startup: job $job is $(field "$job" JobState)"; return; }
  [ "$(field "$job" Restarts)" -ge 1 ] || fail "startup: job $job was not requeued"
  has "$job" "SIGTERM during start-up" startup; same_losses "$job" startup; report "$job"
}

case_timelimit() {
  # each step sleeps 1 s more (the test-only `slow` fault: the losses are unchanged), so the run outlasts the
  # warning 90 s into its 2 minutes however fast this machine is (a quiet one trains the 100 steps in ~60 s)
  local t0 job; t0=$(date +%s)
  job=$(MESHTRAIN_FAULT="slow@step=1,process=0,seconds=1" submit timelimit --time=2 --signal=TERM@30)
  wait_state "$job" COMPLETED 1500 || { fail "timelimit: job $job is $(field "$job" JobState)"; return; }
  say "timelimit: job $job (--time=2 --signal=TERM@30) COMPLETED in $(elapsed "$t0") s"
  [ "$(field "$job" Restarts)" -ge 1 ] || fail "timelimit: job $job was not requeued"
  has "$job" "requeueing" timelimit; same_losses "$job" timelimit; report "$job"
}

case_kill9() {
  local t0 job; t0=$(date +%s); job=$(submit kill9)
  wait_step "$job" $(( STEPS / 2 )) 900 || { fail "kill9: job $job never reached step $(( STEPS / 2 ))"; return; }
  local pid; pid=$(task_pid "$job" 1) || { fail "kill9: no process for task 1 of job $job"; return; }
  kill -9 "$pid"
  say "kill9: job $job at step $(last_step "$(rundir "$job")"): kill -9 of task 1 (pid $pid)"
  wait_state "$job" COMPLETED 900 || { fail "kill9: job $job is $(field "$job" JobState)"; return; }
  say "  COMPLETED $(elapsed "$t0") s after submission"
  has "$job" "retry 1/" kill9; [ "$(field "$job" Restarts)" = 0 ] || fail "kill9: requeued instead of retried"
  same_losses "$job" kill9; report "$job"
}

case_nodes() {
  local t0 job; t0=$(date +%s); job=$(STEPS=20 submit nodes --nodes=1 --nodelist="$H")
  wait_state "$job" COMPLETED 900 || { fail "nodes: job $job is $(field "$job" JobState)"; return; }
  say "nodes: job $job (sbatch --nodes=1) COMPLETED in $(elapsed "$t0") s"
  has "$job" "process 0 of 1" nodes; has "$job" "mesh data=1 × fsdp=4" nodes; report "$job"
}

BASELINE=
for c in $CASES; do
  if [ "$c" != baseline ] && [ -z "$BASELINE" ] && [ "$c" != nodes ]; then case_baseline; fi
  "case_$c"
done
say "events.jsonl of each run: $T/work/runs/*/events.jsonl; logs: $T/work/*.out"
if [ "$FAILED" = 0 ]; then say "all cases passed ($CASES) in $(elapsed "$START") s"; else say "some cases FAILED"; exit 1; fi
