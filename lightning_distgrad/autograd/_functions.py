"""Send and recv functions: the graph nodes an RPC leaves behind in the forward pass.

A *send* node is an identity node over the tensors a message carried; the
engine hands the gradients its peer ships back straight to the send node's
children. A *recv* node gives received tensors a ``grad_fn``; the engine stops
native runs at it and ships the gradients it collected to the sender. Neither
node is ever run by PyTorch's engine in a distributed pass, so both are
torch's native error nodes (:data:`~lightning_distgrad._compat.DelayedError`):
recording one, on every RPC that carries tensors requiring grad, runs no Python
code of a ``torch.autograd.Function``, and a plain local ``.backward()`` that
reaches one raises their message.
"""

from __future__ import annotations

import torch

from .._compat import DelayedError
from ..rpc._internal import with_grad

_SEND_MESSAGE = (
    "The send function of an RPC ran in a local backward pass; run the backward "
    "pass with lightning_distgrad.autograd.backward(context_id, [loss])."
)
_RECV_MESSAGE = (
    "This graph contains tensors received over RPC; run its backward pass with "
    "lightning_distgrad.autograd.backward(context_id, [loss]) inside the "
    "distributed autograd context, not with loss.backward()."
)

# Gives recv outputs an autograd history; never receives a gradient. It goes last,
# so the node's gradient slot i is received tensor i's.
_ANCHOR = torch.empty(0, requires_grad=True)


def _error_node_outputs(message: str, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    outs = with_grad(DelayedError(message, len(tensors)), *tensors)
    return (outs,) if isinstance(outs, torch.Tensor) else outs  # one output comes bare


def record_send(tensors: list[torch.Tensor]):
    """The send node over ``tensors`` (all require grad).

    Recorded whatever the calling thread's grad mode (the caller decided that a
    send is due; a reply may leave from a thread inside ``torch.no_grad()``).
    """
    return _error_node_outputs(_SEND_MESSAGE, tensors)[0].grad_fn


def record_recv(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], object]:
    """Give ``tensors`` one shared recv node; returns (tensors with history, node).

    The outputs share the received tensors' storage.
    """
    outs = _error_node_outputs(_RECV_MESSAGE, [*tensors, _ANCHOR])
    return list(outs[:-1]), outs[-1].grad_fn
