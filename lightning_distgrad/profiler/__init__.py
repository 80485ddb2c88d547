"""Profiling a whole job: ``torch.profiler`` on every rank, merged into one timeline.

Inside ``torch.profiler.profile()`` the RPC layer records its calls under torch's
RPC profiling names (``rpc_sync#aten::add(worker0 -> worker1)``, ``rpc_async#...``,
``rpc_remote#...``), the callee's run of each request (``rpc_serve#...``), and the
distributed backward pass (``torch::distributed::autograd::backward``).
:func:`profile` runs ``torch.profiler`` on every rank and, on exit, writes one
Chrome/Perfetto trace of the job on rank 0: one process lane per worker, clocks
aligned, and an arrow from each message's send to its receipt.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch
from mpi4py import MPI

from ..rpc import _core
from ..rpc._profiling import MessageLog, set_log
from ._plot import plot_timeline
from ._timeline import clock_offsets, merge_traces

__all__ = ["profile", "plot_timeline"]


@contextlib.contextmanager
def profile(
    path: str | os.PathLike, comm: MPI.Comm | None = None, **kwargs: Any
) -> Iterator[torch.profiler.profile]:
    """Profile this rank with ``torch.profiler.profile(**kwargs)``; on exit, rank 0
    writes the merged trace of every rank to ``path``. A collective: enter it on every
    rank of ``comm`` (default ``MPI.COMM_WORLD``).

    Clock offsets between ranks are estimated by an MPI ping-pong on entry; each
    rank's offset and its uncertainty (half the best round trip) are stored in the
    trace's ``otherData``. Open the file in https://ui.perfetto.dev or
    ``chrome://tracing``, or draw it with
    ``python -m lightning_distgrad.profiler plot trace.json timeline.png``.

    Example::
        Run with ``mpiexec -n 2 python -m mpi4py example.py``:

        >>> # xdoctest: +SKIP
        >>> from lightning_distgrad import profiler
        >>> with profiler.profile("trace.json"):
        ...     if rpc.get_worker_info().id == 0:
        ...         rpc.rpc_sync("worker1", torch.add, (torch.ones(2), 1))
    """
    work = (comm or MPI.COMM_WORLD).Dup()
    try:
        offsets = clock_offsets(work)
        agent = _core.current_agent()
        log = MessageLog()
        set_log(log)
        try:
            with torch.profiler.profile(**kwargs) as prof:
                yield prof
                # Every rank records until the last one leaves the block: a rank that
                # only serves would otherwise stop before the work it serves.
                _wait_for_everyone(work)
        finally:
            set_log(None)
        names = (
            [info.name for info in agent.infos]
            if agent is not None
            else [f"worker{r}" for r in range(work.Get_size())]
        )
        gathered = work.gather((_chrome_trace(prof), log.entries), root=0)
        if work.Get_rank() == 0:
            merged = merge_traces(gathered, offsets, names)
            with open(path, "w") as f:
                json.dump(merged, f)
    finally:
        work.Free()


def _wait_for_everyone(comm: MPI.Comm) -> None:
    """A barrier that sleeps instead of spinning (the agent's threads need the cores)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.0005)


def _chrome_trace(prof: torch.profiler.profile) -> dict:
    """This rank's trace as torch exports it (Chrome trace format)."""
    with tempfile.TemporaryDirectory() as folder:
        file = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(file)
        with open(file) as f:
            return json.load(f)
