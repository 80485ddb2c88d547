"""Fail-stop: end the whole MPI job without losing the cause's output."""

from __future__ import annotations

import fcntl
import os
import stat
import struct
import sys
import termios
import time

from mpi4py import MPI

#: How long an abort waits for the process manager to read this rank's output.
DRAIN_TIMEOUT_S = 2.0


def abort_mpi_job(message: str) -> None:
    """Write ``message`` to stderr, then ``MPI_Abort`` the job; never returns."""
    sys.stderr.write(message)
    sys.stdout.flush()
    sys.stderr.flush()
    # MPI_Abort makes the process manager kill every rank at once; output it
    # has not read from this rank's pipes yet (the traceback) would be lost.
    _wait_until_read((1, 2), DRAIN_TIMEOUT_S)
    MPI.COMM_WORLD.Abort(1)
    # MPICH's MPI_Abort can return before the process manager kills this
    # rank; Python would then run the exit hooks, whose graceful shutdown
    # would let the other ranks finish as if nothing had failed.
    os._exit(1)


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
