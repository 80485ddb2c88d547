"""The precision plugins of the distgrad strategy: Lightning's, with clipping across ranks.

Lightning clips gradients in the precision plugin (``clip_grad_by_norm``/``by_value`` over the
optimizer's ``.grad``). Under the strategy part of the gradients live in distributed autograd
contexts on the serving ranks, so these plugins hand clipping to the strategy. Only
``"32-true"`` and ``"bf16-mixed"`` are supported: a gradient scaler (``"16-mixed"``) would wrap
the optimizer step the strategy runs itself, and ``"*-true"`` low precisions would have to
convert the remote modules too.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

from . import _remote

if TYPE_CHECKING:
    from .strategy import DistAutogradStrategy

__all__ = [
    "DistGradClipping",
    "DistGradPrecision",
    "adopt_precision",
    "clip_by_norm",
    "clip_by_value",
]


class DistGradClipping:
    """Routes Lightning's gradient clipping to the strategy (local and remote gradients)."""

    _strategy: DistAutogradStrategy

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        self._strategy.clip_gradients_by_norm(optimizer, clip_val)

    def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        self._strategy.clip_gradients_by_value(optimizer, clip_val)


class DistGradPrecision(DistGradClipping, Precision):
    """``precision="32-true"`` under the distgrad strategy."""

    def __init__(self, strategy: DistAutogradStrategy) -> None:
        super().__init__()
        self._strategy = strategy


class DistGradMixedPrecision(DistGradClipping, MixedPrecision):
    """``precision="bf16-mixed"`` under the distgrad strategy (autocast on the servers too)."""

    def __init__(self, device: str, strategy: DistAutogradStrategy) -> None:
        super().__init__("bf16-mixed", device)
        self._strategy = strategy


def adopt_precision(plugin: Precision | None, strategy: DistAutogradStrategy) -> Precision | None:
    """The strategy's version of the plugin the Trainer chose; ValueError if unsupported."""
    if plugin is None or isinstance(plugin, DistGradClipping):
        if plugin is not None:
            plugin._strategy = strategy
        return plugin
    if type(plugin) is Precision:
        return DistGradPrecision(strategy)
    if type(plugin) is MixedPrecision and plugin.precision == "bf16-mixed":
        return DistGradMixedPrecision(plugin.device, strategy)
    precision = getattr(plugin, "precision", type(plugin).__name__)
    raise ValueError(
        f"DistAutogradStrategy supports precision='32-true' and 'bf16-mixed', but the Trainer"
        f" asks for precision={precision!r} ({type(plugin).__name__}). HINT: use"
        " `Trainer(precision='bf16-mixed')` for mixed precision (no gradient scaler is needed),"
        " or `precision='32-true'`."
    )


# --- Clipping across ranks -----------------------------------------------------------------------


def clip_by_norm(strategy: DistAutogradStrategy, optimizer: Any, max_norm: float) -> float:
    """Clip local and remote gradients together by their global 2-norm; returns the norm.

    The norm covers the (averaged) local gradients and the remote gradients of every trainer's
    context, summed per parameter: the update this step applies. Every trainer gets the same
    norm and scales its own gradients (local, and remote on their owners).
    """
    step = strategy._step
    local = list(strategy.precision_plugin.main_params(optimizer))
    local_sq = math.fsum(_remote.sq_norm(p.grad) for p in local if p.grad is not None)
    remote = strategy._updates_remote(optimizer) and step.context_id is not None
    remote_sq = (
        step.remote_grad_sq_norm(strategy._collectives, strategy.roles.servers) if remote else 0.0
    )
    total = math.sqrt(local_sq + remote_sq)
    coef = min(max_norm / (total + 1e-6), 1.0)
    if coef < 1.0:
        with torch.no_grad():
            for p in local:
                if p.grad is not None:
                    p.grad.mul_(coef)
        if remote:
            step.on_remote_owners(_remote.scale_grads, coef)
    return total


def clip_by_value(strategy: DistAutogradStrategy, optimizer: Any, clip_value: float) -> None:
    """Clamp local and (this trainer's) remote gradients to ``[-clip_value, clip_value]``; the
    remote ones carry the step's loss scale, so their bound does too."""
    step = strategy._step
    torch.nn.utils.clip_grad_value_(strategy.precision_plugin.main_params(optimizer), clip_value)
    if strategy._updates_remote(optimizer) and step.context_id is not None:
        step.on_remote_owners(_remote.clamp_grads, clip_value * step.loss_scale)
