"""Slurm auto-requeue for the distgrad strategy: stop at one step on every rank, save, requeue.

Slurm announces the end of a job (time limit, preemption) with a signal, ``SIGUSR1`` by default,
``--signal=USR1@120`` seconds before it. Lightning's own handler saves a checkpoint inside the
signal handler, wherever each rank happens to be; a rank of an RPC model can be half-way through
a distributed backward pass or a remote optimizer step then, and serving ranks run no Lightning
loop at all. Here the handler only sets a flag, on any rank:

1. at every optimisation step the trainers OR their flags in one small allreduce, which takes the
   place of the barrier that already ends each step, so every trainer learns the same answer at
   the same step; a serving rank that got the signal passes it on to the trainers first;
2. after the step where the answer is yes, at the end of its batch (where ``ModelCheckpoint``
   saves too), the trainers write one Lightning "hpc" checkpoint, ``hpc_ckpt_N.ckpt`` in
   ``default_root_dir``: remote parameters and the remote optimizer state included;
3. ``Trainer.fit`` raises :class:`RequeueExit` on every rank, serving ranks too (a ``SystemExit``
   with status 0: the script ends, ``python -m mpi4py`` does not abort), the RPC agent shuts
   down as at any exit, every rank finalises MPI, and trainer 0 then runs ``scontrol requeue``
   (:func:`exit_for_requeue` says why in that order);
4. the requeued job's ``Trainer.fit(ckpt_path=None)`` finds the hpc checkpoint by itself, as
   Lightning does under Slurm, and resumes from it.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from .._backoff import nap_until
from .._compat import hpc_save_path, register_atexit
from ..rpc._internal import call_all

__all__ = ["RequeueCheckpoint", "RequeueExit", "SlurmRequeue", "requeue_job", "slurm_job_id"]

log = logging.getLogger(__name__)


class RequeueExit(SystemExit):
    """Raised by ``Trainer.fit`` on every rank once the job is saved for its requeue.

    A ``SystemExit`` with status 0: the script ends without running the code after ``fit``
    (training is not finished), and the launcher does not treat the exit as a failure.
    """

    def __init__(self, job_id: str | None = None) -> None:
        super().__init__(0)
        self.job_id = job_id

    def __str__(self) -> str:
        job = f"Slurm job {self.job_id}" if self.job_id else "the Slurm job"
        return f"training stopped for the requeue of {job}; its hpc checkpoint resumes it"


def slurm_job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """The id that ``scontrol requeue`` takes for this job (``ARRAYJOB_TASK`` for an array
    task), or None outside a Slurm job.

    Example::

        >>> slurm_job_id({"SLURM_JOB_ID": "12"})
        '12'
        >>> slurm_job_id({"SLURM_JOB_ID": "14", "SLURM_ARRAY_JOB_ID": "12",
        ...               "SLURM_ARRAY_TASK_ID": "2"})
        '12_2'
    """
    environ = os.environ if environ is None else environ
    array_job = environ.get("SLURM_ARRAY_JOB_ID")
    if array_job and environ.get("SLURM_ARRAY_TASK_ID"):
        job_id = f"{array_job}_{environ['SLURM_ARRAY_TASK_ID']}"
    else:
        job_id = environ.get("SLURM_JOB_ID")
    return job_id if job_id and re.fullmatch(r"[0-9_]+", job_id) else None


def _under_slurm() -> bool:
    """Whether Lightning considers this process a Slurm task (and so resumes from an hpc
    checkpoint by itself), inside a job that ``scontrol requeue`` can name."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return SLURMEnvironment.detect() and slurm_job_id() is not None


