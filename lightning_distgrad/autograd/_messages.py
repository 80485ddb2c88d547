"""The one-way messages of distributed autograd (bodies of their frame kinds)."""

from __future__ import annotations

from typing import Any, NamedTuple


class Gradients(NamedTuple):
    """GRADIENTS: gradients for sends recorded on the receiver, in a backward pass.

    ``layout`` gives each message id and how many of the frame's tensors are its
    gradients; ``report`` is the sender's unused sends when the receiver is the root.
    """

    context_id: int
    layout: list
    retain_graph: bool
    pass_id: tuple
    credit: Any
    report: tuple | None


class CreditReturn(NamedTuple):
    """CREDIT: credit (and the sender's report or error text) back to a pass's root."""

    context_id: int
    pass_id: tuple
    credit: Any
    report: tuple | None
    error: str | None


class ContextRelease(NamedTuple):
    """CONTEXT_RELEASE: the sender released this context; release it here too."""

    context_id: int
