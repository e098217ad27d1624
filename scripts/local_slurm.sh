#!/usr/bin/env bash
# A real Slurm cluster on this one machine, for CI and for trying the Slurm recipes: Debian's
# munge, slurmctld and N slurmd daemons, each slurmd a "virtual node" (node1..nodeN) on
# 127.0.0.1 with its own port. Heterogeneous jobs need N >= 2: the backfill scheduler places
# the components of a het job on different nodes. Each node declares the size of a GPU node
# (128 CPUs, 8 "GPUs" whose device files are empty stand-ins; accepted as configured:
# SlurmdParameters=config_overrides)
# so that the GPU recipes in slurm/ pass `sbatch --test-only`; the CPU jobs the tests run ask for
# a few CPUs and no GPU, and share the machine's real cores.
#
#   scripts/local_slurm.sh up        # install (apt, once), start, wait until every node is idle
#   scripts/local_slurm.sh down      # cancel jobs, stop the daemons this script started, wipe state
#   scripts/local_slurm.sh status    # sinfo + squeue
#   eval "$(scripts/local_slurm.sh env)"   # SLURM_CONF for sbatch/srun/squeue/darl-train
#
# Settings (environment): DARL_SLURM_HOME (state, config, logs; default /tmp/darl-slurm),
# DARL_SLURM_NODES (default 3: the Qwen3-4B recipe has 2 trainer nodes + 1 rollout node). Needs root (daemons run as root, munge as its own user); no
# systemd, no cgroups (process tracking by parent pid), no accounting database: `sacct` answers
# "accounting storage is disabled" and the launcher reads job states from `scontrol` instead.
set -euo pipefail

HOME_DIR=${DARL_SLURM_HOME:-/tmp/darl-slurm}
NODES=${DARL_SLURM_NODES:-3}
CONF=$HOME_DIR/slurm.conf
PIDS=$HOME_DIR/pids
LOGS=$HOME_DIR/log
export SLURM_CONF=$CONF

alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop() {  # stop the daemon whose pid is in $1: SIGTERM, up to 10 s, then SIGKILL
  local pidfile=$1 i
  if alive "$pidfile"; then
    kill "$(cat "$pidfile")" 2>/dev/null || true
    for i in $(seq 50); do alive "$pidfile" || break; sleep 0.2; done
    if alive "$pidfile"; then kill -9 "$(cat "$pidfile")" 2>/dev/null || true; fi
  fi
  rm -f "$pidfile"
}

stop_slurm() {
  local f
  for f in "$PIDS"/slurmd.*.pid; do [[ -e $f ]] && stop "$f"; done
  stop "$PIDS/slurmctld.pid"
}

node_range() { if [[ $NODES == 1 ]]; then echo node1; else echo "node[1-$NODES]"; fi; }

write_conf() {  # declared sizes, not the machine's (config_overrides): see the header
  local cpus=128 mem=1024000 ports
  if [[ $NODES == 1 ]]; then ports=6818; else ports="[6818-$((6817 + NODES))]"; fi
  cat <<EOF
# written by scripts/local_slurm.sh: $NODES virtual nodes on 127.0.0.1
ClusterName=darl-local
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=6817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$HOME_DIR/state
SlurmdSpoolDir=$HOME_DIR/spool/%n
SlurmctldPidFile=$PIDS/slurmctld.pid
SlurmdPidFile=$PIDS/slurmd.%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
# backfill: the only scheduler that starts heterogeneous jobs; a short interval starts them at once
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_min_interval=100000
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=512
ReturnToService=2
SlurmdParameters=config_overrides
GresTypes=gpu
JobRequeue=1
# a cancelled or preempted job gets SIGTERM, then SIGKILL after KillWait: time to checkpoint and clean up
# (generous: CI machines are loaded)
KillWait=60
# finished jobs stay visible to scontrol this long (there is no accounting database)
MinJobAge=600
InactiveLimit=0
Waittime=0
NodeName=$(node_range) NodeHostname=localhost NodeAddr=127.0.0.1 Port=$ports CPUs=$cpus RealMemory=$mem Gres=gpu:8 State=UNKNOWN
PartitionName=debug Nodes=$(node_range) Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
  [[ -s /etc/munge/munge.key ]] || mungekey --create --keyfile=/etc/munge/munge.key
  chown munge:munge /etc/munge/munge.key
  chmod 400 /etc/munge/munge.key
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
  if ! alive "$PIDS/munged.pid"; then
    rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock /run/munge/munged.pid
    runuser -u munge -- /usr/sbin/munged --force  # --force: a stale socket from a killed munged is fine
    for _ in $(seq 50); do [[ -s /run/munge/munged.pid ]] && break; sleep 0.1; done
    cp /run/munge/munged.pid "$PIDS/munged.pid"
  fi
  munge -n | unmunge >/dev/null  # credentials round-trip, or fail here with munge's message
}

wait_idle() {  # every node up (idle or allocated) within 60 s
  local states
  for _ in $(seq 300); do
    states=$(sinfo -h -N -o %t 2>/dev/null | sort -u | tr '\n' ' ' || true)
    if [[ -n $states && ! $states =~ (unk|down|drain|fail|resp|inval|\*) ]]; then return 0; fi
    if [[ $states =~ (down|drain) ]]; then scontrol update NodeName="$(node_range)" State=RESUME 2>/dev/null || true; fi
    sleep 0.2
  done
  echo "local_slurm: nodes not ready: $states (logs in $LOGS)" >&2
  return 1
}

up() {
  local t0 i
  t0=$(date +%s)
  if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
     || ! command -v munged >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      slurmctld slurmd slurm-client munge >/dev/null
  fi
  mkdir -p "$PIDS" "$LOGS" "$HOME_DIR/state" "$HOME_DIR/spool"
  start_munge
  if ! write_conf | cmp -s - "$CONF"; then  # new topology: restart what runs with the old one
    stop_slurm
    write_conf > "$CONF"
  fi
  # stand-in device files: Slurm counts GPUs by their files; nothing ever opens them
  mkdir -p "$HOME_DIR/dev" && touch "$HOME_DIR"/dev/gpu{0..7}
  echo "NodeName=$(node_range) Name=gpu File=$HOME_DIR/dev/gpu[0-7]" > "$HOME_DIR/gres.conf"
  alive "$PIDS/slurmctld.pid" || /usr/sbin/slurmctld -f "$CONF" -i  # -i: ignore state of an earlier cluster
  for i in $(seq "$NODES"); do
    mkdir -p "$HOME_DIR/spool/node$i"
    alive "$PIDS/slurmd.node$i.pid" || /usr/sbin/slurmd -f "$CONF" -N "node$i"
  done
  wait_idle
  sinfo -N
  echo "local_slurm: up in $(( $(date +%s) - t0 )) s; use it with: eval \"\$($0 env)\""
}

down() {
  if [[ -f $CONF ]] && command -v scancel >/dev/null; then timeout 10 scancel --full --user=root 2>/dev/null || true; fi
  stop_slurm
  stop "$PIDS/munged.pid"
  rm -rf "$HOME_DIR/state" "$HOME_DIR/spool"
  echo "local_slurm: down"
}

case "${1:-up}" in
  up) up ;;
  down) down ;;
  status) sinfo -N; squeue ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 up|down|status|env" >&2; exit 2 ;;
esac
