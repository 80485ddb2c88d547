"""Where the complete gradients of a pass's leaves go: into the context, or through DDP.

torch's distributed engine never runs a leaf's AccumulateGrad node: it adds the leaf's gradient
to the context and runs the node's post-hooks, C++ and Python, with torch's distributed context
current (``DistAccumulateGradCaptureHook`` in torch/csrc/distributed/autograd/engine/
dist_engine.cpp). DDP's reducer is such a C++ post-hook: with that context current, it averages
the context's gradient over DDP's process group once every bucket of its parameters is in.

A leaf here gets the same treatment: its gradient goes to the context and its Python post-hooks
run. The one C++ post-hook torch code installs on leaves, DDP's, cannot be seen or called from
Python, so a parameter of a DDP module (:mod:`._wrappers`) goes through its real AccumulateGrad
node instead, in one native backward call for the DDP parameters of a delivery: its ``.grad`` is
set to its gradient in the context so far, and the node adds this pass's gradient and runs its
pre- and post-hooks. The reducer copies ``.grad`` into its buckets, allreduces each full bucket,
and, at the end of the native call that completes the last one (its finalize is a
``queue_callback``), writes the averages back to ``.grad``. When the pass ends on this worker,
each such ``.grad`` goes to the context and the parameter gets its own ``.grad`` back: ``.grad``
ends as torch's distributed autograd leaves it, untouched.

What cannot be honoured raises: post-accumulate-grad hooks (they run when AccumulateGrad writes
``.grad``, which torch's distributed engine never does, so torch skips them silently), and DDP's
``static_graph`` and delayed allreduce, which rely on the local backward running as one call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from .._compat import node_post_hooks, post_accumulate_grad_hooks, tensor_hooks
from ._context import DistAutogradContext
from ._wrappers import reducer_owners


class _RunAccumulateGrad(torch.autograd.Function):
    """Gives ``grads`` to the AccumulateGrad nodes of its inputs, the leaves, when its output's
    backward runs; None reaches a node as an undefined gradient, as in torch's engine."""

    @staticmethod
    def forward(ctx: Any, grads: list, *leaves: torch.Tensor) -> torch.Tensor:
        ctx.grads = grads
        return torch.zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple:
        return (None, *ctx.grads)


def _refuse_post_accumulate_grad_hooks(leaf: torch.Tensor) -> None:
    if post_accumulate_grad_hooks(leaf):
        raise RuntimeError(
            f"A leaf tensor of shape {tuple(leaf.shape)} that got a gradient in this "
            "distributed backward pass has a post-accumulate-grad hook "
            "(Tensor.register_post_accumulate_grad_hook). Such a hook runs when AccumulateGrad "
            "writes .grad, which a distributed backward pass never does: the gradient goes to "
            "the distributed autograd context (torch's distributed autograd skips these hooks "
            "without a word; DDP under compiled autograd installs them too). Remove the hook "
            "for distributed passes and act on dist_autograd.get_gradients(context_id) after "
            "the backward call, or use Tensor.register_hook, which sees each gradient."
        )


def _refuse_unreducible(ddp: DistributedDataParallel, delayed: bool) -> None:
    if delayed:
        raise RuntimeError(
            "DistributedDataParallel(delay_all_reduce_named_params=...) cannot average "
            "gradients of a distributed backward pass: it allreduces a buffer that the "
            "parameters' .grad are views of, and a distributed backward pass writes the "
            "distributed autograd context, not .grad. Construct DDP without "
            "delay_all_reduce_named_params."
        )
    if ddp.static_graph:
        raise RuntimeError(
            "DistributedDataParallel(static_graph=True) cannot average gradients of a "
            "distributed backward pass: it schedules its first allreduce for the end of the "
            "local backward call that reaches its output, and a distributed backward pass runs "
            "the local graph in several calls, the parameters' gradients in a later one. "
            "Construct DDP with static_graph=False (the default); find_unused_parameters=True "
            "covers graphs that change between iterations."
        )


class LeafGradients:
    """The complete leaf gradients of one pass on this worker, handed to ``ctx``.

    Example::

        >>> # xdoctest: +SKIP
        >>> leaves = LeafGradients(ctx)
        >>> leaves.add([(weight_node, grad), (bias_node, None)])  # None: reached, no gradient
        >>> leaves.close()  # when the pass ends here: DDP-averaged gradients into ctx
    """

    def __init__(self, ctx: DistAutogradContext):
        self.ctx = ctx
        # id(leaf) -> (leaf, its own .grad) for leaves whose .grad holds their gradient
        # until close().
        self.own_grads: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def add(self, leaf_grads: list[tuple[Any, torch.Tensor | None]]) -> None:
        """Hand over ``(AccumulateGrad node, gradient or None)`` pairs, each leaf once a pass;
        None: the pass reached the leaf but gave it no gradient."""
        owners = reducer_owners()
        plain, reduced = [], []
        for node, grad in leaf_grads:
            leaf = node.variable
            if grad is not None:
                _refuse_post_accumulate_grad_hooks(leaf)
            owner = owners.get(id(leaf)) if owners else None
            if owner is not None:
                _refuse_unreducible(*owner)
                reduced.append((node, grad))
            elif grad is not None:
                plain.append((node, grad))
        if plain:
            self._accumulate(plain)
        if reduced:
            self._through_accumulate_grad(reduced)

    def _accumulate(self, leaf_grads: list[tuple[Any, torch.Tensor]]) -> None:
        """Add to the context, then run the nodes' post-hooks as torch's engine does: with no
        outputs and the node's input gradient."""
        self.ctx.accumulate([(node.variable, grad) for node, grad in leaf_grads])
        for node, grad in leaf_grads:
            for hook in node_post_hooks(node).values():
                hook((), (grad,))

    def _through_accumulate_grad(self, leaf_grads: list[tuple[Any, torch.Tensor | None]]) -> None:
        """Run the leaves' AccumulateGrad nodes in one native call (see the module's doc)."""
        leaves = [node.variable for node, _ in leaf_grads]
        so_far = self.ctx.take_gradients(leaves)
        held = []
        for leaf, grad in zip(leaves, so_far, strict=True):
            if id(leaf) not in self.own_grads:
                self.own_grads[id(leaf)] = (leaf, leaf.grad)
            leaf.grad = grad
            hooks = tensor_hooks(leaf)
            if hooks:  # they ran on this gradient already
                held.append((hooks, dict(hooks)))
                hooks.clear()
        try:
            with torch.enable_grad():
                out = _RunAccumulateGrad.apply([g for _, g in leaf_grads], *leaves)
            torch.autograd.backward(out)
        finally:
            for hooks, saved in held:
                hooks.update(saved)

    def close(self) -> None:
        """The pass ended here: the gradients held in ``.grad`` go to the context, and each
        leaf gets its own ``.grad`` back."""
        pairs = []
        for leaf, own in self.own_grads.values():
            pairs.append((leaf, leaf.grad))
            leaf.grad = own
        self.own_grads.clear()
        self.ctx.set_gradients(pairs)
