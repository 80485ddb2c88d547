"""Doorbells: wake a napping progress thread on the same node when a frame comes.

An idle progress thread naps between polls, so that it costs no CPU, and MPI
cannot wake it (MPICH only moves messages inside MPI calls, and a blocking
MPI wait spins a core). A frame that arrived during a nap used to wait for the
nap's end: up to 1-4 ms per hop after a quiet spell. Each agent therefore owns
a Unix datagram socket; it naps in ``select`` on it, and a sender on the same
node rings it (one byte, non-blocking) after posting a frame. The bell is only
a hint: a lost or refused ring (a full queue, a peer gone) costs at most the
nap it would have cut short, and peers on other nodes are never rung.
"""

from __future__ import annotations

import select
import socket
import threading


class LocalBell:
    """The fallback without Unix sockets: only this process's threads can wake the nap.

    A held lock: ``wait`` waits to acquire it (C-level, GIL released),
    ``ring_self`` releases it; cheaper than ``threading.Event``.
    """

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

    def close(self) -> None:
        pass


class Doorbell:
    """This agent's bell (``wait``) and the bells of its peers on this node (``ring``)."""

    def __init__(self, token: str, rank: int, node_ranks: list[int]):
        addresses = {r: f"\0lightning_distgrad-{token}-{r}" for r in node_ranks}
        self._own = addresses.pop(rank)
        self._peers = addresses
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self._own)
        self._sock.setblocking(False)

    @classmethod
    def create(cls, token: str, rank: int, node_ranks: list[int]) -> Doorbell | LocalBell:
        """A doorbell, or a :class:`LocalBell` where abstract Unix sockets are missing."""
        try:
            return cls(token, rank, node_ranks)
        except (OSError, AttributeError):  # not Linux: plain naps, as before
            return LocalBell()

    def ring(self, rank: int) -> None:
        """Wake ``rank``'s progress thread if it naps (peers on this node only)."""
        address = self._peers.get(rank)
        if address is not None:
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

    def close(self) -> None:
        self._sock.close()
