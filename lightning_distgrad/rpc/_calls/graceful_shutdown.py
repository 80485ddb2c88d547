"""Graceful shutdown, bounded, in O(log n) collective steps: every worker joins, then the
job drains to quiescence. The one home of termination detection.

**Joining.** Each worker enters a non-blocking barrier (``Ibarrier`` on the transport's
collective communicator). Once it completes every worker is in shutdown: user RRefs are
released then, as torch's agent does.

**Draining** (:func:`_drain`), the four-counter method. In each round every worker waits
until none of its calls waits for a response, then contributes to a non-blocking allreduce
of three integers the frames its transport sent, the frames it received in sequence, and
whether it is busy (a received frame not yet handled, a call pending, a queued callback). A
round ends the job when everyone is idle, the job received at least as many frames as it
sent, and the totals equal the previous round's. Why that is safe: a worker takes
its snapshot of round k+1 only after the allreduce of round k completed, so after every
snapshot of round k. Counters only grow, so equal totals mean that no worker's counters
changed between its two snapshots: at any instant between the last snapshot of round k and
the first of round k+1 the counters were the totals. An agent receives in sequence only
frames that were sent to it, so received never exceeds sent for any pair of ranks unless
frames no agent sent are counted (below); received >= sent then means equal for every pair,
and every frame sent had been received, and each worker, idle at its later snapshot
without having sent anything since, had handled all it received without sending more:
nothing is in flight and nothing runs that could send. A frame sent later would need a
handler or call that did not exist.
Liveness: once the work is done, two rounds end it.

**Frames no agent sent.** ``received`` counts only frames whose tag is the next one their
source's transport uses towards this worker (tags count each pair's frames, see
``_transport.receiving``); whether a frame decodes does not matter, so a frame an agent
sent that the receiver could not read still balances its send. Bytes put on the
communicator by other code on other tags are handled (or dropped) and counted nowhere. One
that carries exactly the tag its source's next agent frame will carry is counted in that
frame's place (the pair's count is right again once a later agent frame came), or, after
the pair's last agent frame, counted on top: a rank may receive more than was sent to it,
which never keeps the job from ending. Such a surplus could end the job early only by
standing in, in the totals, for a frame still in flight over two whole rounds; a request or
response in flight keeps its caller busy (a pending call), so only a one-way frame could be
lost that way, and only where other code forges agent frames.

**Cost.** The protocol sends no frame: an ``Ibarrier`` and two or more allreduces of three
integers, each ``ceil(log2 n)`` steps in MPICH's algorithms: a rank's bytes and messages grow
as log n.

**Bounds.** With a ``timeout`` every stage shares that deadline; a worker missing the
barrier by then is named (only then is every other worker asked, by a call with a short
timeout, whether it is in shutdown: a frozen or busy one does not say yes; one that asked
this worker the same has joined, even if its agent stopped before this one asks) and
:class:`ShutdownTimeout` raised. Without one, a worker may take as long as it likes to
join as long as it answers: while it waits in the barrier, each worker pings only its
successor in rank order (after a second, then once a second); one that leaves a ping
unanswered for the RPC timeout is taken as stopped and the job aborted with its name (a
frozen worker's predecessor either waits in the barrier too, or is itself busy and joins
later, then pings it). A peer process of this node that ends is seen at once
(``_transport.fail_stop``); a drain round waits at most the RPC timeout.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import torch

from ..._backoff import Backoff, nap_until
from .._transport import Transport, abort_mpi_job
from . import dispatch
from .worker_info import WorkerInfo

if TYPE_CHECKING:
    from .agent import Agent

#: Between drain rounds with work still running somewhere, at most this long.
_CHECK_S = 0.05
#: In the barrier without a timeout: the successor is first pinged after this, then
#: again this long after each answer.
_PING_AFTER_S = 1.0
_PING_EVERY_S = 1.0
#: While calls of this worker wait for their responses, it checks again this often.
_ANSWER_NAP_S = 0.0005
#: On a timed shutdown's miss, how long each worker has to say whether it joined.
_ASK_S = 1.0


class ShutdownTimeout(RuntimeError):
    """Graceful shutdown did not finish within its timeout."""


class Termination:
    """What graceful shutdown knows of one agent: frames handed to it and frames whose
    handling ended, whether it is in shutdown; and what the end of a peer process of this
    node means (:meth:`on_peer_lost`). ``pending`` is the agent's table of calls waiting
    for responses (read, never changed here)."""

    def __init__(self, infos: list[WorkerInfo], me: int, transport: Transport, pending: dict):
        self._infos = infos
        self._me = me
        self._transport = transport
        self._pending = pending
        self._lock = threading.Lock()
        self._arrived = 0
        self._processed = 0
        self.in_shutdown = False
        # Workers that asked this one whether it is in shutdown: they are (see _not_joined).
        self.joined: set[int] = set()
        # Peers of this node that ended while they may have finished shutting down.
        self._peers_may_end = False
        self._ended: list[int] = []

    def arrived(self) -> None:
        """A frame was handed to the agent."""
        with self._lock:
            self._arrived += 1

    def processed(self) -> None:
        """The handling of a frame ended (a request's once its response was sent)."""
        with self._lock:
            self._processed += 1

    def snapshot(self) -> tuple[int, int, bool]:
        """(frames sent, frames received in sequence, idle): idle when no call of this worker
        waits for its response and every frame received, even a malformed one, has been
        handled (a handler ends after what it sent)."""
        sent, received, receiving = self._transport.frame_counts()
        with self._lock:
            handling = self._arrived != self._processed
        idle = not (receiving or handling or self._pending or self._transport.has_queued())
        return sent, received, idle

    def on_peer_lost(self, rank: int) -> None:
        """A rank of this node ended: the job cannot go on without it. While a drain
        round that may be the last runs, the rank may have finished shutting down: that
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


def in_shutdown(asker: int) -> bool:
    """Run on a worker asked, by a timed shutdown that missed its deadline, whether it
    is in shutdown; the ``asker`` is (it missed its deadline in shutdown)."""
    agent = dispatch.current_agent()
    if agent is None:
        return False
    agent.termination.joined.add(asker)
    return agent.termination.in_shutdown


def graceful(agent: Agent, timeout: float, release_users) -> None:
    """Join, ``release_users()``, then drain; ``timeout`` s (0: no limit)."""
    deadline = time.monotonic() + timeout if timeout > 0 else None
    agent.termination.in_shutdown = True
    if not _join(agent, deadline):
        raise ShutdownTimeout(
            f"shutdown timed out after {timeout:g} s on {agent.info.name}: "
            f"{_not_joined(agent)} did not call shutdown (still busy, stuck or stopped). "
            "This worker's agent is stopped; the job cannot finish normally."
        )
    release_users()
    _drain(agent, deadline, timeout)


def _names(agent: Agent, ranks: list[int]) -> str:
    return ", ".join(f"{agent.infos[r].name} (rank {r})" for r in ranks)


def _join(agent: Agent, deadline: float | None) -> bool:
    """Wait in the barrier; False if ``deadline`` passed first. Without a deadline, the
    successor is pinged (see the module's docstring) and its silence aborts the job."""
    if deadline is not None:
        return agent.transport.barrier(max(0.0, deadline - time.monotonic()))
    size = len(agent.infos)
    if size == 1 or agent.timeout <= 0:
        return agent.transport.barrier(None)
    successor = agent.infos[(agent.info.id + 1) % size]
    ping: list = [time.monotonic() + _PING_AFTER_S, None]  # when to ping next, its future

    def check() -> None:
        now = time.monotonic()
        future = ping[1]
        if future is None:
            if now >= ping[0]:
                ping[1] = agent.call(
                    successor,
                    torch.zeros,
                    (0,),
                    {},
                    agent.timeout,
                    user_visible=False,
                    force_autograd=False,
                    operator=True,
                )
            return
        if not future.done():
            return
        try:
            future.wait()
        except Exception:
            abort_mpi_job(
                f"lightning_distgrad: shutdown on {agent.info.name}: "
                f"{_names(agent, [successor.id])} did not answer for {agent.timeout:g} s "
                "(the RPC timeout) and never called shutdown; aborting the MPI job.\n"
            )
        ping[:] = [now + _PING_EVERY_S, None]

    return agent.transport.barrier(None, check)


def _not_joined(agent: Agent) -> str:
    """The workers that do not say, within a short timeout, that they are in shutdown, and
    did not ask this worker the same (those that asked may have stopped since)."""
    me = agent.info.id
    ask = lambda info: agent.call(
        info, in_shutdown, (me,), {}, _ASK_S, user_visible=False, force_autograd=False
    )
    asked = [(info.id, ask(info)) for info in agent.infos if info.id != me]
    missing = []
    for rank, future in asked:
        try:
            joined = future.wait()
        except Exception:
            joined = False
        if joined is not True and rank not in agent.termination.joined:
            missing.append(rank)
    return _names(agent, missing) if missing else "some workers"


def _drain(agent: Agent, deadline: float | None, timeout: float) -> None:
    """Return once every frame sent in the job has been handled (see the module's
    docstring)."""
    previous = None
    mine = None
    between_rounds = Backoff(_CHECK_S, first=0.001)
    termination = agent.termination
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        answered = lambda: not (agent.num_pending() or agent.transport.has_queued())
        if not nap_until(answered, left, Backoff(first=_ANSWER_NAP_S, cap=_ANSWER_NAP_S)):
            raise ShutdownTimeout(
                f"shutdown timed out after {timeout:g} s on {agent.info.name} with "
                f"{agent.num_pending()} RPCs still pending"
            )
        sent, received, idle = termination.snapshot()
        counts = [sent, received]
        # The round can be the last only if this worker's counters did not change since
        # its previous snapshot; once a worker has seen that outcome it may stop and its
        # process end before this one sees it.
        termination.peers_may_end(idle and counts == mine)
        totals = agent.transport.allreduce_sum([*counts, 0 if idle else 1], _limit(agent, deadline))
        if totals is None:
            _stopped_answering(agent, deadline, timeout)
        balanced = totals[1] >= totals[0]
        if totals[-1] == 0 and balanced and totals[:-1] == previous:
            return
        termination.peers_may_end(False)
        previous, mine = totals[:-1], counts
        if totals[-1] or not balanced:
            between_rounds.nap()  # work still runs somewhere


def _limit(agent: Agent, deadline: float | None) -> float | None:
    """How long a drain step may wait: to the deadline, else the RPC timeout (None: ever)."""
    if deadline is not None:
        return max(0.0, deadline - time.monotonic())
    return agent.timeout if agent.timeout > 0 else None


def _stopped_answering(agent: Agent, deadline: float | None, timeout: float) -> None:
    """Raise ShutdownTimeout with a deadline; abort the job without one."""
    message = (
        f"shutdown on {agent.info.name}: the workers stopped answering while "
        "the job drained its last messages"
    )
    if deadline is not None:
        raise ShutdownTimeout(f"{message} (timeout {timeout:g} s)")
    abort_mpi_job(f"lightning_distgrad: {message}; aborting the MPI job.\n")
