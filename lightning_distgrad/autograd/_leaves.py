"""Where the complete gradients of a pass's leaves go: into the context, or through DDP.

torch's distributed engine never runs a leaf's AccumulateGrad node: it adds the leaf's gradient
to the context and runs the node's post-hooks, C++ and Python, with torch's distributed context
current (``DistAccumulateGradCaptureHook`` in torch/csrc/distributed/autograd/engine/
dist_engine.cpp). DDP's reducer is such a C++ post-hook: with that context current, it averages
the context's gradient over DDP's process group once every bucket of its parameters is in.

A leaf here gets the same treatment: its Python pre-hooks run, its gradient goes to the context
and its Python post-hooks run. The one C++ post-hook torch code installs on leaves, DDP's,
cannot be seen or called from Python, so the parameters of a DDP module (:mod:`._wrappers`) go
through their real AccumulateGrad nodes instead, all in one native backward call when the pass
ends on this worker (:meth:`LeafGradients.finish`): the gradients of all the module's parameters
move from the context to their ``.grad``, each node runs its pre-hooks, adds this pass's gradient
and runs its post-hooks, and the reducer copies ``.grad`` into its buckets, allreduces them, and,
at the end of that call (its finalize is a ``queue_callback``), writes the averages to the
``.grad`` of every parameter used on some rank, as in a local backward pass. The ``.grad`` go
back to the context and each parameter gets its own ``.grad`` back: it ends as torch's
distributed autograd leaves it, untouched. (torch's own engine fails an internal assertion where
DDP writes a parameter that has no gradient in the context, as with
``find_unused_parameters=True`` and a parameter unused on some rank; here DDP's contract holds.)

Why at the end, not as the parameters' gradients arrive (torch overlaps the allreduces with the
rest of the backward pass): the reducer's finalize waits for the other replicas' allreduces, and a
delivery may run on the thread that polls MPI for this worker, which the replicas' passes need.

What cannot be honoured raises: post-accumulate-grad hooks (they run when AccumulateGrad writes
``.grad``, which torch's distributed engine never does, so torch skips them silently), and DDP's
``static_graph`` and delayed allreduce, which rely on the local backward being one native call
that writes ``.grad``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from .._compat import node_post_hooks, node_pre_hooks, post_accumulate_grad_hooks, tensor_hooks
from ._context import DistAutogradContext
from ._wrappers import reduced_parameters, reducer_owners


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
            "native backward call that reaches its output, and a distributed backward pass "
            "runs the local graph in several such calls and gives DDP the parameters' "
            "gradients in a later one. Construct DDP with static_graph=False (the default); "
            "find_unused_parameters=True covers graphs that change between iterations."
        )


class LeafGradients:
    """The complete leaf gradients of one pass on this worker, handed to ``ctx``.

    Example::

        >>> # xdoctest: +SKIP
        >>> leaves = LeafGradients(ctx)
        >>> leaves.add([(weight_node, grad), (bias_node, None)])  # None: reached, no gradient
        >>> leaves.finish()  # the pass ended here: DDP-averaged gradients into ctx
    """

    def __init__(self, ctx: DistAutogradContext):
        self.ctx = ctx
        # (AccumulateGrad node, gradient or None, its DDP module) for the parameters of DDP
        # modules, until finish().
        self.reduced: list[tuple[Any, torch.Tensor | None, DistributedDataParallel]] = []

    def add(self, leaf_grads: list[tuple[Any, torch.Tensor | None]]) -> None:
        """Hand over ``(AccumulateGrad node, gradient or None)`` pairs, each leaf once a pass;
        None: the pass reached the leaf but gave it no gradient."""
        owners = reducer_owners()
        plain = []
        for node, grad in leaf_grads:
            leaf = node.variable
            if grad is not None:
                _refuse_post_accumulate_grad_hooks(leaf)
            owner = owners.get(id(leaf)) if owners else None
            if owner is not None:
                _refuse_unreducible(*owner)
                self.reduced.append((node, grad, owner[0]))
            elif grad is not None:
                plain.append((node, grad))
        if plain:
            self._accumulate(plain)

    def _accumulate(self, leaf_grads: list[tuple[Any, torch.Tensor]]) -> None:
        """As torch's engine does: run each node's pre-hooks on its gradient (a hook may return
        a new one), add the result to the context, then run the node's post-hooks with no
        outputs and that gradient."""
        leaf_grads = [(node, self._run_pre_hooks(node, grad)) for node, grad in leaf_grads]
        self.ctx.accumulate([(node.variable, g) for node, g in leaf_grads if g is not None])
        for node, grad in leaf_grads:
            for hook in node_post_hooks(node).values():
                hook((), (grad,))

    @staticmethod
    def _run_pre_hooks(node: Any, grad: torch.Tensor) -> torch.Tensor | None:
        for hook in node_pre_hooks(node).values():
            result = hook((grad,))
            if result is not None:
                (grad,) = result
        return grad

    @property
    def pending(self) -> bool:
        """Whether :meth:`finish` has DDP parameters to run (it may then wait for peers)."""
        return bool(self.reduced)

    def finish(self) -> None:
        """Run the DDP parameters' AccumulateGrad nodes (see the module's doc); call once the
        pass is over on this worker, on a thread that does not poll MPI."""
        reduced, self.reduced = self.reduced, []
        if not reduced:
            return
        ddps = list({id(ddp): ddp for _, _, ddp in reduced}.values())
        params = list({id(p): p for ddp in ddps for p in reduced_parameters(ddp)}.values())
        own = [p.grad for p in params]
        try:
            for param, grad in zip(params, self.ctx.take_gradients(params), strict=True):
                param.grad = grad
            self._run_accumulate_grad([(node, grad) for node, grad, _ in reduced])
        finally:
            self.ctx.set_gradients([(p, p.grad) for p in params])
            for param, grad in zip(params, own, strict=True):
                param.grad = grad

    @staticmethod
    def _run_accumulate_grad(leaf_grads: list[tuple[Any, torch.Tensor | None]]) -> None:
        """One native call that gives the leaves' AccumulateGrad nodes their gradients."""
        leaves = [node.variable for node, _ in leaf_grads]
        held = []
        for leaf in leaves:
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
