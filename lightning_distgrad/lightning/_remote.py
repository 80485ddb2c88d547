"""What the strategy asks parameter owners (serving ranks) to do, over RPC.

Each handler is a small module-level function run on the owner: the optimizer step on the
gradients that distributed autograd accumulated there in the trainers' contexts (summed, and
clipped), the gradient norms of gradient clipping, hyper-parameter updates of the owner's local
optimizers (LR schedulers), the end-of-stage reports that release a serving rank's serve loop,
and the hand-over of a ``RemoteModule`` shared by all trainers. Callers fan out with
``rpc._internal.call_all``.
"""

from __future__ import annotations

import itertools
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .. import autograd as dist_autograd
from .. import rpc
from ..rpc._internal import call_all

__all__ = ["StageReport", "stage_board"]


# --- Gradients in a context, on the owner --------------------------------------------------------


#: Gradient clipping that waits for the step: ``("scale", coef)`` (by norm) or ``("clamp",
#: clip_value)`` (by value), applied in order to the summed gradients.
Clip = tuple[str, float]


def summed_gradients(
    context_ids: Sequence[int], clips: Sequence[Clip] = ()
) -> dict[torch.Tensor, torch.Tensor]:
    """``{leaf: g}`` over this worker's leaves, ``g`` the sum of the leaf's gradients over the
    contexts (in their order, so every run adds alike) with ``clips`` applied: the update that
    the trainers' steps apply here together. Leaves with no gradient in any context are absent.
    """
    totals: dict[torch.Tensor, torch.Tensor] = {}  # tensors hash by identity
    for context_id in context_ids:
        for leaf, grad in dist_autograd._gradients_here(context_id).items():
            totals[leaf] = grad if leaf not in totals else totals[leaf] + grad
    for kind, value in clips:
        totals = {
            leaf: grad * value if kind == "scale" else _clamp(grad, value)
            for leaf, grad in totals.items()
        }
    return totals


def grad_sq_norm(context_ids: Sequence[int], clips: Sequence[Clip] = ()) -> float:
    """``||g||^2`` summed over this worker's leaves, ``g`` as in :func:`summed_gradients`."""
    return math.fsum(sq_norm(g) for g in summed_gradients(context_ids, clips).values())


def step_on_own_context(local_optim_rref: rpc.RRef, context_id: int, clips: Sequence[Clip]) -> None:
    """One step of a trainer's own local optimizer (run-ahead mode) on its context's gradients
    (its ``1/num_trainers`` share), clipped as ``clips`` say."""
    local_optim_rref.local_value().step_with(summed_gradients([context_id], clips))


@dataclass
class _SharedStep:
    """The trainers' parts of one step of a shared optimizer that have arrived so far."""

    context_ids: dict[int, int] = field(default_factory=dict)  # trainer -> its context
    replies: list[torch.futures.Future] = field(default_factory=list)
    clips: Sequence[Clip] = ()  # trainer 0's, once it arrived


_shared_steps_lock = threading.Lock()
#: Per shared local optimizer on this owner: its steps still waiting for some trainer.
_shared_steps: weakref.WeakKeyDictionary[Any, dict[int, _SharedStep]] = weakref.WeakKeyDictionary()


@rpc.functions.async_execution
def step_shared(
    local_optim_rref: rpc.RRef,
    step: int,
    trainer: int,
    num_trainers: int,
    context_id: int,
    clips: Sequence[Clip],
) -> torch.futures.Future:
    """Trainer ``trainer``'s part of step ``step`` of an optimizer that ``num_trainers`` share.

    The last of the trainers' parts of a step runs it: one step on the gradients summed over
    every trainer's context (each holds its ``1/num_trainers`` share, so the sum is their mean
    gradient; added in trainer order), clipped as trainer 0 asked. Every part's reply waits for
    the step, so the trainers' contexts stay open until it has read them, and every trainer gets
    its error if it failed.
    """
    local = local_optim_rref.local_value()
    reply: torch.futures.Future = torch.futures.Future()
    with _shared_steps_lock:
        pending = _shared_steps.setdefault(local, {})
        part = pending.setdefault(step, _SharedStep())
        part.context_ids[trainer] = context_id
        part.replies.append(reply)
        if trainer == 0:
            part.clips = clips
        ready = len(part.context_ids) == num_trainers
        if ready:
            del pending[step]
    if ready:
        try:
            ids = [part.context_ids[t] for t in sorted(part.context_ids)]
            local.step_with(summed_gradients(ids, part.clips))
        except Exception as error:
            for waiting in part.replies:
                waiting.set_exception(error)
        else:
            for waiting in part.replies:
                waiting.set_result(None)
    return reply


