#!/usr/bin/env bash
# A stand-in for ssh that hydra's ssh launcher runs to start a proxy "on" a host:
#
#   fake_node_ssh.sh [ssh options...] HOST COMMAND...
#
# The command runs on this machine in its own UTS, IPC and mount namespaces, with
# the hostname of HOST and a private tmpfs on /dev/shm, so MPI sees one node per
# HOST (no shared memory between them) and node-local files never cross nodes.
# HOST may be a loopback address: FAKE_NODE_NAMES ("127.0.1.1=nodeA 127.0.1.2=nodeB")
# maps it to the hostname the namespace gets; unmapped hosts keep their own name.
# Needs root (unshare, mount).
set -euo pipefail
while [[ $# -gt 0 && $1 == -* ]]; do
    case $1 in
        -[bcDeFIiJLlmOoRSWw]) shift 2 ;;  # ssh options that take a value
        *) shift ;;
    esac
done
host=$1
shift
name=$host
for pair in ${FAKE_NODE_NAMES:-}; do
    if [[ ${pair%%=*} == "$host" ]]; then
        name=${pair#*=}
    fi
done
# FAKE_NODE_CPUS ("127.0.1.1=0 127.0.1.2=1"): the CPUs (a taskset list) the node runs on,
# so that nodes do not share cores, as real ones do not.
cpus=
for pair in ${FAKE_NODE_CPUS:-}; do
    if [[ ${pair%%=*} == "$host" ]]; then
        cpus=${pair#*=}
    fi
done
pin=()
if [[ -n $cpus ]]; then
    pin=(taskset -c "$cpus")
fi
# Like ssh, the command's words are joined and run by a shell on the "remote" side.
# Every node starts with an empty /dev/shm of its own: nothing node-local is shared.
exec "${pin[@]}" unshare --uts --ipc --mount --propagation private \
    bash -c 'hostname "$0" && mount -t tmpfs tmpfs /dev/shm && eval "exec $1"' "$name" "$*"
