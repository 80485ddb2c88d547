"""What a graceful shutdown knows of one agent: frames handled, JOINs and FLUSH rounds heard.

A graceful shutdown (``rpc._lifecycle``) ends once every worker joined and then a round of
FLUSH markers found no activity anywhere. An agent counts, for that, every frame handed to it
and every frame whose handling ended, the FLUSH frames it sent (which are not activity), the
JOINs and the FLUSH rounds it heard from each rank. It also decides what the end of a peer
process of this node means (:meth:`Termination.on_peer_lost`): the job is lost, unless the
peer may have finished shutting down.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from .._transport import Frame, Kind, MalformedFrame, Transport, abort_mpi_job
from .worker_info import WorkerInfo


class Termination:
    """Termination detection for one agent; ``pending`` is the agent's table of calls
    waiting for responses (read, never changed here)."""

    def __init__(self, infos: list[WorkerInfo], me: int, transport: Transport, pending: dict):
        self._infos = infos
        self._me = me
        self._transport = transport
        self._pending = pending
        self._lock = threading.Lock()
        # Frames handed to the agent, frames whose handling ended, FLUSH frames sent.
        self._arrived = 0
        self._processed = 0
        self._flushes_sent = 0
        # Per rank, the last FLUSH round heard from it; the ranks that joined.
        self._flushed = [0] * len(infos)
        self._flushed_changed = threading.Condition()
        self._joined: set[int] = set()
        self._joined_changed = threading.Condition()
        # Peers of this node that ended while they may have finished shutting down.
        self._peers_may_end = False
        self._ended: list[int] = []

    # -- counting -------------------------------------------------------------------

    def arrived(self) -> None:
        """A frame (other than FLUSH) was handed to the agent."""
        with self._lock:
            self._arrived += 1

    def processed(self) -> None:
        """The handling of a frame ended (a request's once its response was sent)."""
        with self._lock:
            self._processed += 1

    def activity(self) -> int:
        """Frames sent (FLUSH markers aside) plus frames whose handling ended: unchanged
        over a shutdown round only if this worker did nothing in it."""
        sent = self._transport.frames_sent()
        with self._lock:
            return sent - self._flushes_sent + self._processed

    def idle(self) -> bool:
        """No call of this worker waits for its response and every frame handed to it,
        even a malformed one, has been handled (a handler ends after what it sent)."""
        with self._lock:
            handling = self._arrived != self._processed
        return not (handling or self._pending or self._transport.has_queued())

    # -- JOIN and FLUSH ---------------------------------------------------------------

    def join(self) -> None:
        """Tell every other worker that this one called graceful shutdown."""
        for info in self._infos:
            if info.id != self._me:
                self._transport.send(info.id, Frame(Kind.JOIN, -1, None), [])

    def on_join(self, source: int) -> None:
        with self._joined_changed:
            self._joined.add(source)
            self._joined_changed.notify_all()

    def not_joined(self, wait: float = 0.0) -> list[int]:
        """The other ranks that have not joined yet, after waiting up to ``wait`` s for
        that list to change."""
        others = [i.id for i in self._infos if i.id != self._me]
        return _still_missing(self._joined_changed, others, lambda r: r not in self._joined, wait)

    def flush(self, round_: int) -> None:
        """Send FLUSH(``round_``) to every worker, this one included, after everything
        this worker sent them before."""
        with self._lock:
            self._flushes_sent += len(self._infos)
        for info in self._infos:
            self._transport.send(info.id, Frame(Kind.FLUSH, -1, None, (), (round_,)), [])

    def on_flush(self, source: int, frame: Frame, tensors: list) -> MalformedFrame | None:
        """Each worker's FLUSH rounds arrive in order, one after the other; any other FLUSH
        frame was not sent by an agent: returned as malformed, to be handled as such."""
        expected = self._flushed[source] + 1
        body = frame.body
        is_next = type(body) is tuple and len(body) == 1 and type(body[0]) is int
        if not is_next or body[0] != expected or tensors or frame.forks or frame.payload:
            error = MalformedFrame(f"a FLUSH frame other than round {expected}", frame)
            error.source = source
            return error
        with self._flushed_changed:
            self._flushed[source] = expected
            self._flushed_changed.notify_all()
        return None

    def not_flushed(self, round_: int, wait: float = 0.0) -> list[int]:
        """The ranks whose FLUSH(``round_``) has not arrived yet, after waiting up to
        ``wait`` s for that list to change."""
        ranks = range(len(self._infos))
        return _still_missing(
            self._flushed_changed, ranks, lambda r: self._flushed[r] < round_, wait
        )

    # -- peers that end ---------------------------------------------------------------

    def on_peer_lost(self, rank: int) -> None:
        """A rank of this node ended: the job cannot go on without it. While a graceful
        shutdown's round that may be its last runs, the rank may have finished it: that
        round's outcome decides (see :meth:`peers_may_end`)."""
        with self._lock:
            if self._peers_may_end:
                self._ended.append(rank)
                return
        self._abort_lost(rank)

    def peers_may_end(self, may: bool) -> None:
        """True: peers that end from now on may have finished shutting down (this worker
        is in a drain round that may be the last). False: the round was not the last, so
        none may have; one that ended meanwhile aborts the job now."""
        with self._lock:
            self._peers_may_end = may
            ended, self._ended = self._ended, []
        if ended and not may:
            self._abort_lost(ended[0])

    def _abort_lost(self, rank: int) -> None:
        abort_mpi_job(
            f"lightning_distgrad: {self._infos[rank].name} (rank {rank}) ended without "
            f"shutting down RPC (killed, crashed or exited); {self._infos[self._me].name} "
            "aborts the MPI job so that no rank waits for it.\n"
        )


def _still_missing(
    changed: threading.Condition, ranks: Iterable[int], missing: Callable[[int], bool], wait: float
) -> list[int]:
    """The ``ranks`` still ``missing``, after waiting up to ``wait`` s for ``changed``
    (notified, under its lock, whenever what ``missing`` reads changes)."""
    with changed:
        left = [r for r in ranks if missing(r)]
        if left and wait > 0:
            changed.wait(wait)
            left = [r for r in left if missing(r)]
        return left
