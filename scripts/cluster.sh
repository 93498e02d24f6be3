#!/usr/bin/env bash
# A real single-node SLURM cluster (and Open MPI) on this machine, for tests/test_cluster.py and CI.
#
#   bash scripts/cluster.sh install   # Debian's slurm-wlm, munge and openmpi-bin, if missing (root, apt)
#   bash scripts/cluster.sh start     # install, then munged + slurmctld + slurmd: one node, this machine's CPUs
#   bash scripts/cluster.sh stop      # stops the daemons this script started, by their pid files
#
# Exit status 0 when ready; otherwise 1 with the reason on the last line of stderr. A cluster that is
# already up (sinfo answers) is used as it is, and its configuration is never touched.
set -euo pipefail

need_root() {
  if [ "$(id -u)" != 0 ]; then
    echo "cluster.sh: needs root (apt-get, and daemons that run jobs as any user)" >&2
    exit 1
  fi
}

install() {
  if command -v slurmctld >/dev/null && command -v munged >/dev/null && command -v mpirun >/dev/null; then
    return 0
  fi
  need_root
  command -v apt-get >/dev/null || { echo "cluster.sh: no apt-get: install SLURM, munge and Open MPI by hand" >&2; exit 1; }
  # Waits for a package lock that another apt holds (a test installing Chromium, another job).
  apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq slurm-wlm munge openmpi-bin >/dev/null
}

alive() {  # alive PIDFILE: whether the process in it runs
  [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

start() {
  if timeout 5 sinfo >/dev/null 2>&1; then
    return 0
  fi
  install
  need_root
  local host
  host=$(hostname)
  mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
  if [ ! -f /etc/slurm/slurm.conf ] || grep -q "^# written by shardmem scripts/cluster.sh" /etc/slurm/slurm.conf; then
    cat >/etc/slurm/slurm.conf <<CONF
# written by shardmem scripts/cluster.sh: one node, this machine
ClusterName=local
SlurmctldHost=$host
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmdSpoolDir=/var/spool/slurmd
StateSaveLocation=/var/spool/slurmctld
SlurmUser=root
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
JobAcctGatherType=jobacct_gather/none
# Quick turnaround for tests: time limits checked often, a requeued job may start again at once.
MinJobAge=30
KillWait=20
NodeName=$host CPUs=$(nproc) RealMemory=$(($(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo) * 8 / 10)) State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
  fi
  if ! alive /run/munge/munged.pid; then
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge && chown munge:munge /run/munge
    su -s /bin/sh munge -c /usr/sbin/munged
  fi
  alive /run/slurmctld.pid || slurmctld
  alive /run/slurmd.pid || slurmd
  for _ in $(seq 50); do
    if sinfo -h -o %T 2>/dev/null | grep -qE "idle|mix|alloc"; then
      return 0
    fi
    sleep 0.2
  done
  echo "cluster.sh: the daemons started but the node is not idle: $(sinfo -h 2>&1 | head -1)" >&2
  exit 1
}

stop() {
  for pidfile in /run/slurmd.pid /run/slurmctld.pid; do
    if alive "$pidfile"; then kill "$(cat "$pidfile")"; fi
  done
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  *) echo "usage: bash scripts/cluster.sh install|start|stop" >&2; exit 2 ;;
esac
