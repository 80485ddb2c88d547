"""SMART mode: RPCs whose results do not reach the roots take no part in the pass.

Every rank runs each test at once as its own root, over its neighbours
(``peer(1)``, ``peer(2)``; on 2 ranks ``peer(2)`` is the rank itself). Gradients
are compared with plain local autograd on the same values: leaves that local
autograd leaves without a gradient must be absent from ``get_gradients``.
"""

from __future__ import annotations

import threading

import pytest
import torch
from _dist_utils import (
    REMOTE_MODES,
    ExecMode,
    SimulateBackwardError,
    assert_contexts_released,
    assert_grads_match,
    assert_no_backward_pass_anywhere,
    check_against_local,
    current_context_id,
    exec_func,
    local_grads,
    set_flag,
    wait_for_no_contexts,
)
from _timing import scaled

import lightning_distgrad.autograd as dist_autograd
from lightning_distgrad import rpc
from lightning_distgrad.optim import DistributedOptimizer

pytestmark = pytest.mark.mpi(min_size=2)


# ---------------------------------------------------------------------------
# Remote functions (module level: the callee imports them by name)


def expert(x, w):
    return torch.tanh(x @ w)


def main_and_aux(x, w_main, w_aux):
    return x @ w_main, (x @ w_aux).sin()


def nested_partial(t1, t2, dst):
    """A -> B -> C: C returns three results; B uses only the first and last."""
    a, _, c = rpc.rpc_sync(dst, three_results, (t1, t2))
    rpc.rpc_sync(dst, torch.mul, (t1, t2))  # result dropped
    return a * c


def three_results(t1, t2):
    return t1 * t2, t1 + t2, t1.exp()


def nested_local(t1, t2, dst):
    a, _, c = three_results(t1, t2)
    return a * c


def waits_on_unused_send_and_fails(t, dst):
    """A node here waits for an unused RPC's send; it raises once it runs."""
    h = SimulateBackwardError.apply(t * 2, current_context_id())
    rpc.rpc_sync(dst, torch.add, (h, 1))  # result dropped
    return h * 3


class Expert:
    """One expert's weight, owned by the worker it lives on."""

    def __init__(self, w: torch.Tensor):
        self.w = w.detach().clone().requires_grad_(True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w)

    def get_w(self) -> torch.Tensor:
        return self.w


def _call_method(method, rref, *args):
    return method(rref.local_value(), *args)


# ---------------------------------------------------------------------------
# Unused RPC results


@pytest.mark.parametrize("mode", REMOTE_MODES, ids=lambda m: m.value)
def test_unused_rpc_result_takes_no_part(rpc_world, mode):
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    t3 = torch.rand(3, 3, requires_grad=True)

    def forward(ex, t1, t2, t3):
        ex(torch.add, t1, t3)  # result dropped: t3 gets no gradient
        return [(ex(torch.mul, t1, t2) * t1).sum()]

    check_against_local(forward, mode, rpc_world.peer(), t1, t2, t3)


def test_strict_keeps_the_error_and_can_be_overridden(rpc_world):
    t1 = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context(strict=True) as context_id:
        rpc.rpc_sync(rpc_world.peer(), torch.add, (t1, 1))
        loss = rpc.rpc_sync(rpc_world.peer(), torch.mul, (t1, 2)).sum()
        with pytest.raises(RuntimeError, match="got no gradient"):
            dist_autograd.backward(context_id, [loss], retain_graph=True)
        dist_autograd.backward(context_id, [loss], strict=False)
        torch.testing.assert_close(
            dist_autograd.get_gradients(context_id)[t1], torch.full((3, 3), 2.0)
        )
    assert_no_backward_pass_anywhere(rpc_world)


def test_partial_expert_routing_changes_per_step(rpc_world):
    """Four experts on two peers, all called; each step uses the top-1 experts of its
    tokens only, and which experts go unused changes from step to step."""
    world = rpc_world
    torch.manual_seed(world.rank)
    ws = [torch.rand(4, 4, requires_grad=True) for _ in range(4)]
    gate = torch.rand(4, 4, requires_grad=True)
    dst_of = {id(w): world.peer(1 + i % 2) for i, w in enumerate(ws)}
    for step in range(4):
        x = torch.rand(6, 4)
        allowed = torch.zeros(4, dtype=torch.bool)
        allowed[[step % 4, (step + 1) % 4]] = True

        def forward(ex, gate, *ws, x=x, allowed=allowed):
            logits = (x @ gate).masked_fill(~allowed, float("-inf"))
            probs, top = logits.softmax(-1).max(-1)
            outs = [ex(expert, x, w) for w in ws]  # every expert is called
            y = torch.zeros(6, 4)
            for i in top.unique().tolist():
                rows = (top == i).nonzero().squeeze(1)
                y = y.index_add(0, rows, outs[i][rows] * probs[rows, None])
            return [y.pow(2).sum()]

        expected = local_grads(forward, gate, *ws)
        assert sum(g is None for g in expected) >= 2  # some experts unused
        with dist_autograd.context() as context_id:
            roots = forward(lambda fn, *a: rpc.rpc_sync(dst_of[id(a[1])], fn, a), gate, *ws)
            dist_autograd.backward(context_id, roots)
            assert_grads_match(dist_autograd.get_gradients(context_id), [gate, *ws], expected)


