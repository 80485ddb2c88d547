"""torch's DistributedDataParallel inside distributed backward passes behaves as under TensorPipe.

Every rank wraps the same local module in torch's DDP over a gloo process group of the session's
ranks and feeds it tensors that come over RPC, inside a distributed autograd context. The
expected values are plain local torch on the same values: each rank's local gradients, averaged
over the ranks (DDP's contract, with a rank that did not use a parameter counting zero), in the
context before ``DistributedOptimizer.step``; the replicas stay bit-identical, and ``.grad`` is
untouched, as torch's distributed autograd leaves it. The options DDP offers for the reduction
(``find_unused_parameters``, ``no_sync()``, ``bucket_cap_mb``, ``gradient_as_bucket_view``), a
module that takes part in some passes only, a replica on a worker that is not the root of the
pass, a comm hook, sparse gradients, and the hybrid model of torch's DDP + RPC tutorial (on >= 4
ranks) are checked; ``static_graph`` and delayed allreduce raise.

A serial test runs one process (a world of one) started fresh, with the DDP module built before
lightning_distgrad is imported.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from _dist_utils import exchange, gloo_process_group, mlp, seeded
from _job_runner import clean_env
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lightning_distgrad.autograd as dist_autograd
from lightning_distgrad import rpc
from lightning_distgrad.autograd import _leaves
from lightning_distgrad.optim import DistributedOptimizer

mpi = pytest.mark.mpi(min_size=2)

LR = 0.1
#: DDP's reduction options: one bucket, the bucket as .grad, a bucket per parameter, and the
#: search for unused parameters (a DDPSink node and a graph traversal each forward).
OPTIONS = {
    "default": {},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
    "bucket_per_parameter": {"bucket_cap_mb": 1e-6},
    "find_unused_parameters": {"find_unused_parameters": True},
}


@pytest.fixture(scope="module")
def gloo(rpc_session):
    with gloo_process_group(rpc_session):
        yield


@pytest.fixture
def world(gloo, rpc_world):
    return rpc_world


# ---------------------------------------------------------------------------
# Helpers


def batch(world, step: int, shape=(5, 4)) -> torch.Tensor:
    """This rank's input of ``step``: different on every rank, so averaging changes things."""
    g = torch.Generator().manual_seed(1000 * world.rank + step)
    return torch.randn(shape, generator=g).requires_grad_()


def arrive(world, x: torch.Tensor, remote: bool) -> torch.Tensor:
    """``sin(x)``, computed by the next rank over RPC (its gradient comes back) or here."""
    return rpc.rpc_sync(world.peer(), torch.sin, (x,)) if remote else torch.sin(x)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def local_grads(module: nn.Module, x: torch.Tensor, forward=None) -> list[torch.Tensor | None]:
    """Plain local torch: the gradients of a copy of ``module`` and of ``x``'s copy."""
    module = copy.deepcopy(module)
    x = x.detach().clone().requires_grad_()
    out = (forward or (lambda m, h: m(h)))(module, torch.sin(x))
    return list(torch.autograd.grad(loss_of(out), [*module.parameters(), x], allow_unused=True))


