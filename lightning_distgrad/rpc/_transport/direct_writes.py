"""Pushed tensors: the sender writes big tensor bytes straight into the receiver's buffer.

MPICH moves a big message between ranks of one node with one copy made by the
*receiver* (CMA: ``process_vm_readv`` from the sender's memory). The kernel then
walks the sender's pages one by one; torch's tensors sit on 4 KiB pages, and
that copy runs at half the speed it reaches from huge pages. Receive buffers of
this transport are huge-page backed (see ``receive_buffers``), so the sender writes
into them (``process_vm_writev``) and the kernel walks a few huge pages
instead. Tensors from :data:`PUSH_MIN_BYTES` on travel like this, except those
already on huge pages, which the receiver pulls fastest (:func:`should_push`),
between ranks of one node that passed a write probe when the transport started
(:func:`writable_peers`):

1. its frame marks it :data:`~._wire.PUSHED` (no bytes follow on ``data``);
2. the receiver allocates the buffers and answers with a clear-to-send holding
   their addresses (:class:`PushReceive`), or a refusal;
3. the sender writes the bytes, outside the transport's lock, and sends DONE
   with the outcome (:class:`PushSend`);
4. the receiver hands the frame over once DONE says the bytes were written.

Every clear-to-send is answered by exactly one DONE (written, failed, or given
up at the sender's deadline), and no write follows a DONE. The receiver keeps
the buffers until DONE arrives, even after it abandoned the transfer, so a late
write never lands in freed memory.

Both control messages travel on the transport's ``push`` communicator, matched
by (peer, tag): the clear-to-send of the frame with tag ``t`` has tag ``2t``,
its DONE ``2t + 1`` (modulo the tag bound).
"""

from __future__ import annotations

import ctypes
import errno
import os

import numpy as np
from mpi4py import MPI

#: Tensors at least this big are pushed (smaller receive buffers are neither pooled nor
#: huge-page backed: the two control messages would cost more than the copy saves).
PUSH_MIN_BYTES = 1 << 20
#: Tensors on huge pages at least this big are pulled (MPI) instead: beyond the cache,
#: the receiver's copy out of huge pages beats a write into them (22 vs 14 GB/s at
#: 64 MiB); below it the write wins.
PULL_MIN_BYTES = 16 << 20
#: Whether torch puts big CPU tensors on huge pages (its variable, read as torch does).
_TORCH_TRUE = ("1", "on", "yes", "true", "y")
TORCH_HUGE_PAGES = os.environ.get("THP_MEM_ALLOC_ENABLE", "").lower() in _TORCH_TRUE
#: Set to "0" to move every tensor with MPI (the receiver's pull).
PUSH_ENV = "LIGHTNING_DISTGRAD_PUSH"

