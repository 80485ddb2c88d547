"""Operator requests: their callee runs their backward as one native call, with no graph.

A torch operator's request and its response enclose its whole graph on the callee
(recv -> operator -> send), so the callee's part of a pass is one native call from the
send's children to the recv's inputs. Each test compares gradients with plain local autograd
on the same values, and counts the graph nodes the callee's passes analysed.
"""

from __future__ import annotations

import pytest
import torch
from _dist_utils import assert_grads_match, exchange, local_grads

import lightning_distgrad.autograd as dist_autograd
from lightning_distgrad import rpc
from lightning_distgrad.autograd import _pass
from lightning_distgrad.rpc._transport import message_log

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture
def graph_nodes(monkeypatch) -> list[int]:
    """The node count of every local graph a pass analyses on this rank, in order."""
    counts: list[int] = []

    class Counted(_pass.Graph):
        def __init__(self, starts, recvs):
            super().__init__(starts, recvs)
            counts.append(len(self.children))

    monkeypatch.setattr(_pass, "Graph", Counted)
    return counts


def py_scale(t, factor):
    return t * factor


def _first_of_split(t1, t2):
    return torch.split(t1 * t2, 1)[0].sum()


CASES = {
    # name: (operator, args from (t1, t2), local loss from (t1, t2) and the result)
    "add": (torch.add, lambda a, b: (a, b), lambda a, b, r: (r * a).sum()),
    "mul": (torch.mul, lambda a, b: (a, b), lambda a, b, r: (r * b).sum()),
    # the result is the received tensor itself: no node between the send and the recv
    "identity": (torch.conj, lambda a, b: (a,), lambda a, b, r: (r * b).sum()),
    # several results, one unused
    "split": (torch.split, lambda a, b: (a * b, 1), lambda a, b, r: (r[0] * 2 + r[2]).sum()),
    # a namedtuple with a result that carries no gradient (the indices)
    "max": (torch.max, lambda a, b: (a * b, 0), lambda a, b, r: (r.values * r.indices).sum()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_operator_gradients_match_local_and_the_callee_builds_no_graph(
    rpc_world, graph_nodes, case
):
    op, args, loss_of = CASES[case]
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    peer = rpc_world.peer()
    with dist_autograd.context() as context_id:
        result = rpc.rpc_sync(peer, op, args(t1, t2))
        dist_autograd.backward(context_id, [loss_of(t1, t2, result)])
        grads = dist_autograd.get_gradients(context_id)
        ids = exchange(rpc_world, context_id)
        # This rank was the callee of the rank before it: one operator send, linked to its
        # request's recv.
        callee = dist_autograd._retrieve_context(ids[rpc_world.peer_rank(-1)])
        assert len(callee.op_sends) == 1
        ((send_id, recv_id),) = callee.op_sends.items()
        assert send_id in callee._send_functions() and recv_id in callee._recv_functions()
        rpc_world.barrier()
    expected = local_grads(lambda ex, a, b: [loss_of(a, b, op(*args(a, b)))], t1, t2)
    assert_grads_match(grads, [t1, t2], expected)
    # Each rank analysed one graph, as the root (the loss down to the recv): as a callee it
    # ran the operator's backward alone.
    assert len(graph_nodes) == 1 and graph_nodes[0] > 0, graph_nodes


def test_operators_and_a_python_function_in_one_context(rpc_world, graph_nodes):
    """A callee with both kinds of sends: the function's graph is analysed, the operators'
    are not; gradients as local autograd's, over three passes with retain_graph."""
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    peer = rpc_world.peer()

    def loss_of(a, b, add, mul, scaled):
        return (add * mul + scaled).sum()

    with dist_autograd.context() as context_id:
        add = rpc.rpc_sync(peer, torch.add, (t1, t2))
        mul = rpc.rpc_sync(peer, torch.mul, (t1, t2))
        scaled = rpc.rpc_sync(peer, py_scale, (t1, 3.0))
        loss = loss_of(t1, t2, add, mul, scaled)
        dist_autograd.backward(context_id, [loss], retain_graph=True)
        dist_autograd.backward(context_id, [loss], retain_graph=True)
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
        rpc_world.barrier()
    expected = local_grads(lambda ex, a, b: [loss_of(a, b, a + b, a * b, py_scale(a, 3.0))], t1, t2)
    assert_grads_match(grads, [t1, t2], [3 * e for e in expected])
    # As the callee: three passes over the function's graph alone (send, MulBackward0, recv).
    callee = [n for n in graph_nodes if n <= 3]
    assert callee == [3, 3, 3], graph_nodes


def test_an_unused_operator_result_gets_no_gradient_and_fails_a_strict_pass(rpc_world):
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    peer = rpc_world.peer()
    with dist_autograd.context() as context_id:
        used = rpc.rpc_sync(peer, torch.mul, (t1, t2))
        rpc.rpc_sync(peer, torch.exp, (t2,))  # result dropped
        dist_autograd.backward(context_id, [used.sum()], retain_graph=True)
        grads = dist_autograd.get_gradients(context_id)
        expected = local_grads(lambda ex, a, b: [(a * b).sum()], t1, t2)
        assert_grads_match(grads, [t1, t2], expected)
        with pytest.raises(RuntimeError, match="got no gradient: autograd message"):
            dist_autograd.backward(context_id, [used.sum()], strict=True)
        rpc_world.barrier()


def detached_double(t):
    return t.detach() * 2


def test_a_callee_that_answers_operators_alone_leaves_its_other_requests_to_smart_mode(
    rpc_world, graph_nodes
):
    """The callee's only sends are an operator's: it answers without a pass, and the request
    whose result needs no gradient is settled as absent when the root probes it."""
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    peer = rpc_world.peer()
    with dist_autograd.context() as context_id:
        product = rpc.rpc_sync(peer, torch.mul, (t1, t2))
        doubled = rpc.rpc_sync(peer, detached_double, (t1,))
        assert not doubled.requires_grad
        dist_autograd.backward(context_id, [(product * doubled).sum()])
        grads = dist_autograd.get_gradients(context_id)
        rpc_world.barrier()
    expected = local_grads(lambda ex, a, b: [(a * b * (a.detach() * 2)).sum()], t1, t2)
    assert_grads_match(grads, [t1, t2], expected)
    assert len(graph_nodes) == 1, graph_nodes  # the root's only


def test_a_tensor_that_is_two_gradients_travels_once(rpc_world):
    """An addition gives its two inputs one gradient tensor: the callee's gradient message
    carries it once (counted in the frame's bytes), and the root's gradients are local
    autograd's, the two leaves' not aliased."""
    n = 8192  # 32 KiB a tensor: inline in its frame, so the frame's bytes count it
    t1, t2 = torch.rand(n, requires_grad=True), torch.rand(n, requires_grad=True)
    log = message_log.MessageLog()
    peer = rpc_world.peer()
    message_log.set_log(log)
    rpc_world.barrier()  # both ranks log before either sends
    try:
        with dist_autograd.context() as context_id:
            added = rpc.rpc_sync(peer, torch.add, (t1, t2))
            dist_autograd.backward(context_id, [(added * 3).sum()])
            grads = dist_autograd.get_gradients(context_id)
            rpc_world.barrier()
    finally:
        message_log.set_log(None)
    expected = local_grads(lambda ex, a, b: [((a + b) * 3).sum()], t1, t2)
    assert_grads_match(grads, [t1, t2], expected)
    assert grads[t1].data_ptr() != grads[t2].data_ptr()
    grads[t1].zero_()
    assert grads[t2].sum() > 0
    # This rank's gradient messages: as the root, the result's; as the callee, the two
    # inputs' in one tensor of 32 KiB (two would be 64 KiB).
    sizes = [e[5] for e in log.entries if e[0] == "send" and e[2] == "GRADIENTS"]
    assert len(sizes) == 2 and all(4 * n <= size < 8 * n for size in sizes), sizes