def mean_over_ranks(world, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Each gradient's mean over the ranks, absent ones counting zero; None if absent everywhere."""
    everyone = exchange(world, grads)
    means = []
    for per_rank in zip(*everyone, strict=True):
        present = [g for g in per_rank if g is not None]
        means.append(None if not present else torch.stack(present).sum(0) / world.size)
    return means


def assert_grads(grads: dict, params: list, expected: list, what: str) -> None:
    for i, (p, e) in enumerate(zip(params, expected, strict=True)):
        if e is None:
            assert p not in grads, f"{what}: parameter {i} got a gradient; expected none"
        else:
            got = grads[p].to_dense() if grads[p].is_sparse else grads[p]
            torch.testing.assert_close(got, e, msg=lambda m, i=i: f"{what}: parameter {i}: {m}")


def assert_replicas_equal(world, module: nn.Module, what: str) -> None:
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    everyone = exchange(world, flat)
    assert all(torch.equal(flat, other) for other in everyone), f"{what}: replicas differ"


def assert_grad_untouched(module: nn.Module) -> None:
    assert all(p.grad is None for p in module.parameters()), ".grad changed"


def optimizer(module: nn.Module) -> DistributedOptimizer:
    return DistributedOptimizer(torch.optim.SGD, [rpc.RRef(p) for p in module.parameters()], lr=LR)


def context_grads(context_id: int) -> dict:
    """The context's gradients, copied (a bucket view changes with the next reduction)."""
    return {p: g.clone() for p, g in dist_autograd.get_gradients(context_id).items()}


# ---------------------------------------------------------------------------
# Averaging, replicas, .grad


@mpi
@pytest.mark.parametrize("remote", [True, False], ids=["over_rpc", "local_only"])
@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_gradients_are_averaged_in_the_context_and_replicas_stay_equal(world, options, remote):
    net = mlp()
    ddp = DDP(net, **options)
    opt = optimizer(net)
    params = list(net.parameters())
    for step in range(3):
        x = batch(world, step)
        expected = local_grads(net, x)
        averaged = mean_over_ranks(world, expected[:-1])
        before = [p.detach().clone() for p in params]
        with dist_autograd.context() as context_id:
            dist_autograd.backward(context_id, [loss_of(ddp(arrive(world, x, remote)))])
            grads = context_grads(context_id)
            opt.step(context_id)
        assert_grads(grads, params, averaged, f"step {step}")
        torch.testing.assert_close(grads[x], expected[-1])
        for p, old, g in zip(params, before, averaged, strict=True):
            torch.testing.assert_close(p.detach(), old - LR * g)
        assert_replicas_equal(world, net, f"step {step}")
        assert_grad_untouched(net)
        assert x.grad is None


class TwoHeads(nn.Module):
    """Head ``b`` takes part when ``use_b``; with ``split`` both heads' outputs come back."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)

    def forward(self, h: torch.Tensor, use_b: bool = True, split: bool = False):
        if split:
            return self.a(h), self.b(h)
        return self.a(h) + self.b(h) if use_b else self.a(h)


@pytest.mark.parametrize(
    "case", ["b_on_rank_0_only", "b_nowhere", "b_output_unused"], ids=lambda c: c
)
@mpi
def test_find_unused_parameters_averages_what_was_used(world, case):
    net = seeded(TwoHeads())
    ddp = DDP(net, find_unused_parameters=True)
    opt = optimizer(net)
    params = list(net.parameters())
    use_b = case == "b_on_rank_0_only" and world.rank == 0
    split = case == "b_output_unused"

    def forward(module, h):
        out = module(h, use_b=use_b, split=split)
        return out[0] if split else out  # b's output takes no part in the loss

    for step in range(2):
        x = batch(world, step)
        expected = mean_over_ranks(world, local_grads(net, x, forward)[:-1])
        before = [p.detach().clone() for p in params]
        with dist_autograd.context() as context_id:
            dist_autograd.backward(context_id, [loss_of(forward(ddp, arrive(world, x, True)))])
            grads = context_grads(context_id)
            opt.step(context_id)
        assert_grads(grads, params, expected, f"{case}, step {step}")
        if case != "b_on_rank_0_only":  # no gradient anywhere: the optimizer leaves b alone
            assert all(torch.equal(p, old) for p, old in zip(params[2:], before[2:], strict=True))
        assert_replicas_equal(world, net, case)
        assert_grad_untouched(net)


@mpi
def test_no_sync_keeps_gradients_local_and_the_next_pass_averages_their_sum(world):
    net = mlp()
    ddp = DDP(net)
    params = list(net.parameters())
    x1, x2 = batch(world, 0), batch(world, 1)
    g1, g2 = local_grads(net, x1)[:-1], local_grads(net, x2)[:-1]
    with dist_autograd.context() as context_id:
        with ddp.no_sync():
            dist_autograd.backward(context_id, [loss_of(ddp(arrive(world, x1, True)))])
        assert_grads(context_grads(context_id), params, g1, "inside no_sync")
        dist_autograd.backward(context_id, [loss_of(ddp(arrive(world, x2, True)))])
        summed = [a + b for a, b in zip(g1, g2, strict=True)]
        assert_grads(context_grads(context_id), params, mean_over_ranks(world, summed), "after")
    assert_grad_untouched(net)


@mpi
def test_a_module_in_some_iterations_and_passes_only(world):
    net = mlp()
    ddp = DDP(net)
    params = list(net.parameters())
    for step, uses_ddp in enumerate([True, False, True]):
        x = batch(world, step)
        with dist_autograd.context() as context_id:
            h = arrive(world, x, True)
            if uses_ddp:
                dist_autograd.backward(context_id, [loss_of(ddp(h))])
                expected = mean_over_ranks(world, local_grads(net, x)[:-1])
                assert_grads(context_grads(context_id), params, expected, f"step {step}")
                # A second pass in the same context that does not reach the module.
                dist_autograd.backward(context_id, [loss_of(arrive(world, x, True))])
                assert_grads(context_grads(context_id), params, expected, "after pass 2")
            else:  # the module sits this iteration out
                dist_autograd.backward(context_id, [loss_of(h)])
                assert not any(p in dist_autograd.get_gradients(context_id) for p in params)
    assert_replicas_equal(world, net, "end")
    assert_grad_untouched(net)


class RemoteMiddle(nn.Module):
    """A module whose forward calls another rank: its first layer's gradients arrive in a
    later delivery of the pass than its last layer's."""

    def __init__(self, peer: str | None):
        super().__init__()
        self.inner = nn.Linear(4, 6)
        self.outer = nn.Linear(6, 3)
        self.peer = peer

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.inner(h)
        h = rpc.rpc_sync(self.peer, torch.tanh, (h,)) if self.peer else torch.tanh(h)
        return self.outer(h)


@mpi
def test_parameters_whose_gradients_arrive_in_several_deliveries(world, monkeypatch):
    net = seeded(RemoteMiddle(world.peer()))
    ddp = DDP(net, bucket_cap_mb=1e-6)  # a bucket per parameter
    params = list(net.parameters())
    calls = []
    run = _leaves.LeafGradients._run_accumulate_grad
    monkeypatch.setattr(
        _leaves.LeafGradients,
        "_run_accumulate_grad",
        staticmethod(lambda pairs: calls.append(len(pairs)) or run(pairs)),
    )
    local = seeded(RemoteMiddle(None))
    for step in range(2):
        x = batch(world, step)
        expected = mean_over_ranks(world, local_grads(local, x)[:-1])
        calls.clear()
        with dist_autograd.context() as context_id:
            dist_autograd.backward(context_id, [loss_of(ddp(arrive(world, x, True)))])
            assert_grads(context_grads(context_id), params, expected, f"step {step}")
            optimizer(net).step(context_id)
        # Every parameter went through its AccumulateGrad node, in one native call at the end.
        assert calls == [len(params)], calls
        with torch.no_grad():
            for p, q in zip(local.parameters(), params, strict=True):
                p.copy_(q)
        assert_replicas_equal(world, net, f"step {step}")
    assert_grad_untouched(net)


#: This rank's replica of the stage that the previous rank's passes run (see below).
_stage: dict[str, nn.Module] = {}


def _run_stage(h: torch.Tensor) -> torch.Tensor:
    return _stage["ddp"](h)


def _stage_grads(context_id: int) -> list[torch.Tensor | None]:
    grads = dist_autograd.get_gradients(context_id)
    return [grads.get(p) for p in _stage["ddp"].module.parameters()]


@mpi
def test_a_replica_on_a_worker_that_is_not_the_root_of_the_pass(world):
    # Pipeline-style: each rank's pass runs the next rank's replica, whose gradients DDP
    # averages there (on its own thread, while that rank's RPC thread goes on serving).
    net = mlp()
    _stage["ddp"] = DDP(net)
    world.barrier()
    try:
        for step in range(2):
            x = batch(world, step)
            expected = mean_over_ranks(world, local_grads(net, x)[:-1])
            with dist_autograd.context() as context_id:
                out = rpc.rpc_sync(world.peer(), _run_stage, (torch.sin(x),))
                dist_autograd.backward(context_id, [loss_of(out)])
                grads = rpc.rpc_sync(world.peer(), _stage_grads, (context_id,))
            world.barrier()  # the previous rank's pass, which ran this rank's replica, is over
            assert_grads(
                dict(zip(net.parameters(), grads, strict=True)),
                list(net.parameters()),
                expected,
                f"step {step}",
            )
            assert_grad_untouched(net)
    finally:
        world.barrier()
        _stage.clear()


@mpi
def test_a_comm_hook_reduces_as_in_a_local_backward(world):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    net, twin = mlp(), mlp()
    ddp, local_ddp = DDP(net), DDP(twin)
    for module in (ddp, local_ddp):  # gradients travel in float16
        module.register_comm_hook(None, default_hooks.fp16_compress_hook)
    x = batch(world, 0)
    xl = x.detach().clone().requires_grad_()
    loss_of(local_ddp(torch.sin(xl))).backward()  # torch's DDP in a local backward pass
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [loss_of(ddp(arrive(world, x, True)))])
        grads = context_grads(context_id)
    assert_grads(grads, list(net.parameters()), [p.grad for p in twin.parameters()], "fp16")
    assert_grad_untouched(net)


