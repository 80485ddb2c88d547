"""Doorbells: wake a napping poller on the same node when a frame comes.

An idle poller naps between polls so that it costs no CPU; MPI cannot wake it
(MPICH moves messages only inside MPI calls, and a blocking MPI wait spins a
core). Each agent therefore owns a Unix datagram socket and naps in ``select``
on it; a sender on the same node rings it (one byte, non-blocking) after
posting a frame. A ring is only a hint: a lost or refused one costs at most the
nap it would have cut short, and peers on other nodes are never rung.

Only a napping agent is rung. The agents of a node share a *nap board*, one
byte per agent in shared memory, set while that agent naps (:meth:`Doorbell.arm`);
a sender rings only if its peer's byte is set. The napper sets its byte, then
polls once more before it sleeps: a frame posted before the byte was visible is
found by that poll, one posted after it is rung. The node's first agent creates
the board and the others check its token; unless every agent of the node has
it, every frame rings.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import socket
import threading
from collections.abc import Callable

from mpi4py import MPI

from ..._backoff import Backoff

#: Where nap boards live (tmpfs: shared memory that no disk ever sees).
BOARD_DIR = "/dev/shm"
#: A board starts with the node's token (16 hex digits), then one byte per agent.
BOARD_HEADER = 16


class LocalBell:
    """The fallback without Unix sockets: only this process's threads can wake the nap.

    A held lock: ``wait`` waits to acquire it (C-level, GIL released),
    ``ring_self`` releases it; cheaper than ``threading.Event``.
    """

    #: Peers on this node that can ring it: none.
    node_peers = 0

    def __init__(self):
        self._lock = threading.Lock()
        self._lock.acquire()

    def ring(self, rank: int) -> None:
        """Peers cannot be rung: they notice the frame at their next poll."""

    def ring_self(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:  # already rung
            pass

    def wait(self, timeout: float) -> None:
        self._lock.acquire(timeout=timeout)  # True: rung; then held again

    def arm(self) -> None:
        """Peers may ring this agent from now on (it is about to nap)."""

    def disarm(self) -> None:
        """Undo one :meth:`arm`."""

    def has_board(self) -> bool:
        """Nobody can ring this agent: it needs no nap board."""
        return True

    def drop_board(self) -> None:
        """Ring napping or not (without a shared nap board)."""

    def forget_board(self) -> None:
        """Remove the nap board's name once every agent of the node has opened it."""

    def close(self) -> None:
        pass


class Doorbell:
    """This agent's bell (``wait``) and the bells of its peers on this node (``ring``)."""

    def __init__(self, token: str, rank: int, node_ranks: list[int]):
        addresses = {r: f"\0lightning_distgrad-{token}-{r}" for r in node_ranks}
        self._own = addresses.pop(rank)
        self._peers = addresses
        self.node_peers = len(addresses)  # peers that ring this agent
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self._own)
        self._sock.setblocking(False)
        # The nap board: byte BOARD_HEADER + i is set while node_ranks[i] naps (None:
        # ring always). The node's first agent creates it; the others open it after.
        self._slot = {r: BOARD_HEADER + i for i, r in enumerate(node_ranks)}
        self._own_slot = self._slot[rank]
        self._board_path = os.path.join(BOARD_DIR, f"lightning_distgrad-{token}")
        self._board = _open_board(
            self._board_path, token, len(node_ranks), create=rank == node_ranks[0]
        )
        self._armed = 0  # this agent's armed threads (see arm)
        self._armed_lock = threading.Lock()

    @classmethod
    def create(cls, token: str, rank: int, node_ranks: list[int]) -> Doorbell | LocalBell:
        """A doorbell, or a :class:`LocalBell` where abstract Unix sockets are missing."""
        try:
            return cls(token, rank, node_ranks)
        except (OSError, AttributeError):  # not Linux: plain naps, woken by own threads only
            return LocalBell()

    def ring(self, rank: int) -> None:
        """Wake ``rank``'s progress thread if it naps (peers on this node only)."""
        address = self._peers.get(rank)
        if address is not None and (self._board is None or self._board[self._slot[rank]]):
            self._ring(address)

    def ring_self(self) -> None:
        """Wake this agent's own napping progress thread (from another thread)."""
        self._ring(self._own)

    def _ring(self, address: str) -> None:
        try:
            self._sock.sendto(b"\1", address)
        except OSError:  # queue full (a ring is pending anyway) or peer gone
            pass

    def wait(self, timeout: float) -> None:
        """Nap until rung or ``timeout`` seconds pass; swallows pending rings."""
        readable, _, _ = select.select([self._sock], [], [], timeout)
        if readable:
            try:
                while True:
                    self._sock.recv(16)
            except OSError:  # drained
                pass

    def arm(self) -> None:
        """Peers ring this agent from now on (one of its threads is about to nap).

        Poll once after arming: a frame posted before peers could see it is not
        rung. Stay armed across the polls between naps (see :class:`ArmedBackoff`).
        """
        self._set_armed(+1)

    def disarm(self) -> None:
        """Undo one :meth:`arm` (peers stop ringing once no thread of ours is armed)."""
        self._set_armed(-1)

    def _set_armed(self, delta: int) -> None:
        with self._armed_lock:
            self._armed += delta
            if self._board is not None:
                self._board[self._own_slot] = 1 if self._armed else 0

    def has_board(self) -> bool:
        """Whether this agent mapped the node's nap board (see :func:`_open_board`)."""
        return self._board is not None

    def drop_board(self) -> None:
        """Ring every peer, napping or not: call on every agent of the node unless all
        have the board (a peer without it never sets its byte, so it was never rung)."""
        if self._board is not None:
            self._board.close()
            self._board = None

    def forget_board(self) -> None:
        """Remove the nap board's name once every agent of the node has opened it (the
        memory stays while mapped; nothing is left behind in ``BOARD_DIR``)."""
        with contextlib.suppress(OSError):
            os.unlink(self._board_path)

    def close(self) -> None:
        self._sock.close()
        self.forget_board()
        self.drop_board()


