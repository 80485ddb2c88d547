"""One optimisation step of the distgrad strategy: its distributed autograd context and updates.

A step's forward and backward passes (all batches of an accumulation window) run in one
distributed autograd context. :class:`DistributedStep` owns that context, copies what is new
among the context's local gradients to ``.grad`` (so Lightning's hooks and the user's optimizer
see them), and updates the remote parameters with a
:class:`~lightning_distgrad.optim.DistributedOptimizer` that mirrors the user's first optimizer
(its class, and the hyper-parameters of its first param group, pushed whenever they change).
It also clips the step's gradients, local and remote, since it owns the remote gradients and
can compute their norm across trainers (the precision plugins hand clipping to it).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Generator, Iterable
from typing import Any

import torch
from torch import Tensor

from .. import autograd as dist_autograd
from ..nn import RemoteModule, ReplicatedModule
from ..optim import DistributedOptimizer
from ..rpc._internal import call_all
from . import _remote
from ._collectives import TrainerCollectives
from ._model import hyperparameters, same_hyperparameters

__all__ = ["DistributedStep"]


class DistributedStep:
    """The distributed state of the current optimisation step, and the remote optimizer.

    ``loss_scale`` multiplies each backward pass's root: ``1/num_trainers`` with remote modules,
    so that every trainer's remote update carries its share of the mean gradient; local
    gradients are unscaled again when copied to ``.grad``.
    """

    def __init__(self) -> None:
        self.context: dist_autograd.context | None = None
        self.context_id: int | None = None
        self.loss_scale = 1.0
        self.optimizer: DistributedOptimizer | None = None  # over the remote parameters
        self._driver: torch.optim.Optimizer | None = None  # the user's, which it mirrors
        self._collectives: TrainerCollectives | None = None
        self._servers: tuple[int, ...] = ()
        self._seen: dict[Tensor, Tensor] = {}  # context gradients already added to .grad
        self._pushed: dict[str, Any] | None = None  # hyper-parameters the remote side has

    # --- the context ---------------------------------------------------------------------------

    def open(self) -> None:
        """Open a new context (closing one still open)."""
        if self.context is not None:
            self.close()
        context = dist_autograd.context()
        self.context_id = context.__enter__()
        self.context = context
        self._seen = {}

    def close(self) -> None:
        """Release the context, here and on every worker it reached (nothing if none is open)."""
        context, self.context, self.context_id = self.context, None, None
        self._seen = {}
        if context is not None:
            context.__exit__(None, None, None)

    @contextlib.contextmanager
    def scope(self) -> Generator[None, None, None]:
        """A context open for the duration of the ``with`` block."""
        self.open()
        try:
            yield
        finally:
            self.close()

    def backward(self, loss: Tensor, retain_graph: bool) -> None:
        """The distributed backward pass from ``loss`` (scaled), adding to the context."""
        root = loss if self.loss_scale == 1.0 else loss * self.loss_scale
        dist_autograd.backward(self.context_id, [root], retain_graph=retain_graph)

    def collect_local_gradients(
        self, params: Iterable[Tensor], replicated: list[ReplicatedModule], num_trainers: int
    ) -> None:
        """Average replicated gradients over the trainers and add what is new to ``.grad``.

        ``.grad`` of a local parameter then holds what ``loss.backward()`` would have left
        there: this context's (averaged) gradients so far, plus whatever was in ``.grad``.
        """
        if num_trainers > 1:
            for replica in replicated:
                replica.sync_gradients(self.context_id)
        grads = dist_autograd.get_gradients(self.context_id)
        unscale = 1.0 / self.loss_scale
        with torch.no_grad():
            for param in params:
                grad = grads.get(param)
                previous = self._seen.get(param)
                if grad is None or grad is previous:
                    continue
                delta = grad if previous is None else grad - previous
                if unscale != 1.0:
                    delta = delta * unscale
                if param.grad is None:
                    param.grad = delta.detach().clone() if delta is grad else delta.detach()
                else:
                    param.grad.add_(delta)
                self._seen[param] = grad

    # --- the remote optimizer ------------------------------------------------------------------

    def build_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        remote_modules: list[tuple[str, RemoteModule]],
        collectives: TrainerCollectives,
        servers: tuple[int, ...],
    ) -> None:
        """A DistributedOptimizer of ``optimizer``'s class and first param group's settings
        over the remote modules' parameters (held by ``servers``); ``collectives``: the
        trainers'."""
        hparams = hyperparameters(optimizer)
        rrefs = [r for _, module in remote_modules for r in module.remote_parameters()]
        self.optimizer = DistributedOptimizer(type(optimizer), rrefs, **hparams)
        self._pushed = copy.deepcopy(hparams)
        self._driver, self._collectives, self._servers = optimizer, collectives, servers

    def drop_optimizer(self) -> None:
        self.optimizer, self._pushed, self._driver = None, None, None

    def updates_remote(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` (the user's first) also steps the remote parameters."""
        return self.optimizer is not None and optimizer is self._driver

    def forget_pushed(self) -> None:
        """Push the user's optimizer's values at the next step (a loaded state replaced them)."""
        self._pushed = None

    def step_remote(self, optimizer: torch.optim.Optimizer) -> None:
        """Push changed hyper-parameters, then step the remote parameters with the context's
        gradients."""
        hparams = hyperparameters(optimizer)
        if self._pushed is None or not same_hyperparameters(hparams, self._pushed):
            call_all(
                (o.owner(), _remote.set_hyperparameters, (o, hparams))
                for o in self.optimizer.remote_optimizers
            )
            self._pushed = copy.deepcopy(hparams)
        self.optimizer.step(self.context_id)

    # --- gradient clipping over local and remote parameters ------------------------------------

    def clip_by_norm(self, optimizer: Any, local: list[Tensor], max_norm: float) -> float:
        """Clip ``local`` (``optimizer``'s parameters on this trainer) and the remote gradients
        together by their global 2-norm; returns the norm.

        The norm covers the (averaged) local gradients and the remote gradients of every
        trainer's context, summed per parameter: the update this step applies. Every trainer
        gets the same norm and scales its own gradients (local, and remote on their owners).
        """
        local_sq = math.fsum(_remote.sq_norm(p.grad) for p in local if p.grad is not None)
        remote = self._clips_remote(optimizer)
        total = math.sqrt(local_sq + (self._remote_grad_sq_norm() if remote else 0.0))
        coef = min(max_norm / (total + 1e-6), 1.0)
        if coef < 1.0:
            with torch.no_grad():
                for p in local:
                    if p.grad is not None:
                        p.grad.mul_(coef)
            if remote:
                self._on_remote_owners(_remote.scale_grads, coef)
        return total

    def clip_by_value(self, optimizer: Any, local: list[Tensor], clip_value: float) -> None:
        """Clamp ``local`` gradients and this trainer's remote ones to ``[-clip_value,
        clip_value]``; the remote ones carry the step's loss scale, so their bound does too."""
        torch.nn.utils.clip_grad_value_(local, clip_value)
        if self._clips_remote(optimizer):
            self._on_remote_owners(_remote.clamp_grads, clip_value * self.loss_scale)

    def _clips_remote(self, optimizer: Any) -> bool:
        return self.updates_remote(optimizer) and self.context_id is not None

    def _remote_grad_sq_norm(self) -> float:
        """The squared norm of the summed remote gradients of every trainer's context (a
        collective over the trainers)."""
        collectives = self._collectives
        context_ids = collectives.allgather_object(self.context_id)
        total = None
        if collectives.rank == 0:
            total = math.fsum(
                call_all((server, _remote.grad_sq_norm, (context_ids,)) for server in self._servers)
            )
        return collectives.broadcast(total, 0)

    def _on_remote_owners(self, func: Callable, *args: Any) -> None:
        """Run ``func(context_id, *args)`` on every owner of remote parameters."""
        owners = {o.owner().id for o in self.optimizer.remote_optimizers}
        call_all((owner, func, (self.context_id, *args)) for owner in sorted(owners))
