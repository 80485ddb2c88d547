"""One optimisation step of the distgrad strategy: its distributed autograd context and updates.

A step's forward and backward passes (all batches of an accumulation window) run in one
distributed autograd context. :class:`DistributedStep` owns that context, copies what is new
among the context's local gradients to ``.grad`` (so Lightning's hooks and the user's optimizer
see them), and updates the remote parameters with a
:class:`~lightning_distgrad.optim.DistributedOptimizer` that mirrors the user's first optimizer
(its class, and the hyper-parameters of its first param group, pushed whenever they change).
It also clips the step's gradients, local and remote, since it owns the remote gradients and
can compute their norm across trainers (the precision plugins hand clipping to it).

Shared (``sync_remote_updates=True``), all trainers hold one remote optimizer, which steps once
per step on the sum of the trainers' contexts, as DDP's optimizer steps once on the averaged
``.grad``: every ``torch.optim`` optimizer, weight decay and clipping then give DDP's numbers.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Generator, Iterable
from typing import Any

import torch
from torch import Tensor

from .. import autograd as dist_autograd
from ..nn import RemoteModule, ReplicatedModule
from ..optim import DistributedOptimizer
from ..rpc._internal import call_all
from . import _remote
from ._collectives import TrainerCollectives
from ._model import constructor_arguments, hyperparameters, same_hyperparameters

__all__ = ["DistributedStep"]


class DistributedStep:
    """The distributed state of the current optimisation step, and the remote optimizer.

    ``loss_scale`` multiplies each backward pass's root: ``1/num_trainers`` with remote modules,
    so that every trainer's context holds its share of the mean gradient; local gradients are
    unscaled again when copied to ``.grad``. ``shared``: one remote optimizer for all trainers,
    stepped once a step on the sum of their contexts (else one per trainer, each stepped on its
    own context: trainers run ahead, Hogwild-style).
    """

    def __init__(self) -> None:
        self.context: dist_autograd.context | None = None
        self.context_id: int | None = None
        self.loss_scale = 1.0
        self.shared = True
        self.optimizer: DistributedOptimizer | None = None  # over the remote parameters
        self._driver: torch.optim.Optimizer | None = None  # the user's, which it mirrors
        self._collectives: TrainerCollectives | None = None
        self._servers: tuple[int, ...] = ()
        self._seen: dict[Tensor, Tensor] = {}  # context gradients already added to .grad
        self._pushed: dict[str, Any] | None = None  # hyper-parameters the remote side has
        self._steps = 0
        # The remote gradients' clipping asked for this step (reset with the context), applied
        # at the step.
        self._clips: list[_remote.Clip] = []

    # --- the context ---------------------------------------------------------------------------

    def open(self) -> None:
        """Open a new context (closing one still open)."""
        if self.context is not None:
            self.close()
        context = dist_autograd.context()
        self.context_id = context.__enter__()
        self.context = context
        self._forget_step()

    def close(self) -> None:
        """Release the context, here and on every worker it reached (nothing if none is open)."""
        context, self.context, self.context_id = self.context, None, None
        self._forget_step()
        if context is not None:
            context.__exit__(None, None, None)

    def _forget_step(self) -> None:
        self._seen, self._clips = {}, []

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
        trainers: tuple[int, ...],
        servers: tuple[int, ...],
    ) -> None:
        """A DistributedOptimizer of ``optimizer``'s class and first param group's settings
        over the remote modules' parameters (held by ``servers``); ``collectives``: the
        trainers' (ranks ``trainers``). With :attr:`shared`, trainer 0 builds it and every
        trainer gets the same one (a collective over the trainers)."""
        hparams = hyperparameters(optimizer)
        rrefs = [r for _, module in remote_modules for r in module.remote_parameters()]

        def build() -> DistributedOptimizer:
            kwargs = constructor_arguments(type(optimizer), hparams)
            return DistributedOptimizer(type(optimizer), rrefs, **kwargs)

        self.optimizer = _remote.share(collectives, trainers, build) if self.shared else build()
        self._steps = 0  # shared: numbers the steps alike on every trainer
        self._pushed = None  # the first step pushes what the constructor did not take
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
        """Step the remote parameters, clipped as this step's clipping asked.

        Shared (every trainer calls it, as DDP's step): each owner steps the one remote
        optimizer once every trainer's part of the step has arrived, on the sum of their
        contexts (the mean gradient); each trainer's call returns after that step, so its
        context stays open until the step has read it and its next forward pass reads the
        result. Otherwise this trainer's own optimizer steps on its own context.
        """
        clips, owners = list(self._clips), self.optimizer.remote_optimizers
        if not self.shared:
            self._push_hyperparameters(optimizer)
            call_all(
                (o.owner(), _remote.step_on_own_context, (o, self.context_id, clips))
                for o in owners
            )
            return
        trainer, num_trainers = self._collectives.rank, self._collectives.size
        if trainer == 0:  # before its part of the step, so before the step
            self._push_hyperparameters(optimizer)
        self._steps += 1
        call_all(
            (
                o.owner(),
                _remote.step_shared,
                (o, self._steps, trainer, num_trainers, self.context_id, clips),
            )
            for o in owners
        )

    def _push_hyperparameters(self, optimizer: torch.optim.Optimizer) -> None:
        """Send the user's optimizer's values to the remote optimizer if they changed."""
        hparams = hyperparameters(optimizer)
        if self._pushed is None or not same_hyperparameters(hparams, self._pushed):
            call_all(
                (o.owner(), _remote.set_hyperparameters, (o, hparams))
                for o in self.optimizer.remote_optimizers
            )
            self._pushed = copy.deepcopy(hparams)

    # --- gradient clipping over local and remote parameters ------------------------------------

    def clip_by_norm(self, optimizer: Any, local: list[Tensor], max_norm: float) -> float:
        """Clip ``local`` (``optimizer``'s parameters on this trainer) and the remote gradients
        together by their global 2-norm; returns the norm.

        The norm covers the (averaged) local gradients and the remote gradients of every
        trainer's context, summed per parameter: the update this step applies. Every trainer
        gets the same norm and scales its local gradients; the remote ones are scaled at the
        step.
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
                self._clips.append(("scale", coef))
        return total

    def clip_by_value(self, optimizer: Any, local: list[Tensor], clip_value: float) -> None:
        """Clamp ``local`` gradients and, at the step, the remote ones to ``[-clip_value,
        clip_value]``: shared, the trainers' summed (mean) gradient, as DDP clamps its averaged
        ``.grad``; otherwise this trainer's contribution, which carries the step's loss scale,
        so its bound does too."""
        torch.nn.utils.clip_grad_value_(local, clip_value)
        if self._clips_remote(optimizer):
            bound = clip_value if self.shared else clip_value * self.loss_scale
            self._clips.append(("clamp", bound))

    def _clips_remote(self, optimizer: Any) -> bool:
        return self.updates_remote(optimizer) and self.context_id is not None

    def _remote_grad_sq_norm(self) -> float:
        """The squared norm of the summed remote gradients of every trainer's context (with
        the clipping already asked for this step, when shared). A collective over the
        trainers, which leave it once trainer 0 has the norm; if asking the owners failed
        there, every trainer raises."""
        collectives = self._collectives
        context_ids = collectives.gather_object(self.context_id, root=0)
        clips = list(self._clips) if self.shared else []
        total, failure = None, None
        if collectives.rank == 0:
            try:
                total = math.fsum(
                    call_all(
                        (server, _remote.grad_sq_norm, (context_ids, clips))
                        for server in self._servers
                    )
                )
            except Exception as error:
                failure = error
        described = None if failure is None else f"{type(failure).__name__}: {failure}"
        total, described = collectives.broadcast((total, described), 0)
        if failure is not None:
            raise failure
        if described is not None:
            raise RuntimeError(
                f"DistAutogradStrategy: the remote gradients' norm failed on trainer 0: {described}"
            )
        return total
