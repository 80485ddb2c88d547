"""The one-way messages of distributed autograd (bodies of their frame kinds)."""

from __future__ import annotations

from typing import Any, NamedTuple


class Gradients(NamedTuple):
    """GRADIENTS: gradients for sends recorded on the receiver, in a backward pass.

    ``layout`` gives each message id and how many of the gradients are its own; ``order``
    the frame tensor of each gradient when one tensor is several gradients (None: each
    gradient is the next tensor); ``report`` is the sender's unused sends when the
    receiver is the root.
    """

    context_id: int
    layout: list
    retain_graph: bool
    pass_id: tuple
    credit: Any
    report: tuple | None
    order: tuple | None


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


def encode_gradients(items: list[tuple[int, list | None]]) -> tuple[list, list, tuple | None]:
    """(layout, tensors, order) of a GRADIENTS frame for ``(message id, gradients)`` items.

    A layout entry is ``(message id, count)`` when all ``count`` gradients are
    present, ``(message id, count, present indices)`` when some are absent, and
    ``(message id, 0, None)`` when all are. A tensor that is several gradients (the two
    inputs of an addition get one) travels once: ``order`` then gives each present
    gradient's index among ``tensors``.

    Example::

        >>> import torch
        >>> g = torch.ones(2)
        >>> layout, tensors, order = encode_gradients([(7, [g, g]), (8, None)])
        >>> layout, len(tensors), order
        ([(7, 2), (8, 0, None)], 1, (0, 0))
    """
    layout, tensors = [], []
    for msg_id, grads in items:
        if grads is None:
            layout.append((msg_id, 0, None))
            continue
        present = [g for g in grads if g is not None]
        if len(present) == len(grads):
            layout.append((msg_id, len(grads)))
        else:
            layout.append(
                (msg_id, len(grads), tuple(i for i, g in enumerate(grads) if g is not None))
            )
        tensors.extend(present)
    index: dict[int, int] = {}
    order = tuple(index.setdefault(id(t), len(index)) for t in tensors)
    if len(index) == len(tensors):
        return layout, tensors, None
    return layout, list({id(t): t for t in tensors}.values()), order


def decode_gradients(
    layout: list, tensors: list, order: tuple | None = None
) -> list[tuple[int, list | None]]:
    """The items :func:`encode_gradients` made ``(layout, tensors, order)`` of."""
    if order is not None:
        tensors = [tensors[i] for i in order]
    items: list[tuple[int, list | None]] = []
    start = 0
    for entry in layout:
        msg_id, count = entry[0], entry[1]
        if len(entry) == 2:
            items.append((msg_id, tensors[start : start + count]))
            start += count
        elif entry[2] is None:
            items.append((msg_id, None))
        else:
            grads: list = [None] * count
            for i in entry[2]:
                grads[i] = tensors[start]
                start += 1
            items.append((msg_id, grads))
    return items