def sq_norm(grad: torch.Tensor) -> float:
    """``||grad||^2`` in float64; sparse gradients count each index once (coalesced)."""
    values = grad.detach().coalesce().values() if grad.is_sparse else grad.detach()
    return float(torch.linalg.vector_norm(values, 2.0, dtype=torch.float64)) ** 2


def _clamp(grad: torch.Tensor, clip: float) -> torch.Tensor:
    if not grad.is_sparse:
        return grad.clamp(-clip, clip)
    grad = grad.coalesce()
    return torch.sparse_coo_tensor(grad.indices(), grad.values().clamp(-clip, clip), grad.shape)


# --- RemoteModules under mixed precision, on the owner --------------------------------------------


def autocast_forward(
    module_rref: rpc.RRef,
    device: str,
    is_device_map_set: bool,
    dtype: torch.dtype,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """A RemoteModule's forward under ``torch.autocast(dtype)`` (autocast is per thread, so the
    trainer's autocast does not reach the owner by itself)."""
    from ..nn.remote_module import _remote_forward

    with torch.autocast(torch.device(device).type, dtype=dtype):
        return _remote_forward(module_rref, device, is_device_map_set, *args, **kwargs)


# --- Local optimizers of a DistributedOptimizer, on the owner ------------------------------------


def set_hyperparameters(local_optim_rref: rpc.RRef, hyperparameters: dict[str, Any]) -> None:
    """Update every param group of an owner's local optimizer (e.g. the lr a scheduler set)."""
    from ..optim.optimizer import _LocalOptimizer

    local = local_optim_rref.local_value()
    with _LocalOptimizer.global_lock:
        for group in local.optim.param_groups:
            group.update(hyperparameters)


# --- Serving ranks: end-of-stage reports ---------------------------------------------------------


class StageReport(NamedTuple):
    """A trainer's report that it finished stage ``stage`` (one ``Trainer.fit/validate/...``);
    ``requeue``: it stopped there for a Slurm requeue."""

    stage: int
    trainer_rank: int
    error: tuple[type, str] | None
    requeue: bool = False


class _StageBoard:
    """Where a serving rank collects the trainers' end-of-stage reports."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._reports: dict[int, list[StageReport]] = {}

    def post(self, report: StageReport) -> None:
        with self._cond:
            self._reports.setdefault(report.stage, []).append(report)
            self._cond.notify_all()

    def wait(
        self, stage: int, num_trainers: int, timeout: float | None = None
    ) -> list[StageReport] | None:
        """Every trainer's report of ``stage``, or None if ``timeout`` seconds pass first."""
        with self._cond:
            done = self._cond.wait_for(
                lambda: len(self._reports.get(stage, ())) >= num_trainers, timeout
            )
            return self._reports.pop(stage) if done else None


stage_board = _StageBoard()


def report_stage(report: StageReport) -> None:
    stage_board.post(report)


# --- RemoteModules shared by all trainers --------------------------------------------------------

_shared_lock = threading.Lock()
_shared: dict[int, Any] = {}
_shared_keys = itertools.count()  # numbers the objects trainer 0 hands out


def share(collectives: Any, trainers: Sequence[int], create: Callable[[], Any]) -> Any:
    """``create()`` on trainer 0, handed to every other trainer (ranks ``trainers``): the same
    object everywhere. A collective over the trainers (``collectives``)."""
    key = None
    if collectives.rank == 0:
        key, module = next(_shared_keys), create()
        _hand_out(key, module, trainers[1:])
    # Trainer 0's key, once every trainer holds the object; a rank's own count could differ
    # (it may have served in an earlier fit).
    key = collectives.broadcast(key, 0)
    if collectives.rank != 0:
        module = take_shared(key)
    return module


def hand_out_plan(ranks: Sequence[int]) -> list[tuple[int, list[int]]]:
    """Whom a holder of a shared object sends it to, each with the ranks it passes it on to:
    halves, so that each rank sends it at most log2(n) times and it reaches every one of
    ``ranks`` after at most log2(n) + 1 hops."""
    plan = []
    while ranks:
        half = (len(ranks) + 1) // 2
        plan.append((ranks[0], list(ranks[1:half])))
        ranks = ranks[half:]
    return plan


def _hand_out(key: int, module: Any, ranks: Sequence[int]) -> None:
    """Give ``module`` to every rank of ``ranks``; returns once all of them hold it."""
    call_all((rank, stash_shared, (key, module, below)) for rank, below in hand_out_plan(ranks))


def stash_shared(key: int, module: Any, below: Sequence[int] = ()) -> None:
    """Keep ``module`` (a RemoteModule sent by another trainer) until :func:`take_shared`, and
    pass it on to the ranks ``below``."""
    with _shared_lock:
        _shared[key] = module
    _hand_out(key, module, below)


def take_shared(key: int) -> Any:
    with _shared_lock:
        return _shared.pop(key)