#: First word of a clear-to-send.
CLEAR, REFUSED = 0, 1
#: DONE's word: 0 written, a positive errno, or GAVE_UP (no clear-to-send came in time).
WRITTEN, GAVE_UP = 0, -1
#: Linux moves at most this many bytes per ``process_vm_writev`` call (MAX_RW_COUNT).
_MAX_WRITE = 0x7FFFF000


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load_writev():
    try:
        fn = ctypes.CDLL(None, use_errno=True).process_vm_writev
    except (AttributeError, OSError):  # not Linux
        return None
    iov = ctypes.POINTER(_IoVec)
    fn.argtypes = [ctypes.c_int, iov, ctypes.c_ulong, iov, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return fn


_writev = _load_writev()


def write_remote(pid: int, src: np.ndarray, address: int) -> int:
    """Copy the bytes of ``src`` (a contiguous uint8 array) to ``address`` in process
    ``pid``; 0 once all are written, else the errno. The GIL is released meanwhile."""
    if _writev is None:
        return errno.ENOSYS
    done, total, base = 0, src.nbytes, src.ctypes.data
    while done < total:
        n = min(total - done, _MAX_WRITE)
        local, remote = _IoVec(base + done, n), _IoVec(address + done, n)
        got = _writev(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            return ctypes.get_errno() or errno.EIO
        done += got
    return 0


def writable_peers(comm: MPI.Comm) -> dict[int, int]:
    """The ranks of ``comm`` whose memory this process can write: ``{rank: pid}``.

    Those on this node where the kernel allows it (Linux, ptrace permission), each
    probed with a one-byte write; none if ``LIGHTNING_DISTGRAD_PUSH=0``. A collective
    over ``comm``.
    """
    enabled = os.environ.get(PUSH_ENV, "1") != "0" and _writev is not None
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        probe = np.zeros(node.Get_size(), dtype=np.uint8)  # byte i: written by node rank i
        entries = node.allgather((comm.Get_rank(), os.getpid(), probe.ctypes.data, enabled))
        me = node.Get_rank()
        one = np.ones(1, dtype=np.uint8)
        peers = {}
        for rank, pid, address, their_enabled in entries:
            if rank != comm.Get_rank() and enabled and their_enabled:
                if write_remote(pid, one, address + me) == 0:
                    peers[rank] = pid
        node.Barrier()  # every probe buffer lives until all have written
        return peers
    finally:
        node.Free()


def should_push(nbytes: int, receive_buffer: bool) -> bool:
    """Whether a tensor of ``nbytes`` to a writable peer is pushed rather than pulled.

    A receive buffer is pulled: it sits on huge pages, and its sender (a request's
    handler) has no thread polling for the clear-to-send at once. So are torch's own
    tensors from :data:`PULL_MIN_BYTES` on when torch puts them on huge pages.
    """
    if nbytes < PUSH_MIN_BYTES or receive_buffer:
        return False
    return not (TORCH_HUGE_PAGES and nbytes >= PULL_MIN_BYTES)


def push_tags(tag: int, tag_mod: int) -> tuple[int, int]:
    """(clear-to-send tag, DONE tag) of the frame with tag ``tag``."""
    return (2 * tag) % tag_mod, (2 * tag + 1) % tag_mod


class PushSend:
    """The sender's side of one frame's pushed tensors; used under the transport's lock
    except :meth:`write`."""

    WAITING, WRITING, FINISHING = "waiting", "writing", "finishing"

    __slots__ = (
        "comm",
        "dst",
        "pid",
        "sources",
        "done_tag",
        "deadline",
        "header",
        "request",
        "state",
    )

    def __init__(
        self,
        comm: MPI.Comm,
        dst: int,
        pid: int,
        sources: list[np.ndarray],
        tags: tuple[int, int],
        deadline: float,
    ):
        self.comm, self.dst, self.pid, self.sources = comm, dst, pid, sources
        self.done_tag = tags[1]
        self.deadline = deadline
        self.header = np.zeros(1 + len(sources), dtype=np.uint64)
        self.request = comm.Irecv([self.header, MPI.BYTE], dst, tags[0])
        self.state = self.WAITING

    def step(self, now: float) -> str:
        """ "write" once the receiver cleared the write (then call :meth:`write` and
        :meth:`finish`), "over" when nothing is left to do, else "wait"."""
        if self.state is self.WRITING:
            return "wait"
        if self.state is self.FINISHING:
            return "over" if self.request.Test() else "wait"
        if not self.request.Test():
            if now < self.deadline:
                return "wait"
            self.request.Cancel()  # the clear-to-send may still win the race
            status = MPI.Status()
            self.request.Wait(status)
            if status.Is_cancelled():
                self.finish(GAVE_UP)
                return "wait"
        if self.header[0] != CLEAR:
            return "over"  # refused: nothing was written, no DONE is awaited
        self.state = self.WRITING
        return "write"

    def write(self) -> int:
        """Write every source into its buffer (outside the lock); the DONE word."""
        for src, address in zip(self.sources, self.header[1:].tolist(), strict=True):
            problem = write_remote(self.pid, src, address)
            if problem:
                return problem
        return WRITTEN

    def finish(self, outcome: int) -> None:
        """Send DONE with ``outcome``; the sources are not touched again."""
        self.sources = []
        self.state = self.FINISHING
        done = np.array([outcome], dtype=np.int64)
        self.request = self.comm.Isend([done, MPI.BYTE], self.dst, self.done_tag)


class PushReceive:
    """The receiver's side of one frame's pushed tensors: the clear-to-send (or refusal)
    and, unless refused, the DONE to wait for."""

    __slots__ = ("header", "done", "requests")

    def __init__(
        self, comm: MPI.Comm, source: int, tags: tuple[int, int], buffers: list[np.ndarray] | None
    ):
        if buffers is None:
            self.header = np.array([REFUSED], dtype=np.uint64)
            self.done = None
            self.requests = [comm.Isend([self.header, MPI.BYTE], source, tags[0])]
            return
        self.header = np.array([CLEAR] + [b.ctypes.data for b in buffers], dtype=np.uint64)
        self.done = np.full(1, GAVE_UP, dtype=np.int64)
        self.requests = [
            comm.Irecv([self.done, MPI.BYTE], source, tags[1]),
            comm.Isend([self.header, MPI.BYTE], source, tags[0]),
        ]

    def problem(self) -> str | None:
        """Once its requests completed: None if the bytes were written, else why not."""
        outcome = int(self.done[0])
        if outcome == WRITTEN:
            return None
        if outcome == GAVE_UP:
            return "its sender gave up writing its tensor bytes (no clear-to-send in time)"
        return f"its sender could not write its tensor bytes ({os.strerror(outcome)})"
