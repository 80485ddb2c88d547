"""Graceful shutdown, bounded: every worker joins, then the job drains to quiescence.

Each worker sends JOIN to every other one and waits until it has heard from
all. Then user RRefs are released and the job drains in rounds until one finds
nothing left anywhere (see :func:`_wait_quiescent`).

With a ``timeout`` every stage shares that deadline and a miss raises, naming
the workers that did not join. Without one, workers may take as long as they
like to join as long as they answer: each one not yet joined is pinged, and one
that leaves a ping unanswered for the RPC timeout is taken as stopped. The job
then cannot end normally (MPI's finalisation would wait for it), so it is
aborted with their names.
"""

from __future__ import annotations

import time

import torch

from ..._backoff import Backoff, nap_until
from .._transport import abort_mpi_job
from .agent import Agent

#: A joined-or-not check this often; a worker not yet joined is pinged again after this.
_CHECK_S = 0.05
_PING_EVERY_S = 1.0
#: While calls of this worker wait for their responses, it checks again this often.
_ANSWER_NAP_S = 0.0005


class ShutdownTimeout(RuntimeError):
    """Graceful shutdown did not finish within its timeout."""


def graceful(agent: Agent, timeout: float, release_users) -> None:
    """Join, ``release_users()``, then wait for quiescence; ``timeout`` s (0: no limit)."""
    deadline = time.monotonic() + timeout if timeout > 0 else None
    agent.termination.join()
    missing = _wait_for_joins(agent, deadline)
    if missing:
        raise ShutdownTimeout(
            f"shutdown timed out after {timeout:g} s on {agent.info.name}: "
            f"{_names(agent, missing)} did not call shutdown (still busy, stuck or stopped). "
            "This worker's agent is stopped; the job cannot finish normally."
        )
    release_users()
    _wait_quiescent(agent, deadline, timeout)


def _names(agent: Agent, ranks: list[int]) -> str:
    return ", ".join(f"{agent.infos[r].name} (rank {r})" for r in ranks)


def _failed(future: torch.futures.Future) -> bool:
    try:
        future.wait()
    except Exception:
        return True
    return False


def _wait_for_joins(agent: Agent, deadline: float | None) -> list[int]:
    """The ranks that did not join by ``deadline``; aborts the job if, without a
    deadline, one of them stops answering."""
    pings: dict[int, tuple[float, torch.futures.Future]] = {}
    while True:
        missing = agent.termination.not_joined(_CHECK_S)
        now = time.monotonic()
        if not missing or (deadline is not None and now >= deadline):
            return missing
        if deadline is not None or agent.timeout <= 0:
            continue
        stopped = []
        for rank in missing:
            sent, ping = pings.get(rank, (0.0, None))
            if ping is not None and ping.done() and _failed(ping):
                stopped.append(rank)
            elif ping is None or (ping.done() and now - sent >= _PING_EVERY_S):
                pings[rank] = (
                    now,
                    agent.call(
                        agent.infos[rank],
                        torch.zeros,
                        (0,),
                        {},
                        agent.timeout,
                        user_visible=False,
                        force_autograd=False,
                        operator=True,
                    ),
                )
        if stopped:
            abort_mpi_job(
                f"lightning_distgrad: shutdown on {agent.info.name}: "
                f"{_names(agent, stopped)} did not answer for {agent.timeout:g} s (the RPC "
                "timeout) and never called shutdown; aborting the MPI job.\n"
            )


def _wait_quiescent(agent: Agent, deadline: float | None, timeout: float) -> None:
    """Return once every frame sent in the job has been handled (termination detection).

    In each round every worker sends FLUSH(round) to every worker and waits for all of
    theirs. MPI hands over the frames of one sender on one communicator in the order
    they were sent, so once every FLUSH has come, every frame sent before it has been
    handed to its agent. A round in which no worker sent or handled a frame (FLUSHes
    aside), and at whose end every worker is idle, leaves nothing to do anywhere: any
    later frame would have to be sent by a handler that did not run.

    No worker compares its count of frames received with the others' counts of frames
    sent: a frame no agent sent (bytes put on the communicator by other code) is
    handled or dropped like any other and cannot keep the job from ending.
    """
    round_ = 0
    between_rounds = Backoff(_CHECK_S, first=0.001)
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        answered = lambda: not (agent.num_pending() or agent.transport.has_queued())
        if not nap_until(answered, left, Backoff(first=_ANSWER_NAP_S, cap=_ANSWER_NAP_S)):
            raise ShutdownTimeout(
                f"shutdown timed out after {timeout:g} s on {agent.info.name} with "
                f"{agent.num_pending()} RPCs still pending"
            )
        round_ += 1
        before = agent.termination.activity()
        agent.termination.flush(round_)
        _wait_for_flushes(agent, round_, deadline, timeout)
        quiet = agent.termination.idle() and agent.termination.activity() == before
        # Only a round that every worker found quiet is the last; once a worker has seen
        # its outcome it may stop and its process end before this one sees it.
        agent.termination.peers_may_end(quiet)
        totals = agent.transport.allreduce_sum([0 if quiet else 1], _limit(agent, deadline))
        if totals is None:
            _stopped_answering(agent, deadline, timeout, "the workers")
        if totals[0] == 0:
            return
        agent.termination.peers_may_end(False)
        between_rounds.nap()  # work still runs somewhere


def _limit(agent: Agent, deadline: float | None) -> float | None:
    """How long a drain step may wait: to the deadline, else the RPC timeout (None: ever)."""
    if deadline is not None:
        return max(0.0, deadline - time.monotonic())
    return agent.timeout if agent.timeout > 0 else None


def _wait_for_flushes(agent: Agent, round_: int, deadline: float | None, timeout: float) -> None:
    limit = _limit(agent, deadline)
    end = None if limit is None else time.monotonic() + limit
    while missing := agent.termination.not_flushed(round_, _CHECK_S):
        if end is not None and time.monotonic() >= end:
            _stopped_answering(agent, deadline, timeout, _names(agent, missing))


def _stopped_answering(agent: Agent, deadline: float | None, timeout: float, who: str) -> None:
    """Raise ShutdownTimeout with a deadline; abort the job without one."""
    message = (
        f"shutdown on {agent.info.name}: {who} stopped answering while "
        "the job drained its last messages"
    )
    if deadline is not None:
        raise ShutdownTimeout(f"{message} (timeout {timeout:g} s)")
    abort_mpi_job(f"lightning_distgrad: {message}; aborting the MPI job.\n")
