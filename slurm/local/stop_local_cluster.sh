#!/usr/bin/env bash
# Stop the single-node Slurm cluster started by start_local_cluster.sh
# (slurmd, slurmctld, munged). Idempotent; run as root.
#
# Environment:
#     SLURM_LOCAL_STATE  state/log dir (default /var/lib/slurm-local)
#     SLURM_LOCAL_KEEP_MUNGE=1  leave munged running
set -uo pipefail

STATE_DIR=${SLURM_LOCAL_STATE:-/var/lib/slurm-local}

[ "$(id -u)" = 0 ] || { echo "stop_local_cluster: must run as root" >&2; exit 1; }

# Stop one daemon by its pid file: TERM, wait up to 10 s, then KILL.
stop_pid() {
    local name=$1 pidfile=$2 pid
    [ -s "$pidfile" ] || { echo "$name: not running (no pid file)"; return 0; }
    pid=$(cat "$pidfile")
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "$name: not running (stale pid $pid)"; rm -f "$pidfile"; return 0
    fi
    kill -TERM "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid"; fi
    rm -f "$pidfile"
    echo "$name: stopped (pid $pid)"
}

# Cancel leftover jobs first so no job steps outlive the daemons.
if command -v scancel >/dev/null && [ -s "$STATE_DIR/slurmctld.pid" ]; then
    squeue -h -o %i 2>/dev/null | xargs -r scancel 2>/dev/null || true
fi

stop_pid slurmd "$STATE_DIR/slurmd.pid"
stop_pid slurmctld "$STATE_DIR/slurmctld.pid"
if [ "${SLURM_LOCAL_KEEP_MUNGE:-0}" != 1 ]; then
    stop_pid munged /run/munge/munged.pid
fi
