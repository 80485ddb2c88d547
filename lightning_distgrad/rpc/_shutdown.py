"""Graceful shutdown, bounded: every worker joins, then the job drains to quiescence.

Each worker sends JOIN to every other one and waits until it has heard from
all. Then user RRefs are released and the agents count the frames sent and
processed (an allreduce per round) until two rounds agree with nothing pending.

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

from ._abort import abort_mpi_job
from ._agent import Agent

#: A joined-or-not check this often; a worker not yet joined is pinged again after this.
_CHECK_S = 0.05
_PING_EVERY_S = 1.0


class ShutdownTimeout(RuntimeError):
    """Graceful shutdown did not finish within its timeout."""


def graceful(agent: Agent, timeout: float, release_users) -> None:
    """Join, ``release_users()``, then wait for quiescence; ``timeout`` s (0: no limit)."""
    deadline = time.monotonic() + timeout if timeout > 0 else None
    agent.join()
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
        missing = agent.not_joined(_CHECK_S)
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
    """Return once every request in the job is answered (termination detection)."""
    previous = None
    while True:
        while agent.num_pending() or agent.transport.has_queued():
            if deadline is not None and time.monotonic() > deadline:
                raise ShutdownTimeout(
                    f"shutdown timed out after {timeout:g} s on {agent.info.name} with "
                    f"{agent.num_pending()} RPCs still pending"
                )
            time.sleep(0.0005)
        if deadline is not None:
            limit = max(0.0, deadline - time.monotonic())
        else:
            limit = agent.timeout if agent.timeout > 0 else None
        totals = agent.transport.allreduce_sum(agent.counts(), limit)
        if totals is None:
            message = (
                f"shutdown on {agent.info.name}: the workers stopped answering while "
                "the job drained its last messages"
            )
            if deadline is not None:
                raise ShutdownTimeout(f"{message} (timeout {timeout:g} s)")
            abort_mpi_job(f"lightning_distgrad: {message}; aborting the MPI job.\n")
        if totals[0] == totals[1] and totals == previous:
            return
        previous = totals
