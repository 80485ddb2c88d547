"""Two emulated nodes on one machine, for jobs whose ranks must span nodes.

MPICH's hydra starts one proxy per host through its ssh launcher; ``fake_node_ssh.sh``
stands in for ssh and runs each proxy here, in its own UTS, IPC and mount namespaces
with the node's hostname and a private ``/dev/shm``. MPI then sees one node per host
(no shared memory across them) and node-local files never cross nodes.

Hosts are given to hydra as loopback addresses (``127.0.1.1``, ``127.0.1.2``), which
need no name resolution; the stand-in gives each namespace the matching name in
:data:`NODE_NAMES` through ``FAKE_NODE_NAMES``. Nothing in ``/etc/hosts`` is needed
or changed. :func:`skip_reason` says why the emulation cannot run on this machine.
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
import sys

from _job_runner import LAUNCHER, TESTS, clean_env
from _timing import scaled

#: Loopback addresses that hydra treats as two hosts (Linux routes all of 127/8 to lo).
NODE_ADDRESSES = ("127.0.1.1", "127.0.1.2")
#: The hostname each emulated node gets, in the order of NODE_ADDRESSES.
NODE_NAMES = ("node-a", "node-b")
#: The ssh stand-in that hydra's launcher runs.
STAND_IN = TESTS / "fake_node_ssh.sh"
#: Bound for the probes of :func:`skip_reason`.
PROBE_TIMEOUT_S = scaled(20)


def node_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A clean job environment plus what hydra and the stand-in need."""
    names = " ".join(f"{a}={n}" for a, n in zip(NODE_ADDRESSES, NODE_NAMES, strict=True))
    # AUTOFORK=0: hydra would otherwise fork proxies for local-looking hosts itself.
    env = {
        "HYDRA_LAUNCHER_AUTOFORK": "0",
        "I_MPI_HYDRA_BOOTSTRAP_AUTOFORK": "0",  # the same for Intel MPI's hydra
        "FAKE_NODE_NAMES": names,
        "FAKE_NODE_CPUS": node_cpus(),
    }
    return clean_env({**env, **(extra or {})})


def node_cpus() -> str:
    """Each node's CPUs for ``FAKE_NODE_CPUS``: this process's CPUs dealt out among the nodes,
    so that no two nodes share a core (as real ones do not: a rank then sees the cores of its
    own node only, and naps instead of spinning when its node has fewer cores than ranks).
    Empty, all nodes sharing every core, with fewer CPUs than nodes or without ``taskset``."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < len(NODE_ADDRESSES) or shutil.which("taskset") is None:
        return ""
    shares = [cpus[k :: len(NODE_ADDRESSES)] for k in range(len(NODE_ADDRESSES))]
    return " ".join(
        f"{a}={','.join(map(str, share))}" for a, share in zip(NODE_ADDRESSES, shares, strict=True)
    )


def mpiexec_two_nodes(
    ranks_per_node: int, *command: str, output_pattern: str | None = None
) -> list[str]:
    """``mpiexec`` that starts ``ranks_per_node`` ranks of ``command`` on each node.

    Ranks are placed in blocks: node ``k`` runs ranks ``k * ranks_per_node`` and up.
    ``output_pattern`` (with ``%r`` for the rank) sends each rank's stdout and stderr
    to a file of its own.
    """
    hosts = ",".join(f"{a}:{ranks_per_node}" for a in NODE_ADDRESSES)
    argv = [
        LAUNCHER.program,
        "-hosts",
        hosts,
        "-launcher",
        "ssh",
        "-launcher-exec",
        str(STAND_IN),
        "-n",
        str(ranks_per_node * len(NODE_ADDRESSES)),
    ]
    if output_pattern is not None:
        argv += ["-outfile-pattern", output_pattern, "-errfile-pattern", output_pattern]
    return [*argv, *command]


@functools.cache
def skip_reason() -> str | None:
    """Why two nodes cannot be emulated here, or None when they can."""
    if not sys.platform.startswith("linux"):
        return "emulated nodes need Linux namespaces"
    if os.geteuid() != 0:
        return "emulated nodes need root (unshare of UTS/IPC/mount namespaces, a tmpfs mount)"
    if shutil.which("unshare") is None:
        return "emulated nodes need `unshare` (util-linux)"
    if LAUNCHER is None or LAUNCHER.kind != "hydra":
        return (
            "emulated nodes need MPICH's hydra mpiexec; this interpreter's MPI is "
            f"{LAUNCHER.describe() if LAUNCHER else 'missing'}"
        )
    for address in NODE_ADDRESSES:
        with socket.socket() as s:
            try:
                s.bind((address, 0))
            except OSError as e:
                return f"loopback address {address} is not usable here: {e}"
    return _probe_stand_in()


def _probe_stand_in() -> str | None:
    """Run a command "on" the first node; None if it saw that node's name and a private
    ``/dev/shm``."""
    marker = f"/dev/shm/emulated-node-probe-{os.getpid()}"
    try:
        open(marker, "w").close()
    except OSError as e:
        return f"emulated nodes need a writable /dev/shm: {e}"
    try:
        proc = subprocess.run(
            [str(STAND_IN), NODE_ADDRESSES[0], f"hostname && test ! -e {marker}"],
            env=node_env(),
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the ssh stand-in {STAND_IN.name} did not run: {e}"
    finally:
        os.unlink(marker)
    if proc.returncode != 0 or proc.stdout.strip() != NODE_NAMES[0]:
        return (
            f"namespaces are not allowed here ({STAND_IN.name} exited with"
            f" {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()})"
        )
    return None