def requeue_job(job_id: str) -> bool:
    """Run ``scontrol requeue job_id``; whether Slurm accepted it (a failure is logged)."""
    log.info(f"Requeuing Slurm job {job_id}.")
    try:
        result = subprocess.run(
            ["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning(f"Requeuing Slurm job {job_id} failed: {e}")
        return False
    if result.returncode != 0:
        log.warning(
            f"Requeuing Slurm job {job_id} failed (scontrol exit {result.returncode}:"
            f" {result.stderr.strip()}). HINT: submit the job with `sbatch --requeue`; resubmit"
            " it by hand meanwhile: it resumes from the hpc checkpoint."
        )
        return False
    log.info(f"Requeued Slurm job {job_id}.")
    return True


def exit_for_requeue(job_id: str | None) -> None:
    """Make this process's exit safe for the requeue; with ``job_id`` (trainer 0), requeue the
    job at its very end.

    The requeue kills whatever still runs of the job. A rank killed before ``MPI_Finalize``
    leaves its MPI library's shared memory of the job step behind, and the requeued job, which
    has the same job and step ids, can find it on the same node and fail in ``MPI_Init`` (seen
    with MPICH: a hang, or "Destination is unreachable"). So at exit every rank ignores
    ``SIGTERM`` (Slurm's ``SIGKILL`` still follows ``KillWait`` seconds later), shuts the RPC
    agent down as usual, meets the other ranks and calls ``MPI_Finalize``; only then does
    trainer 0 run ``scontrol requeue``.
    """
    register_atexit(_ignore_sigterm)  # threading's exit hooks: before the RPC agent's shutdown
    atexit.register(_finalize_then_requeue, job_id)  # after it


def _ignore_sigterm() -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _finalize_then_requeue(job_id: str | None, timeout: float = 60.0) -> None:
    try:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            barrier = MPI.COMM_WORLD.Ibarrier()
            if nap_until(barrier.Test, timeout):
                MPI.Finalize()
            else:
                log.warning(
                    f"auto-requeue: not every rank reached the end within {timeout:.0f} s;"
                    " requeuing without MPI_Finalize."
                )
    except Exception as e:  # the requeue matters more than a clean finalisation
        log.warning(f"auto-requeue: MPI_Finalize failed before the requeue: {e}")
    if job_id is not None:
        requeue_job(job_id)


class _Flag:
    """Whether this process got the requeue signal (set by the handler or by a serving rank).

    The handler only assigns a bool: it runs between two bytecodes of the main thread, which may
    hold any lock at that moment.
    """

    received = False


_flag = _Flag()


def note_signal() -> None:
    """Set on a trainer by a serving rank that got the signal (runs on an RPC thread)."""
    _flag.received = True


def _handle(signum: int, frame: Any) -> None:
    _flag.received = True


class SlurmRequeue:
    """One strategy's auto-requeue: the handler, the vote at each step, the stop.

    Args:
        enabled (bool): ``auto_requeue``; nothing happens without it or outside Slurm.
        signum (signal.Signals): the signal Slurm sends (``--signal=USR1@120``: ``SIGUSR1``).
    """

    def __init__(self, enabled: bool, signum: signal.Signals) -> None:
        self.enabled = enabled
        self.signum = signal.Signals(signum)
        self.armed = False  # under Slurm, with the handler installed
        self.stopping = False  # the trainers agreed to stop after this step
        self._relayed = False

    def arm(self) -> bool:
        """Install the handler if auto-requeue is on and this is a Slurm job; whether it is.

        Call it after MPI and the RPC agent have started: the MPI library may install its own
        handler for the signal at ``MPI_Init`` (MPICH does), which would swallow it. The handler
        stays for the life of the process (Python cannot give a C handler back); Lightning's
        signal connector, which records it at each ``fit``, puts it back after each.
        """
        self.stopping = False
        self._relayed = False
        if not self.enabled or not _under_slurm():
            self.armed = False
            return False
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "DistAutogradStrategy: auto_requeue needs Trainer.fit on the main thread (only"
                " it can set a signal handler); this job will not be requeued."
            )
            self.armed = False
            return False
        if signal.getsignal(self.signum) is not _handle:
            signal.signal(self.signum, _handle)
            log.debug(f"auto-requeue: {self.signum.name} handler installed.")
        self.armed = True
        return True

    # --- trainers ---------------------------------------------------------------------------

    def vote(self, collectives: Any) -> bool:
        """At a step's end, on every trainer: whether any trainer has the signal (an allreduce
        over the trainers, which also stands for the step's barrier). Latches :attr:`stopping`."""
        stop = collectives.any(_flag.received) if collectives is not None else _flag.received
        if stop and not self.stopping:
            log.info(f"auto-requeue: {self.signum.name} received; stopping after this step.")
        self.stopping = self.stopping or stop
        return stop

    # --- serving ranks ----------------------------------------------------------------------

    def relay(self, trainers: Sequence[int]) -> None:
        """On a serving rank: pass a received signal on to every trainer, once."""
        if self.armed and _flag.received and not self._relayed:
            self._relayed = True
            log.info(f"auto-requeue: {self.signum.name} received; telling the trainers.")
            call_all([(rank, note_signal, ()) for rank in trainers])


class RequeueCheckpoint(Callback):
    """Writes the hpc checkpoint and stops, at the end of the batch whose step the trainers
    agreed to stop after (added by the strategy; it runs after ``ModelCheckpoint``)."""

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        requeue = getattr(trainer.strategy, "requeue", None)
        if requeue is None or not requeue.stopping:
            return
        strategy = trainer.strategy
        # One name for every trainer: trainer 0 picks the next free number.
        path = strategy.broadcast(hpc_save_path(trainer) if trainer.is_global_zero else None, 0)
        trainer.save_checkpoint(path, weights_only=False)  # a collective: remote states too
        job_id = slurm_job_id()
        rank_zero_info(
            f"auto-requeue: saved {path} at step {trainer.global_step}; requeuing Slurm job"
            f" {job_id} once every rank has exited."
        )
        exit_for_requeue(job_id if trainer.is_global_zero else None)
        raise RequeueExit(job_id)


def reset_signal() -> None:
    """Forget a received signal (for tests that run several jobs in one process)."""
    _flag.received = False
