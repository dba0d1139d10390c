#!/usr/bin/env bash
# Stop the daemons slurm-up.sh started (by their pid files).
SLURM_STATE="${SLURM_STATE:-/tmp/harness-slurm}"
for f in "$SLURM_STATE/slurmd.pid" "$SLURM_STATE/slurmctld.pid"; do
    [ -s "$f" ] && kill "$(cat "$f")" 2>/dev/null || true
done
