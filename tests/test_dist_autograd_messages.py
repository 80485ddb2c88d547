"""Gradient messages and the context they fill (serial): a tensor that is several gradients
travels once, and the leaves' gradients in a context never alias one another."""

from __future__ import annotations

import torch

from lightning_distgrad.autograd._context import DistAutogradContext
from lightning_distgrad.autograd._messages import decode_gradients, encode_gradients


def test_gradient_messages_encode_a_repeated_tensor_once():
    g, h = torch.ones(2), torch.zeros(3)
    items = [(7, [g, g]), (8, None), (9, [None, h, g])]
    layout, tensors, order = encode_gradients(items)
    assert len(tensors) == 2 and order == (0, 0, 1, 0)
    decoded = decode_gradients(layout, tensors, order)
    assert [m for m, _ in decoded] == [7, 8, 9] and decoded[1][1] is None
    assert decoded[0][1][0] is g and decoded[0][1][1] is g and decoded[2][1][1] is h
    assert decoded[2][1][0] is None and decoded[2][1][2] is g
    # Without repeats nothing changes: no order, each tensor once, in order.
    assert encode_gradients([(1, [g, h])]) == ([(1, 2)], [g, h], None)


def test_one_tensor_given_to_two_leaves_is_copied_in_one_call_or_two():
    """A gradient the context keeps for one leaf is copied for another, whether both come in
    one hand-over or the second later: an in-place change of one never reaches the other."""
    a, b, c, d = (torch.zeros(4, requires_grad=True) for _ in range(4))
    g, h = torch.ones(4), torch.full((4,), 2.0)
    ctx = DistAutogradContext(1)
    ctx.accumulate([(a, g)])  # used by one leaf: kept as it is
    ctx.accumulate([(b, g)])  # kept for ``a`` already: copied
    ctx.accumulate([(c, h), (d, h)])  # two leaves in one call: copied for each
    grads = ctx.gradients()
    assert grads[a] is g
    assert len({grads[t].data_ptr() for t in (a, b, c, d)}) == 4
    for t in (a, c):
        grads[t].mul_(5)
    assert torch.equal(grads[b], torch.ones(4)) and torch.equal(grads[d], torch.full((4,), 2.0))
