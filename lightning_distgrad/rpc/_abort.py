"""Fail-stop: end the whole MPI job without losing the cause's output; SIGTERM does too."""

from __future__ import annotations

import fcntl
import os
import signal
import stat
import struct
import sys
import termios
import threading
import time

from mpi4py import MPI

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
    deadline = time.monotonic() + timeout
    for fd in fds:
        while _unread_pipe_bytes(fd) > 0 and time.monotonic() < deadline:
            time.sleep(0.005)


def _unread_pipe_bytes(fd: int) -> int:
    """Bytes written to pipe ``fd`` that its reader has not taken yet (0 if not a pipe)."""
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return 0
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return 0