def _open_board(path: str, token: str, agents: int, create: bool) -> mmap.mmap | None:
    """Map a node's nap board: the token, then one byte per agent.

    The node's first agent creates it; the others open it once it exists and check the
    token, so agents that do not share ``BOARD_DIR`` (containers with a private
    ``/dev/shm``) get None instead of a board of their own that nobody else sees.
    """
    size = BOARD_HEADER + agents
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    except OSError:
        return None
    try:
        if create:
            os.ftruncate(fd, size)
        board = mmap.mmap(fd, size)
    except (OSError, ValueError):  # ValueError: the file is shorter than the board
        return None
    finally:
        os.close(fd)
    header = token.encode().ljust(BOARD_HEADER)[:BOARD_HEADER]
    if create:
        board[:BOARD_HEADER] = header
    elif board[:BOARD_HEADER] != header:
        board.close()
        return None
    return board


class ArmedBackoff:
    """The poller's naps: a :class:`~lightning_distgrad._backoff.Backoff` whose naps wait on
    this agent's bell, so that a ring cuts them short. The bell is armed from the first nap
    of a quiet spell until :meth:`reset` (traffic); naps double as every wait of the package
    does (see ``lightning_distgrad._backoff``), up to the ``cap`` of each :meth:`sleep`.

    Peers ring only an armed bell, so one poll right after arming finds a frame
    that was posted before peers could see the arming.
    """

    def __init__(self, bell: Doorbell | LocalBell, poll: Callable[[], bool]):
        self._bell = bell
        self._poll = poll
        # The bell's wait as it is at each nap (tests time it by replacing it).
        self._naps = Backoff(wait=lambda seconds: self._bell.wait(seconds))
        self._armed = False

    def reset(self) -> None:
        self._naps.reset()
        if self._armed:
            self._armed = False
            self._bell.disarm()

    def sleep(self, limit: float, cap: float) -> bool:
        """Nap at most ``limit`` s, the next nap at most ``cap`` s; True, without a nap, if
        the poll on arming found traffic."""
        if not self._armed:
            self._armed = True
            self._bell.arm()
            if self._poll():
                return True
        self._naps.nap(limit, cap)
        return False


def node_doorbell(comm: MPI.Comm, rank: int) -> tuple[Doorbell | LocalBell, bool]:
    """This rank's doorbell, and whether the node has more ranks than this rank has
    cores. A collective over ``comm``."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        oversubscribed = node.Get_size() > len(os.sched_getaffinity(0))
        token = node.bcast(os.urandom(8).hex() if node.Get_rank() == 0 else None)
        node_ranks = node.allgather(rank)
        first = node.Get_rank() == 0  # its bell creates the nap board, the others open it
        bell = Doorbell.create(token, rank, node_ranks) if first else None
        node.Barrier()
        if not first:
            bell = Doorbell.create(token, rank, node_ranks)
        # A peer that never napped on the board was never rung: ring all unless all have it.
        if not node.allreduce(bell.has_board(), op=MPI.LAND):
            bell.drop_board()
        bell.forget_board()  # every agent of the node has opened it
        return bell, oversubscribed
    finally:
        node.Free()
