"""One rank's part of recording a merged timeline: the collective start and stop.

:func:`~lightning_distgrad.profiler.profile` and
:class:`~lightning_distgrad.profiler.TimelineCallback` both record through
:class:`Recording`. Every rank of the communicator starts one and stops it, in the same
order; a rank may do so from any thread (a serving rank does it from a thread of its
own, its main thread being busy serving).
"""

from __future__ import annotations

import json
import os
import tempfile

import torch
from mpi4py import MPI

from .._backoff import Backoff, nap_until
from .._compat import quiet_first_profiler_cycle, quiet_kineto_without_gpu
from ..rpc import _internal
from ..rpc._internal import MessageLog, active_log, collect_remote_events, set_log
from ._timeline import clock_offsets, merge_traces

#: How often a rank waiting for the others checks whether they arrived (it sleeps
#: meanwhile: the agent's threads need the cores).
POLL_S = 0.0005


def wait_for_everyone(comm: MPI.Comm, poll_s: float = POLL_S) -> None:
    """A barrier that naps (at most ``poll_s`` at a time) instead of spinning."""
    nap_until(comm.Ibarrier().Test, backoff=Backoff(poll_s))


class Recording:
    """This rank's part of one merged timeline over ``comm``, written by ``root``.

    :meth:`start` and :meth:`stop` are collectives over ``comm``. While it records, this
    rank logs every frame and RPC span (all threads) and, given ``torch_profiler``
    (keyword arguments of ``torch.profiler.profile``), runs a torch profiler on the
    thread that started it. Calls made meanwhile are not recorded on their callee for
    the caller's profiler: the callee's own lane shows them.
    """

    def __init__(self, comm: MPI.Comm, root: int = 0, torch_profiler: dict | None = None):
        self.comm = comm
        self.root = root
        self.torch_profiler = torch_profiler
        self.profiler: torch.profiler.profile | None = None
        self._work: MPI.Comm | None = None
        self._log: MessageLog | None = None
        self._offsets = None
        self._remote_events = True

    def start(self) -> torch.profiler.profile | None:
        """Start recording on this rank; returns the torch profiler, if one was asked for."""
        if active_log() is not None:
            raise RuntimeError(
                "a merged timeline is already being recorded on this rank: stop it before "
                "starting another (lightning_distgrad.profiler.profile and TimelineCallback "
                "record one at a time)"
            )
        wait_for_everyone(self.comm)  # before the blocking collectives, which spin
        self._work = self.comm.Dup()
        try:
            self._offsets = clock_offsets(self._work, self.root)
            self._log = MessageLog()
            set_log(self._log)
            self._remote_events = collect_remote_events(False)
            if self.torch_profiler is not None:
                quiet_kineto_without_gpu()
                self.profiler = torch.profiler.profile(**self.torch_profiler)
                with quiet_first_profiler_cycle():
                    self.profiler.__enter__()
            wait_for_everyone(self._work)  # every rank records before any goes on
        except BaseException:
            self._end_recording()
            self._work.Free()
            raise
        return self.profiler

    def stop(self, path: str | os.PathLike | None, poll_s: float = POLL_S) -> None:
        """Stop recording once every rank stops; ``root`` writes the merged trace to
        ``path`` (the others ignore it)."""
        work = self._work
        try:
            try:
                # Every rank records until the last one stops: a rank that only serves
                # would otherwise stop before the work it serves.
                wait_for_everyone(work, poll_s)
            finally:
                self._end_recording()
            trace = _chrome_trace(self.profiler) if self.profiler is not None else {}
            gathered = work.gather((trace, self._log.entries), root=self.root)
            if work.Get_rank() == self.root:
                merged = merge_traces(gathered, self._offsets, _worker_names(work.Get_size()))
                with open(path, "w") as f:
                    json.dump(merged, f)
        finally:
            work.Free()

    def abandon(self) -> None:
        """Stop recording on this rank alone (after an error: the others may never stop)."""
        if self._work is not None and active_log() is self._log:
            self._end_recording()
            self._work.Free()
            self._work = None

    def _end_recording(self) -> None:
        try:
            if self.profiler is not None:
                self.profiler.__exit__(None, None, None)
        finally:
            set_log(None)
            collect_remote_events(self._remote_events)


def _worker_names(size: int) -> list[str]:
    agent = _internal.current_agent()
    if agent is not None and len(agent.infos) == size:
        return [info.name for info in agent.infos]
    return [f"worker{r}" for r in range(size)]


def _chrome_trace(prof: torch.profiler.profile) -> dict:
    """This rank's trace as torch exports it (Chrome trace format)."""
    with tempfile.TemporaryDirectory() as folder:
        file = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(file)
        with open(file) as f:
            return json.load(f)