@pytest.mark.parametrize("mode", REMOTE_MODES, ids=lambda m: m.value)
def test_unused_auxiliary_outputs(rpc_world, mode):
    x = torch.rand(3, 3, requires_grad=True)
    w_main = torch.rand(3, 3, requires_grad=True)
    w_aux = torch.rand(3, 3, requires_grad=True)

    def forward(ex, x, w_main, w_aux):
        main, _aux = ex(main_and_aux, x, w_main, w_aux)
        return [main.sum()]

    check_against_local(forward, mode, rpc_world.peer(), x, w_main, w_aux)


def test_unused_to_here(rpc_world):
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    expected = local_grads(lambda ex, a, b: [(a * b).sum()], t1, t2)
    with dist_autograd.context() as context_id:
        rref = rpc.remote(rpc_world.peer(), torch.add, (t1, t2))
        rref.to_here()  # fetched, never used
        loss = rpc.rpc_sync(rpc_world.peer(1), torch.mul, (t1, t2)).sum()
        dist_autograd.backward(context_id, [loss])
        assert_grads_match(dist_autograd.get_gradients(context_id), [t1, t2], expected)


def test_nested_rpcs_with_some_results_of_the_last_worker_used(rpc_world):
    world = rpc_world
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    expected = local_grads(lambda ex, a, b: [nested_local(a, b, None).sum()], t1, t2)
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync(world.peer(1), nested_partial, (t1, t2, world.peer(2)))
        dist_autograd.backward(context_id, [out.sum()])
        assert_grads_match(dist_autograd.get_gradients(context_id), [t1, t2], expected)


# ---------------------------------------------------------------------------
# Several passes and forwards in one context


def test_several_passes_over_different_roots(rpc_world):
    world = rpc_world
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)

    def forward(ex, t1, t2):
        return [ex(torch.add, t1, t2).sum(), (ex(torch.mul, t1, t1) * 3).sum()]

    exp_a = local_grads(lambda ex, a, b: [forward(ex, a, b)[0]], t1, t2)
    exp_b = local_grads(lambda ex, a, b: [forward(ex, a, b)[1]], t1, t2)
    with dist_autograd.context() as context_id:
        loss_a, loss_b = forward(lambda fn, *a: rpc.rpc_sync(world.peer(), fn, a), t1, t2)
        dist_autograd.backward(context_id, [loss_a], retain_graph=True)
        assert_grads_match(dist_autograd.get_gradients(context_id), [t1, t2], exp_a)
        dist_autograd.backward(context_id, [loss_b])
        grads = dist_autograd.get_gradients(context_id)
        torch.testing.assert_close(grads[t1], exp_a[0] + exp_b[0])
        torch.testing.assert_close(grads[t2], exp_a[1])
    assert_no_backward_pass_anywhere(world)


def test_second_forward_after_retained_backward(rpc_world):
    world = rpc_world
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    exp_1 = local_grads(lambda ex, a, b: [(a * b).sum()], t1, t2)
    exp_2 = local_grads(lambda ex, a, b: [(a + b).exp().sum()], t1, t2)
    with dist_autograd.context() as context_id:
        loss1 = rpc.rpc_sync(world.peer(), torch.mul, (t1, t2)).sum()
        dist_autograd.backward(context_id, [loss1], retain_graph=True)
        loss2 = rpc.rpc_sync(world.peer(1), torch.add, (t1, t2)).exp().sum()
        dist_autograd.backward(context_id, [loss2])  # the first forward takes no part
        grads = dist_autograd.get_gradients(context_id)
        for leaf, a, b in zip((t1, t2), exp_1, exp_2, strict=True):
            torch.testing.assert_close(grads[leaf], a + b)
    assert_no_backward_pass_anywhere(world)


# ---------------------------------------------------------------------------
# Graph shapes


@pytest.mark.parametrize("shape", ["mul", "cat", "cat_and_unused"])
def test_waiting_node_upstream_of_a_node_fed_now(rpc_world, shape):
    """``h`` is sent and also used next to its own input: the node of ``h`` waits for
    the peer's gradient while the leaf below it already receives gradients."""
    x = torch.rand(3, requires_grad=True)

    def forward(ex, x):
        h = x.exp()
        u = ex(torch.mul, h, 2.0)
        if shape == "mul":
            return [(u + x * h).sum()]
        if shape == "cat_and_unused":
            ex(torch.add, h, 1.0)
        return [torch.cat([x, h, u]).pow(2).sum()]

    for mode in REMOTE_MODES:
        check_against_local(forward, mode, rpc_world.peer(), x)


