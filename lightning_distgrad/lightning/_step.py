"""One optimisation step of the distgrad strategy: its distributed autograd context and updates.

A step's forward and backward passes (all batches of an accumulation window) run in one
distributed autograd context. :class:`DistributedStep` owns that context, copies what is new
among the context's local gradients to ``.grad`` (so Lightning's hooks and the user's optimizer
see them), and updates the remote parameters with a
:class:`~lightning_distgrad.optim.DistributedOptimizer` that mirrors the user's first optimizer
(its class, and the hyper-parameters of its first param group, pushed whenever they change).
It also does the remote half of gradient clipping, on the owners of the remote parameters.
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
        self, optimizer: torch.optim.Optimizer, remote_modules: list[tuple[str, RemoteModule]]
    ) -> None:
        """A DistributedOptimizer of ``optimizer``'s class and first param group's settings
        over the remote modules' parameters."""
        hparams = hyperparameters(optimizer)
        rrefs = [r for _, module in remote_modules for r in module.remote_parameters()]
        self.optimizer = DistributedOptimizer(type(optimizer), rrefs, **hparams)
        self._pushed = copy.deepcopy(hparams)

    def drop_optimizer(self) -> None:
        self.optimizer, self._pushed = None, None

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

    # --- the remote half of gradient clipping ----------------------------------------------------

    def remote_grad_sq_norm(self, collectives: TrainerCollectives, servers: list[int]) -> float:
        """The squared norm of the summed remote gradients of every trainer's context (a
        collective over the trainers)."""
        context_ids = collectives.allgather_object(self.context_id)
        total = None
        if collectives.rank == 0:
            total = math.fsum(
                call_all((server, _remote.grad_sq_norm, (context_ids,)) for server in servers)
            )
        return collectives.broadcast(total, 0)

    def on_remote_owners(self, func: Callable, *args: Any) -> None:
        """Run ``func(context_id, *args)`` on every owner of remote parameters."""
        owners = {o.owner().id for o in self.optimizer.remote_optimizers}
        call_all((owner, func, (self.context_id, *args)) for owner in sorted(owners))
