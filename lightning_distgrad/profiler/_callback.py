"""A Lightning callback that writes the merged timeline of a range of training steps.

Under :class:`~lightning_distgrad.DistAutogradStrategy` the serving ranks run no
Lightning code (no callbacks): they answer RPCs until ``fit`` ends. So trainer 0 asks
each of them, by RPC, to record its part on a thread of its own; from there on the
start and the stop are collectives over the RPC world's communicator, which the serving
ranks join from that thread. A serving rank learns that the window ended from the stop
collective itself (every trainer entering it), so it needs no second RPC.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.profilers import PyTorchProfiler
from mpi4py import MPI

from .. import rpc
from ..rpc import _internal
from ..rpc._internal import profiler_enabled
from ._session import Recording

__all__ = ["TimelineCallback"]

log = logging.getLogger(__name__)

#: How often a serving rank checks whether the trainers stopped recording.
SERVER_POLL_S = 0.005


class TimelineCallback(pl.Callback):
    r"""Write one Chrome/Perfetto trace of every rank for training steps ``start_step`` to
    ``start_step + num_steps - 1`` (counted from 0, as ``trainer.global_step``).

    The trace is :func:`~lightning_distgrad.profiler.profile`'s: one lane per rank, the
    serving ranks' included, clocks aligned, an arrow per message. Trainer 0 writes it
    to ``path``. On every trainer a ``torch.profiler.profile(**profiler_kwargs)`` records
    the main thread during the window, unless another torch profiler runs (Lightning's
    ``PyTorchProfiler``, say: a process runs one at a time); every rank logs its RPCs,
    their runs and the distributed backward's messages, on all threads. If training
    ends first, the trace covers the steps that ran.

    Args:
        path: where trainer 0 writes the trace (JSON).
        start_step: the first step recorded.
        num_steps: how many steps are recorded.
        profiler_kwargs: keyword arguments of ``torch.profiler.profile`` on the trainers.

    Raises:
        ValueError: ``start_step`` < 0 or ``num_steps`` < 1.
        TypeError: the trainer's strategy is not a ``DistAutogradStrategy``.

    Example::
        Run with ``mpiexec -n 2 python -m mpi4py train.py`` (rank 1 serves):

        >>> # xdoctest: +SKIP
        >>> from lightning_distgrad.profiler import TimelineCallback
        >>> timeline = TimelineCallback("trace.json", start_step=10, num_steps=3)
        >>> trainer = L.Trainer(strategy=DistAutogradStrategy(num_servers=1),
        ...                     callbacks=[timeline], max_steps=20)
        >>> trainer.fit(model, data)  # trainer 0 writes trace.json after step 12
    """

    def __init__(
        self,
        path: str | os.PathLike,
        start_step: int = 1,
        num_steps: int = 3,
        **profiler_kwargs: Any,
    ) -> None:
        for name, value, least in (("start_step", start_step, 0), ("num_steps", num_steps, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(
                    f"TimelineCallback: {name} must be an int >= {least}, got {value!r}"
                )
        self.path = os.fspath(path)
        self.start_step = start_step
        self.num_steps = num_steps
        self.profiler_kwargs = profiler_kwargs
        self._recording: Recording | None = None
        self._done = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from ..lightning.strategy import DistAutogradStrategy

        if not isinstance(trainer.strategy, DistAutogradStrategy):
            raise TypeError(
                "TimelineCallback records the ranks of a DistAutogradStrategy, but this "
                f"Trainer's strategy is {type(trainer.strategy).__name__}. HINT: use "
                "Trainer(strategy=DistAutogradStrategy(...)) or strategy='distgrad', or "
                "lightning_distgrad.profiler.profile() around the work to record."
            )

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._recording is None and not self._done and trainer.global_step >= self.start_step:
            self._start(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._recording is not None and trainer.global_step >= self.start_step + self.num_steps:
            self._stop()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._recording is not None:
            self._stop()

    def on_exception(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._recording is not None:
            self._recording.abandon()
            self._recording = None

    def _start(self, trainer: pl.Trainer) -> None:
        agent = _internal.require_agent()
        servers = trainer.strategy.server_ranks
        root = min(r for r in range(len(agent.infos)) if r not in servers)  # trainer 0
        # Sent before this rank's own start: the serving ranks must join its collectives.
        # Nothing records yet, so these calls stay out of the trace.
        futures = (
            [rpc.rpc_async(server, _record_on_server, (root,)) for server in servers]
            if agent.info.id == root
            else []
        )
        # One Kineto profiler per process: none of ours next to Lightning's (which may be
        # between its recording phases now) or another one recording this thread.
        lightnings = isinstance(trainer.profiler, PyTorchProfiler)
        kwargs = None if lightnings or profiler_enabled() else self.profiler_kwargs
        self._recording = Recording(agent.comm, root, kwargs)
        self._recording.start()
        for future in futures:
            future.wait()

    def _stop(self) -> None:
        recording, self._recording = self._recording, None
        self._done = True
        recording.stop(self.path)


def _record_on_server(root: int) -> None:
    """On a serving rank (an RPC from trainer 0): record this rank's part of the timeline
    on a thread of its own, from the trainers' start to their stop."""
    comm = _internal.require_agent().comm
    threading.Thread(
        target=_serve_recording, args=(comm, root), name="distgrad-timeline", daemon=True
    ).start()


def _serve_recording(comm: MPI.Comm, root: int) -> None:
    try:
        recording = Recording(comm, root, None)
        recording.start()
        recording.stop(None, poll_s=SERVER_POLL_S)
    except Exception:
        log.exception("lightning_distgrad: recording the timeline failed on a serving rank")
