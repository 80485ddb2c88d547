"""Profiling a whole job: ``torch.profiler`` on every rank, merged into one timeline.

Any torch profiler records the distributed backward pass
(``torch::distributed::autograd::backward``, with a span for each stretch of local
engine work and each gradient message sent and handled). RPCs are recorded, as in
PyTorch, by the legacy ``torch.autograd.profiler_legacy.profile()``, and also by
``torch.profiler.profile()`` inside :func:`record_rpcs`: each call under torch's RPC
profiling names (``rpc_sync#aten::add(worker0 -> worker1)``, ``rpc_async#...``,
``rpc_remote#...``), the callee's run of each request (``rpc_serve#...``), and what
the callee ran for the call, which ``key_averages()`` on the caller lists as torch's RPC
profiling does (``rpc_sync#...#remote_op: aten::add``, ``node_id`` the callee's rank).

:func:`profile` runs ``torch.profiler`` on every rank and, on exit, writes one
Chrome/Perfetto trace of the job on rank 0: one process lane per worker, clocks
aligned, and an arrow from each message's send to its receipt. Under Lightning,
:class:`TimelineCallback` writes the same for a range of training steps, serving
ranks included.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from mpi4py import MPI

from ..rpc._internal import record_rpcs
from ._plot import plot_timeline
from ._session import Recording

__all__ = ["profile", "plot_timeline", "record_rpcs", "TimelineCallback"]


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
    ``python -m lightning_distgrad.profiler plot trace.json timeline.png``. Calls made
    inside are not recorded on their callee for the caller's profiler (no remote events
    in ``key_averages()``): the callee's lane in the trace shows them.

    Example::
        Run with ``mpiexec -n 2 python -m mpi4py example.py``:

        >>> # xdoctest: +SKIP
        >>> from lightning_distgrad import profiler
        >>> with profiler.profile("trace.json"):
        ...     if rpc.get_worker_info().id == 0:
        ...         rpc.rpc_sync("worker1", torch.add, (torch.ones(2), 1))
    """
    recording = Recording(comm or MPI.COMM_WORLD, 0, kwargs)
    prof = recording.start()
    try:
        yield prof
    except BaseException:
        recording.abandon()
        raise
    recording.stop(path)


def __getattr__(name: str) -> Any:
    # The callback needs Lightning: imported on first use only.
    if name == "TimelineCallback":
        from ._callback import TimelineCallback

        return TimelineCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