# ---------------------------------------------------------------------------
# Threads, errors, cleanup


def test_threads_running_their_own_contexts(rpc_world):
    world = rpc_world
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(5):
                t1 = torch.rand(3, 3, requires_grad=True)
                t2 = torch.rand(3, 3, requires_grad=True)

                def forward(ex, t1, t2, i=i):
                    ex(torch.sub, t1, t2)  # dropped
                    return [(ex(torch.mul, t1, t2) + t1).sum()]

                check_against_local(forward, ExecMode.RPC_SYNC, world.peer(1 + i % 2), t1, t2)
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(scaled(120))
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert_no_backward_pass_anywhere(world)


def test_error_in_a_node_that_runs_after_settling(rpc_world):
    world = rpc_world
    t = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        rpc.rpc_sync(world.peer(), set_flag, (("fail", context_id), True))
        out = rpc.rpc_sync(world.peer(), waits_on_unused_send_and_fails, (t, world.peer(2)))
        try:
            with pytest.raises(
                RuntimeError,
                match=f"Error on Node {world.peer_rank()}: Simulate error on backward pass",
            ):
                dist_autograd.backward(context_id, [out.sum()])
            assert_no_backward_pass_anywhere(world)
        finally:
            rpc.rpc_sync(world.peer(), set_flag, (("fail", context_id), None))
            world.barrier()


def test_leaving_the_context_releases_every_worker(rpc_world):
    world = rpc_world
    ids = []
    t1 = torch.rand(3, 3, requires_grad=True)
    for _ in range(3):
        with dist_autograd.context() as context_id:
            ids.append(context_id)
            exec_func(ExecMode.REMOTE, world.peer(2), torch.add, t1, t1)  # dropped
            loss = rpc.rpc_sync(world.peer(1), torch.mul, (t1, t1)).sum()
            dist_autograd.backward(context_id, [loss])
    assert_no_backward_pass_anywhere(world)
    assert_contexts_released(world, ids)
    wait_for_no_contexts(world)


# ---------------------------------------------------------------------------
# DistributedOptimizer over a routed model


def test_dist_optim_with_routed_remote_experts(rpc_world):
    """Parameters of experts unused in a step get no gradient and stay as Adam leaves
    them (as with ``.grad`` None locally), compared with a one-process reference."""
    world = rpc_world
    torch.manual_seed(100 + world.rank)
    init = [torch.rand(4, 4) for _ in range(4)]
    gate0 = torch.rand(4, 4)
    experts = [rpc.remote(world.peer(1 + i % 2), Expert, (init[i],)) for i in range(4)]
    w_rrefs = [rpc.remote(e.owner(), _call_method, (Expert.get_w, e)) for e in experts]
    gate = gate0.clone().requires_grad_(True)
    dist_optim = DistributedOptimizer(torch.optim.Adam, [rpc.RRef(gate), *w_rrefs], lr=0.05)
    ref_ws = [w.clone().requires_grad_(True) for w in init]
    ref_gate = gate0.clone().requires_grad_(True)
    ref_optim = torch.optim.Adam([ref_gate, *ref_ws], lr=0.05)

    def model(gate, call, x, allowed):
        logits = (x @ gate).masked_fill(~allowed, float("-inf"))
        probs, top = logits.softmax(-1).max(-1)
        outs = [call(i, x) for i in range(4)]
        y = torch.zeros(6, 4)
        for i in top.unique().tolist():
            rows = (top == i).nonzero().squeeze(1)
            y = y.index_add(0, rows, outs[i][rows] * probs[rows, None])
        return (y - 0.5).pow(2).sum()

    for step in range(4):
        x = torch.rand(6, 4)
        allowed = torch.zeros(4, dtype=torch.bool)
        allowed[[step % 4, (step + 2) % 4]] = True
        ref_optim.zero_grad(set_to_none=True)
        model(ref_gate, lambda i, x: expert(x, ref_ws[i]), x, allowed).backward()
        ref_optim.step()
        with dist_autograd.context() as context_id:
            loss = model(gate, lambda i, x: experts[i].rpc_sync().forward(x), x, allowed)
            dist_autograd.backward(context_id, [loss])
            dist_optim.step(context_id)
    torch.testing.assert_close(gate.detach(), ref_gate.detach())
    for w_rref, ref in zip(w_rrefs, ref_ws, strict=True):
        torch.testing.assert_close(w_rref.to_here(), ref.detach())
    world.barrier()
