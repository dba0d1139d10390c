#!/usr/bin/env bash
# Start a single-node SLURM (Debian's packages) on this machine, for the cluster tests.
# Needs root. Prints the daemons' process ids to $SLURM_STATE/pids; slurm-down.sh stops them.
set -euo pipefail
SLURM_STATE="${SLURM_STATE:-/tmp/harness-slurm}"
mkdir -p "$SLURM_STATE"/{spool,state,log}
if ! command -v slurmctld >/dev/null || ! command -v sbatch >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
fi
if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge && chown -R munge:munge /run/munge /var/log/munge /var/lib/munge
pgrep -x munged >/dev/null || su -s /bin/sh munge -c "munged"
HOST="$(hostname -s)"
CPUS="$(nproc)"
MEM="$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))"
mkdir -p /etc/slurm
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=harness
SlurmctldHost=$HOST
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmUser=root
SlurmdUser=root
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmctldPidFile=$SLURM_STATE/slurmctld.pid
SlurmdPidFile=$SLURM_STATE/slurmd.pid
SlurmdSpoolDir=$SLURM_STATE/spool
StateSaveLocation=$SLURM_STATE/state
SlurmctldLogFile=$SLURM_STATE/log/slurmctld.log
SlurmdLogFile=$SLURM_STATE/log/slurmd.log
MpiDefault=none
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd
for _ in $(seq 1 60); do
    if sinfo -h -o "%T" 2>/dev/null | grep -qE "^idle"; then
        echo "slurm up on $HOST ($CPUS CPUs, ${MEM} MB)"
        exit 0
    fi
    sleep 1
done
echo "slurm did not come up; see $SLURM_STATE/log" >&2
exit 1
