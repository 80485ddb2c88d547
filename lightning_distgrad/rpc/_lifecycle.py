"""Starting and stopping RPC on this rank: what ``init_rpc`` and ``shutdown`` do once their
arguments are checked, and what runs at exit.

``start`` is a collective: the ranks meet in the rendezvous, every rank checks every rank's
arguments (names, ranks, torch builds, device maps) and raises the same error if any is wrong,
then the agent is built and made current. ``stop`` shuts it down, gracefully (every worker
joins, then the job drains, see ``_calls.graceful_shutdown``) or at once. The exit hooks shut a
running agent down gracefully at interpreter exit and, in a job of several ranks, make an
uncaught exception or SIGTERM end the whole job instead of leaving the other ranks waiting.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

import torch
from mpi4py import MPI

from .._compat import register_atexit, set_profiler_node_id
from ._calls import autograd_hooks, dispatch, graceful_shutdown, server_profiler
from ._calls.agent import Agent
from ._calls.remote_events import watch_profilers
from ._calls.worker_info import WorkerInfo, name_problem
from ._rrefs import bookkeeping
from ._transport import (
    DTYPE_TABLE,
    FrameLimits,
    abort_mpi_job,
    agree,
    end_job_on_sigterm,
    exchange,
    local_devices,
)
from .options import MPIRpcBackendOptions

_exit_hook_installed = False


def start(
    name: str | None, rank: int, world_size: int | None, options: MPIRpcBackendOptions
) -> None:
    """Start the agent of this rank (see ``rpc.init_rpc``, which checked the arguments'
    types); a collective over the options' communicator."""
    comm = options.comm if options.comm is not None else MPI.COMM_WORLD
    job_size = comm.Get_size()
    alone = world_size == 1 and job_size > 1
    if alone:  # RPC in this process only: no other rank takes part
        comm = MPI.COMM_SELF
    my_rank, size = comm.Get_rank(), comm.Get_size()
    default_name = f"worker{my_rank}"
    chosen_name = name not in (None, default_name)
    name = default_name if name is None else name
    problems = []
    if (p := name_problem(name)) is not None:
        problems.append(p)
    if rank not in (-1, None) and rank != my_rank:
        problems.append(
            f"rank={rank} was passed with world_size=1, whose only rank is 0"
            if alone
            else f"rank={rank} was passed but MPI says this process is rank {my_rank}"
        )
    if world_size is not None and world_size != size:
        problems.append(
            f"world_size={world_size} was passed but the MPI job has {size} ranks "
            "(world_size must be the MPI size, or 1 for RPC within this process alone)"
        )
    everyone = _arguments_of_every_rank(
        comm,
        (name, problems, options.device_maps, (torch.__version__, DTYPE_TABLE)),
        chosen_name,
        options.rpc_timeout,
    )
    first_torch = everyone[0][3]
    _raise_init_problems(
        [(n, ps + _torch_problems(torch_build, first_torch)) for n, ps, _, torch_build in everyone]
    )
    if not alone:
        _prepare_object_reductions(comm)
    infos = [WorkerInfo(n, r) for r, (n, _, _, _) in enumerate(everyone)]
    rank_of = {info.name: info.id for info in infos}
    # Checked before the agent exists: raising later left a running agent behind.
    for src, (_, _, maps, _) in enumerate(everyone):
        for dst_name in maps:
            if dst_name not in rank_of:
                raise ValueError(f"rank {src} set a device map for unknown worker {dst_name!r}")
    autograd_hooks.get().on_init(my_rank)
    # Events of torch profilers carry this worker's id, as under torch's agent, and calls
    # made under a legacy profiler list their remote events in it.
    set_profiler_node_id(my_rank)
    watch_profilers()
    server_profiler.forget_open_ranges()
    rrefs = bookkeeping.init_context(my_rank)
    # Ranks that send CUDA tensors (a device map) or receive them (named in one).
    cuda_ranks = frozenset(
        rank
        for src, (_, _, maps, _) in enumerate(everyone)
        if maps
        for rank in (src, *(rank_of[dst_name] for dst_name in maps))
    )
    agent = Agent(
        comm,
        infos,
        my_rank,
        options.rpc_timeout,
        options.num_worker_threads,
        on_arrival=lambda src, frame: rrefs.add_arrival_forks(frame.forks),
        limits=FrameLimits(options.max_message_bytes, local_devices()),
        cuda_ranks=cuda_ranks,
    )
    for src, (_, _, maps, _) in enumerate(everyone):
        for dst_name, mapping in maps.items():
            if my_rank in (src, rank_of[dst_name]):
                agent.device_maps[src, rank_of[dst_name]] = mapping
    # Current first, then receiving: requests from faster peers may arrive at once.
    dispatch.set_agent(agent)
    agent.start()
    _install_exit_hooks(job_size)


