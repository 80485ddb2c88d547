"""Fail-stop: a rank that fails, is signalled or is lost ends the whole MPI job.

:func:`abort_mpi_job` ends the job without losing the cause's output; SIGTERM does too
(:func:`end_job_on_sigterm`).

Lost ranks (:class:`PeerWatch`): a rank of this node whose process ends before it shut RPC
down ends the job.

The launcher usually does this itself (``mpiexec``; ``srun --kill-on-bad-exit=1``), but not
always: under ``srun`` without that flag, or after a rank left with exit status 0 without
shutting down, the other ranks would wait for it until their calls time out (``rpc_timeout``)
and then abort. Each agent watches the processes of the other ranks on its node instead: a
pidfd becomes readable once its process has ended (zombie or reaped), and a thread that
sleeps in ``poll`` on them reports the rank within milliseconds. Ranks on other nodes are not
watched; their loss ends calls to them at the RPC timeout.

Only processes that are the peer itself are watched: each rank's pid comes with its start
time, and a pid that this process sees with another start time (another pid namespace) is
skipped.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import stat
import struct
import sys
import termios
import threading
from collections.abc import Callable

from mpi4py import MPI

from ..._backoff import Backoff, nap_until

#: How long an abort waits for the process manager to read this rank's output.
DRAIN_TIMEOUT_S = 2.0


def abort_mpi_job(message: str, code: int = 1) -> None:
    """Write ``message`` to stderr, then ``MPI_Abort`` the job with ``code``; never returns."""
    sys.stderr.write(message)
    sys.stdout.flush()
    sys.stderr.flush()
    # MPI_Abort makes the process manager kill every rank at once; output it
    # has not read from this rank's pipes yet (the traceback) would be lost.
    _wait_until_read((1, 2), DRAIN_TIMEOUT_S)
    MPI.COMM_WORLD.Abort(code)
    # MPICH's MPI_Abort can return before the process manager kills this
    # rank; Python would then run the exit hooks, whose graceful shutdown
    # would let the other ranks finish as if nothing had failed.
    os._exit(code)


def end_job_on_sigterm() -> bool:
    """From now on SIGTERM (``scancel``, a time limit, a launcher stopping the job) on
    this rank ends the whole job at once, with exit code 143, instead of running a
    graceful shutdown that would wait for ranks that may never come. A program's own
    SIGTERM handler, set before, is left alone. True if the handler was installed.

    Example::

        >>> end_job_on_sigterm()  # doctest: +SKIP
        True
    """
    if threading.current_thread() is not threading.main_thread():
        return False  # only the main thread may set signal handlers
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    signal.signal(signal.SIGTERM, _on_sigterm)
    return True


def _on_sigterm(signum: int, frame: object) -> None:
    rank = MPI.COMM_WORLD.Get_rank()
    abort_mpi_job(
        f"lightning_distgrad: rank {rank} received SIGTERM; aborting the MPI job "
        "(without a graceful RPC shutdown, which would wait for the other ranks).\n",
        128 + signum,
    )


def _wait_until_read(fds: tuple[int, ...], timeout: float) -> None:
    nap_until(lambda: all(_unread_pipe_bytes(fd) == 0 for fd in fds), timeout, Backoff(0.005))


def _unread_pipe_bytes(fd: int) -> int:
    """Bytes written to pipe ``fd`` that its reader has not taken yet (0 if not a pipe)."""
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return 0
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return 0


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot; /proc), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count after its end.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[19])  # field 22, starttime


def node_peers(comm: MPI.Comm) -> dict[int, int]:
    """The other ranks of ``comm`` on this node as ``{rank: pid}``, for those whose process
    this one sees (same pid namespace). A collective over ``comm``.

    Example::

        >>> node_peers(MPI.COMM_WORLD)  # doctest: +SKIP
        {1: 41235}
    """
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        me = os.getpid()
        entries = node.allgather((comm.Get_rank(), me, _start_time(me)))
    finally:
        node.Free()
    return {
        rank: pid
        for rank, pid, started in entries
        if rank != comm.Get_rank() and started is not None and _start_time(pid) == started
    }


class PeerWatch:
    """Calls ``on_lost(rank)`` once, on its own thread, for each watched process that ends.

    Watches nothing where pidfds are missing (Linux before 5.3, another OS).
    """

    def __init__(self, peers: dict[int, int], on_lost: Callable[[int], None]):
        self._on_lost = on_lost
        self._ranks: dict[int, int] = {}  # pidfd -> rank
        if hasattr(os, "pidfd_open"):
            for rank, pid in peers.items():
                # A peer gone already (between the gather and here) is not watched: its
                # calls end at the RPC timeout.
                with contextlib.suppress(OSError):
                    self._ranks[os.pidfd_open(pid)] = rank
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="distgrad-peers")

    def start(self) -> None:
        if self._ranks:
            self._thread.start()

    def close(self) -> None:
        """Stop watching (before this rank's peers may end normally)."""
        os.write(self._wake_w, b"x")
        if self._thread.is_alive():
            self._thread.join()
        for fd in (*self._ranks, self._wake_r, self._wake_w):
            os.close(fd)
        self._ranks = {}

    def _watch(self) -> None:
        poller = select.poll()
        for fd in self._ranks:
            poller.register(fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            for fd, _ in poller.poll():
                if fd == self._wake_r:
                    return
                poller.unregister(fd)
                self._on_lost(self._ranks[fd])