@mpi
def test_sparse_gradients_are_averaged(world):
    bag = seeded(nn.EmbeddingBag(10, 3, mode="sum", sparse=True))
    ddp = DDP(bag)
    g = torch.Generator().manual_seed(world.rank)
    indices, offsets = torch.randint(0, 10, (8,), generator=g), torch.tensor([0, 3])

    local = copy.deepcopy(bag)
    expected_local = torch.autograd.grad(local(indices, offsets).mul(2.0).sum(), [local.weight])[0]
    expected = exchange(world, expected_local.to_dense())
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync(world.peer(), torch.mul, (ddp(indices, offsets), 2.0))
        dist_autograd.backward(context_id, [out.sum()])
        grad = dist_autograd.get_gradients(context_id)[bag.weight]
        assert grad.is_sparse
        torch.testing.assert_close(grad.to_dense(), torch.stack(expected).mean(0))
    assert_grad_untouched(bag)


# ---------------------------------------------------------------------------
# What cannot be honoured raises


@mpi
def test_static_graph_raises(world):
    ddp = DDP(mlp(), static_graph=True)
    with dist_autograd.context() as context_id:
        loss = loss_of(ddp(arrive(world, batch(world, 0), True)))
        with pytest.raises(RuntimeError, match=r"static_graph=True\) cannot average"):
            dist_autograd.backward(context_id, [loss])