def _prepare_object_reductions(comm: MPI.Comm) -> None:
    """Make mpi4py's first object reduction on the user's communicator here, while every
    rank is in ``init_rpc``.

    mpi4py duplicates a communicator in the first ``allreduce``/``reduce``/``scan`` of Python
    objects made on it, a collective that holds the GIL until every rank reached it. A rank
    blocked there would serve no RPC (this agent is Python), so ranks that wait for its
    answers before they reach the reduction would never reach it. Later reductions wait
    without the GIL.
    """
    comm.allreduce(0)


def _arguments_of_every_rank(
    comm: MPI.Comm, mine: tuple, chosen_name: bool, timeout: float
) -> list[tuple]:
    """Every rank's ``(name, problems, device maps, torch build)``, by rank.

    In the usual case (every rank named ``worker{rank}``, no problem, no device map, the same
    dtype table) one allreduce of three numbers says so, and every rank fills the list in
    itself: the bytes a rank sends and receives do not grow with the job. Otherwise every
    rank's arguments are gathered, for the checks and their messages.
    """
    _, problems, maps, build = mine
    fingerprint = _dtype_fingerprint(build[1])
    unusual = int(chosen_name or bool(problems) or bool(maps))
    top = agree(comm, [unusual, fingerprint, -fingerprint], timeout)  # elementwise maxima
    if top[0] == 0 and top[1] == -top[2]:  # no rank unusual; max == min: one dtype table
        return [(f"worker{r}", [], {}, build) for r in range(comm.Get_size())]
    return exchange(comm, mine, timeout, met=True)


def _dtype_fingerprint(dtypes: Any) -> int:
    """A 62-bit hash of a dtype table, alike in every process that has the same table."""
    digest = hashlib.blake2b(repr(dtypes).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def _torch_problems(torch_build: tuple, first: tuple) -> list[str]:
    """Frames name dtypes by their index in torch's dtype list: it must match rank 0's."""
    if torch_build[1] == first[1]:
        return []
    return [
        f"its torch ({torch_build[0]}) has other dtypes than rank 0's ({first[0]}); "
        "install the same torch version on every rank"
    ]


def _raise_init_problems(everyone: list) -> None:
    lines = [f"  rank {r} ({n!r}): {p}" for r, (n, ps) in enumerate(everyone) for p in ps]
    seen: dict[str, int] = {}
    for r, (n, _) in enumerate(everyone):
        if n in seen:
            lines.append(f"  RPC worker name {n!r} is not unique: ranks {seen[n]} and {r} use it")
        seen.setdefault(n, r)
    if lines:
        raise RuntimeError(
            "init_rpc failed on every rank because:\n"
            + "\n".join(lines)
            + "\nFix the arguments and call init_rpc again."
        )


def stop(agent: Agent, graceful: bool, timeout: float) -> None:
    """Stop ``agent`` (see ``rpc.shutdown``); ``timeout`` s for a graceful one (0: none)."""
    finished = not graceful
    try:
        if graceful:
            # As torch's: user RRefs go only once every worker is in shutdown. A worker
            # that calls it at once (a tutorial's trainer) still serves work that uses
            # them.
            graceful_shutdown.graceful(
                agent, timeout, lambda: bookkeeping.require_context().delete_all_users(agent)
            )
            finished = True
    finally:
        dispatch.set_agent(None)
        agent.stop(wait=finished, drained=graceful and finished)
        autograd_hooks.get().on_shutdown()


def _install_exit_hooks(size: int) -> None:
    global _exit_hook_installed
    if _exit_hook_installed:
        return
    _exit_hook_installed = True
    # Runs before the interpreter joins thread pools (and before mpi4py's
    # MPI_Finalize), so peers still get their answers.
    register_atexit(_shutdown_at_exit)
    if size > 1:
        end_job_on_sigterm()
        previous = sys.excepthook

        def abort_job(exc_type: type, exc: BaseException, tb: Any) -> None:
            previous(exc_type, exc, tb)
            # An exception that ends the program has the frames it passed through; one
            # without is an error CPython printed and went on from (a deallocator's
            # SystemError), which ends nothing.
            if issubclass(exc_type, SystemExit) or tb is None:
                return
            rank = MPI.COMM_WORLD.Get_rank()
            abort_mpi_job(
                f"lightning_distgrad: uncaught {exc_type.__name__} on rank {rank}; "
                "aborting the MPI job so the other ranks do not wait forever.\n"
            )

        sys.excepthook = abort_job


def _shutdown_at_exit() -> None:
    agent = dispatch.current_agent()
    if agent is not None:
        stop(agent, graceful=True, timeout=0)
