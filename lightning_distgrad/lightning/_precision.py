"""The precision plugins of the distgrad strategy: Lightning's, with clipping across ranks.

Lightning clips gradients in the precision plugin (``clip_grad_by_norm``/``by_value`` over the
optimizer's ``.grad``). Under the strategy part of the gradients live in distributed autograd
contexts on the serving ranks, so these plugins hand clipping to the step that owns them
(``_step.DistributedStep``). Only
``"32-true"`` and ``"bf16-mixed"`` are supported: a gradient scaler (``"16-mixed"``) would wrap
the optimizer step the strategy runs itself, and ``"*-true"`` low precisions would have to
convert the remote modules too.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision import MixedPrecision, Precision

from ._step import DistributedStep

__all__ = ["DistGradClipping", "DistGradPrecision", "adopt_precision"]


class DistGradClipping:
    """Routes Lightning's gradient clipping to the step (local and remote gradients)."""

    _step: DistributedStep

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        self._step.clip_by_norm(optimizer, list(self.main_params(optimizer)), clip_val)

    def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        self._step.clip_by_value(optimizer, list(self.main_params(optimizer)), clip_val)


class DistGradPrecision(DistGradClipping, Precision):
    """``precision="32-true"`` under the distgrad strategy."""

    def __init__(self, step: DistributedStep) -> None:
        super().__init__()
        self._step = step


class DistGradMixedPrecision(DistGradClipping, MixedPrecision):
    """``precision="bf16-mixed"`` under the distgrad strategy (autocast on the servers too)."""

    def __init__(self, device: str, step: DistributedStep) -> None:
        super().__init__("bf16-mixed", device)
        self._step = step


def adopt_precision(plugin: Precision | None, step: DistributedStep) -> Precision | None:
    """The strategy's version of the plugin the Trainer chose, clipping through ``step``;
    ValueError if unsupported."""
    if plugin is None or isinstance(plugin, DistGradClipping):
        if plugin is not None:
            plugin._step = step
        return plugin
    if type(plugin) is Precision:
        return DistGradPrecision(step)
    if type(plugin) is MixedPrecision and plugin.precision == "bf16-mixed":
        return DistGradMixedPrecision(plugin.device, step)
    precision = getattr(plugin, "precision", type(plugin).__name__)
    raise ValueError(
        f"DistAutogradStrategy supports precision='32-true' and 'bf16-mixed', but the Trainer"
        f" asks for precision={precision!r} ({type(plugin).__name__}). HINT: use"
        " `Trainer(precision='bf16-mixed')` for mixed precision (no gradient scaler is needed),"
        " or `precision='32-true'`."
    )