@mpi
def test_delayed_allreduce_raises(world):
    net = mlp()
    delayed = list(net.named_parameters())[:2]  # the first layer's
    ddp = DDP(net, delay_all_reduce_named_params=delayed, param_to_hook_all_reduce=delayed[0][1])
    with dist_autograd.context() as context_id:
        loss = loss_of(ddp(arrive(world, batch(world, 0), True)))
        with pytest.raises(RuntimeError, match="delay_all_reduce_named_params=...\\) cannot"):
            dist_autograd.backward(context_id, [loss])
    world.barrier()  # the delayed allreduce DDP started in the pass is done everywhere


# ---------------------------------------------------------------------------
# The DDP + RPC tutorial's hybrid model, with torch's DDP (on >= 4 ranks)


@pytest.mark.mpi(min_size=4)
def test_tutorial_hybrid_with_torch_ddp_in_session(world):
    import sys
    from pathlib import Path

    from mpi4py import MPI

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import ddp_rpc

    steps = 5
    rank = world.rank
    trainers = world.comm.Split(0 if rank in ddp_rpc.TRAINERS else MPI.UNDEFINED, rank)
    group = dist.new_group(list(ddp_rpc.TRAINERS))  # a collective of the whole group
    if rank in ddp_rpc.TRAINERS:
        ddp_rpc._trainers_comm, ddp_rpc._ddp_group = trainers, group
    world.barrier()  # every trainer is ready before the master starts them
    if rank == ddp_rpc.MASTER:
        result = ddp_rpc.run_master(
            1,
            steps,
            verbose=False,
            ps=world.names[ddp_rpc.PS],
            trainer_names=tuple(world.names[r] for r in ddp_rpc.TRAINERS),
        )
        ref = ddp_rpc.reference(1, steps)
        assert result["equal_each_step"] == [True] * steps
        for name, value in ref["params"].items():
            torch.testing.assert_close(result["params"][name], value, atol=1e-5, rtol=0)
        for t in range(2):
            torch.testing.assert_close(
                torch.tensor(result["losses"][t]), torch.tensor(ref["losses"][t])
            )
    world.barrier()  # training is over everywhere
    if trainers != MPI.COMM_NULL:
        ddp_rpc._trainers_comm = ddp_rpc._ddp_group = None
        trainers.Free()
        dist.destroy_process_group(group)


# ---------------------------------------------------------------------------
# One process, a DDP module built before the package is imported


def test_a_ddp_module_built_before_the_import_is_found():
    # A comm hook that doubles what it reduces shows whether DDP's reducer ran: over one
    # rank its average is the gradient itself.
    script = textwrap.dedent(
        """
        import os, tempfile, warnings
        import torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        def doubled(state, bucket):
            future = torch.futures.Future()
            future.set_result(bucket.buffer() * 2)
            return future

        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        net = torch.nn.Linear(3, 2)
        ddp = DDP(net)
        ddp.register_comm_hook(None, doubled)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # finding it warns about nothing
            import lightning_distgrad.autograd as dist_autograd
            from lightning_distgrad import rpc
        rpc.init_rpc("worker0", rank=0, world_size=1)
        x = torch.randn(4, 3)
        (expected,) = torch.autograd.grad(net(x).sum(), [net.weight])
        with dist_autograd.context() as context_id:
            dist_autograd.backward(context_id, [ddp(x).sum()])
            got = dist_autograd.get_gradients(context_id)[net.weight]
        torch.testing.assert_close(got, 2 * expected)
        assert net.weight.grad is None
        rpc.shutdown()
        dist.destroy_process_group()
        print("found and reduced")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], env=clean_env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "found and reduced" in result.stdout
