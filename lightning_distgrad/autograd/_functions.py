"""Send and recv functions: the graph nodes an RPC leaves behind in the forward pass.

A *send* node is an identity node over the tensors a message carried; the
engine starts a native run at it when the peer ships their gradients back. A
*recv* node gives received tensors a ``grad_fn``; the engine stops native runs
at it and ships the gradients it collected to the sender. Neither backward
runs in a distributed pass; recv's raises if a plain local ``.backward()``
reaches it.
"""

from __future__ import annotations

import torch

from ..rpc._hooks import with_grad

# Gives recv outputs an autograd history; never receives a gradient.
_ANCHOR = torch.empty(0, requires_grad=True)


class SendRpcBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *tensors: torch.Tensor):
        return tuple([t.detach() for t in tensors])

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return grads


class RecvRpcBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor: torch.Tensor, tensors: list[torch.Tensor]):
        return tuple(tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        raise RuntimeError(
            "This graph contains tensors received over RPC; run its backward pass with "
            "lightning_distgrad.autograd.backward(context_id, [loss]) inside the "
            "distributed autograd context, not with loss.backward().")


def _native_apply(function: type[torch.autograd.Function]):
    """``function.apply`` minus its Python wrapper (functorch and ``setup_context``
    handling, which these functions do not use): 6 instead of 9 us per message."""
    return torch._C._FunctionBase.__dict__["apply"].__get__(None, function)


_send_apply = _native_apply(SendRpcBackward)
_recv_apply = _native_apply(RecvRpcBackward)


def record_send(tensors: list[torch.Tensor]):
    """The send node over ``tensors`` (all require grad).

    Recorded whatever the calling thread's grad mode (the caller decided that a
    send is due; a reply may leave from a thread inside ``torch.no_grad()``).
    """
    return with_grad(_send_apply, *tensors)[0].grad_fn


def record_recv(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], object]:
    """Give ``tensors`` one shared recv node; returns (tensors with history, node)."""
    outs = with_grad(_recv_apply, _ANCHOR, tensors)
    return list(outs), outs[0].grad_fn
