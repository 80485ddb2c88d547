"""ReplicatedModule: the data-parallel part of a hybrid (DDP + RPC) model.

The hybrid layout follows torch's DDP + RPC tutorial (seed 002): an
``EmbeddingBag`` on a parameter server reached through a RemoteModule, a dense
layer replicated on the trainers. With 2 ranks both ranks train and rank 1 also
hosts the table; with N >= 3 ranks, ranks 0..N-2 train (3 trainers on 4 ranks:
a non-power-of-two allreduce) and the last rank only serves the table.
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import polite_barrier
from mpi4py import MPI
from torch import nn

from lightning_distgrad import autograd as dist_autograd
from lightning_distgrad import rpc
from lightning_distgrad.nn import RemoteModule, ReplicatedModule
from lightning_distgrad.optim import DistributedOptimizer

pytestmark = pytest.mark.mpi(min_size=2)


# ---------------------------------------------------------------------------
# Helpers


def allgather(comm, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    polite_barrier(comm)
    return comm.allgather([t.detach().clone() for t in tensors])


def assert_same_on_every_rank(comm, tensors: list[torch.Tensor]) -> None:
    for theirs in allgather(comm, tensors):
        for mine, other in zip(tensors, theirs, strict=True):
            assert torch.equal(mine.detach(), other)


def context_grads(context_id: int, params) -> list[torch.Tensor | None]:
    grads = dist_autograd.get_gradients(context_id)
    return [grads.get(p) for p in params]


class Branches(nn.Module):
    """``a`` always used, ``b`` only when asked, ``c`` never."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 3), nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x, use_b: bool):
        return self.a(x) + (self.b(x) if use_b else 0)


_stash: dict[str, object] = {}
_stash_lock = threading.Lock()


def stash(key: str, obj: object) -> None:
    with _stash_lock:
        _stash[key] = obj


def take(key: str) -> object:
    with _stash_lock:
        return _stash.pop(key)


# ---------------------------------------------------------------------------
# Construction


def test_construction_copies_parameters_and_buffers_of_the_first_rank(rpc_world):
    torch.manual_seed(rpc_world.rank)
    module = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 2).double())
    module[1].running_mean.fill_(rpc_world.rank)
    before = [t.detach().clone() for t in module.state_dict().values()]
    replicated = ReplicatedModule(module, rpc_world.comm)
    after = list(module.state_dict().values())
    first = allgather(rpc_world.comm, before)[0]
    for mine, expected in zip(after, first, strict=True):
        assert torch.equal(mine, expected)
    assert_same_on_every_rank(rpc_world.comm, after)
    assert list(replicated.state_dict()) == [f"module.{k}" for k in module.state_dict()]

    ReplicatedModule(module, rpc_world.comm, src=rpc_world.size - 1)
    assert torch.equal(module[1].running_mean, torch.zeros(4))  # rank 0's values everywhere


def test_modules_that_differ_raise_on_every_rank(rpc_world):
    module = nn.Linear(4, 3 if rpc_world.rank == 0 else 2)
    with pytest.raises(
        ValueError,
        match="the trainers wrap different modules.*First difference: "
        "rank 0 of the communicator has \\('parameter', "
        "'weight', \\(3, 4\\)",
    ):
        ReplicatedModule(module, rpc_world.comm)


def test_bad_arguments_raise(rpc_world):
    with pytest.raises(ValueError, match="comm must be the trainers' intracommunicator"):
        ReplicatedModule(nn.Linear(2, 2), MPI.COMM_NULL)
    with pytest.raises(ValueError, match="src=99 is not a rank of comm"):
        ReplicatedModule(nn.Linear(2, 2), rpc_world.comm, src=99)


def test_buffers_are_broadcast_at_forward(rpc_world):
    module = nn.BatchNorm1d(3).eval()
    replicated = ReplicatedModule(module, rpc_world.comm)
    x = torch.arange(6.0).view(2, 3)
    module.running_mean.fill_(rpc_world.rank)  # diverged, e.g. by a local update
    assert_same_on_every_rank(rpc_world.comm, [replicated(x)])  # rank 0's statistics were used
    assert torch.equal(module.running_mean, torch.zeros(3))
    replicated.broadcast_buffers = False
    module.running_mean.fill_(rpc_world.rank)
    outs = allgather(rpc_world.comm, [replicated(x)])
    assert not torch.equal(outs[0][0], outs[1][0])


# ---------------------------------------------------------------------------
# Gradient averaging


def test_sync_gradients_replaces_context_gradients_by_their_mean(rpc_world):
    module = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))
    replicated = ReplicatedModule(module, rpc_world.comm, bucket_cap_mb=0.0001)  # many buckets
    params = list(module.parameters())
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(rpc_world.rank))
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [replicated(x).pow(2).sum()])
        mine = context_grads(context_id, params)
        everyone = allgather(rpc_world.comm, mine)
        replicated.sync_gradients(context_id)
        averaged = context_grads(context_id, params)
    for i, grad in enumerate(averaged):
        torch.testing.assert_close(grad, sum(g[i] for g in everyone) / rpc_world.size)
    assert_same_on_every_rank(rpc_world.comm, averaged)
    assert all(p.grad is None for p in params)


class MixedDtypes(nn.Module):
    def __init__(self):
        super().__init__()
        self.p64 = nn.Parameter(torch.randn(5, dtype=torch.float64))
        self.p16 = nn.Parameter(torch.randn(4).half())
        self.pbf = nn.Parameter(torch.randn(3).bfloat16())
        self.p32 = nn.Parameter(torch.randn(2, 2))

    def forward(self, k: float):
        return (
            self.p64.sum() * k
            + (self.p16.float() * k).pow(2).sum()
            + self.pbf.float().pow(3).sum() * k
            + (self.p32 * k).sum()
        )


def test_sync_gradients_keeps_dtypes_and_reduces_half_types_in_float32(rpc_world):
    module = MixedDtypes()
    replicated = ReplicatedModule(module, rpc_world.comm)
    params = list(module.parameters())
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [replicated(1.0 + rpc_world.rank)])
        everyone = allgather(rpc_world.comm, context_grads(context_id, params))
        replicated.sync_gradients(context_id)
        averaged = context_grads(context_id, params)
    for i, (p, grad) in enumerate(zip(params, averaged, strict=True)):
        assert grad.dtype == p.dtype and grad.shape == p.shape
        expected = sum(g[i].float() for g in everyone) / rpc_world.size
        torch.testing.assert_close(grad, expected.to(p.dtype))
    assert_same_on_every_rank(rpc_world.comm, averaged)


def test_parameters_without_gradient(rpc_world):
    module = Branches()
    replicated = ReplicatedModule(module, rpc_world.comm)
    opt = DistributedOptimizer(torch.optim.Adam, replicated.parameter_rrefs(), lr=0.1)
    old_c = [p.detach().clone() for p in module.c.parameters()]
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rpc_world.rank))
    with dist_autograd.context() as context_id:
        out = replicated(x, use_b=rpc_world.rank == 0)
        dist_autograd.backward(context_id, [out.sum()])
        b_grads = context_grads(context_id, module.b.parameters())
        rank0_b = allgather(
            rpc_world.comm, [g if g is not None else torch.zeros(0) for g in b_grads]
        )[0]
        replicated.sync_gradients(context_id)
        b_avg = context_grads(context_id, module.b.parameters())
        assert context_grads(context_id, module.c.parameters()) == [None, None]
        opt.step(context_id)
    # Used on rank 0 only: rank 0's gradient averaged with zeros elsewhere.
    for avg, g0 in zip(b_avg, rank0_b, strict=True):
        torch.testing.assert_close(avg, g0 / rpc_world.size)
    # Used nowhere: no gradient, so even Adam leaves it unchanged.
    for p, old in zip(module.c.parameters(), old_c, strict=True):
        assert torch.equal(p, old)
    assert_same_on_every_rank(rpc_world.comm, list(module.parameters()))


def test_sparse_gradients_of_a_replicated_embedding(rpc_world):
    module = nn.Embedding(10, 3, sparse=True)
    replicated = ReplicatedModule(module, rpc_world.comm)
    opt = DistributedOptimizer(torch.optim.SGD, replicated.parameter_rrefs(), lr=0.5)
    indices = torch.tensor([rpc_world.rank % 10, 7, 7])
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [replicated(indices).sum()])
        mine = context_grads(context_id, [module.weight])[0]
        everyone = allgather(rpc_world.comm, [mine.to_dense()])
        replicated.sync_gradients(context_id)
        averaged = context_grads(context_id, [module.weight])[0]
        assert averaged.is_sparse
        torch.testing.assert_close(
            averaged.to_dense(), sum(g[0] for g in everyone) / rpc_world.size
        )
        opt.step(context_id)
    assert_same_on_every_rank(rpc_world.comm, [module.weight])


def test_failure_on_one_rank_raises_on_every_rank(rpc_world):
    module = nn.Linear(3, 2)
    replicated = ReplicatedModule(module, rpc_world.comm)
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [replicated(torch.ones(1, 3)).sum()])
        before = context_grads(context_id, module.parameters())
        if rpc_world.rank == 0:
            with pytest.raises(
                RuntimeError, match="Could not find autograd context with id: 424242"
            ):
                replicated.sync_gradients(424242)
        else:
            with pytest.raises(RuntimeError, match="sync_gradients failed on 1 other trainer"):
                replicated.sync_gradients(context_id)
            for old, new in zip(
                before, context_grads(context_id, module.parameters()), strict=True
            ):
                assert old is new
    # The communicator is still in step: a normal sync works afterwards.
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [replicated(torch.ones(1, 3)).sum()])
        replicated.sync_gradients(context_id)


# ---------------------------------------------------------------------------
# The hybrid model: EmbeddingBag on a parameter server, dense layer replicated


NUM_EMBEDDINGS, EMBEDDING_DIM, NUM_CLASSES = 30, 8, 4


class HybridModel(nn.Module):
    def __init__(self, remote_emb: RemoteModule, fc: ReplicatedModule):
        super().__init__()
        self.remote_emb = remote_emb
        self.fc = fc

    def forward(self, indices, offsets):
        return self.fc(self.remote_emb(indices, offsets))


def _batch(trainer: int, iteration: int):
    g = torch.Generator().manual_seed(1000 * iteration + trainer)
    indices = torch.randint(0, NUM_EMBEDDINGS, (15,), generator=g)
    offsets = torch.tensor([0, 4, 9, 11])
    target = torch.randint(0, NUM_CLASSES, (4,), generator=g)
    return indices, offsets, target


def _layout(world):
    if world.size == 2:
        return [0, 1], world.names[1]
    return list(range(world.size - 1)), world.names[-1]


@pytest.mark.parametrize("sparse", [False, True], ids=["dense-table", "sparse-table"])
def test_hybrid_training_keeps_replicas_identical_and_matches_local(rpc_world, sparse):
    trainer_ranks, ps = _layout(rpc_world)
    is_trainer = rpc_world.rank in trainer_ranks
    trainers = rpc_world.comm.Split(0 if is_trainer else MPI.UNDEFINED, rpc_world.rank)
    if not is_trainer:
        return  # the parameter server only serves
    try:
        _train_hybrid(rpc_world, trainers, trainer_ranks, ps, sparse)
    finally:
        trainers.Free()


def _train_hybrid(rpc_world, trainers, trainer_ranks, ps, sparse, iterations=4, lr=0.1):
    # Trainer 0 creates the table (the tutorial's master) and hands it to the others over RPC.
    if trainers.Get_rank() == 0:
        emb = RemoteModule(
            ps, nn.EmbeddingBag, (NUM_EMBEDDINGS, EMBEDDING_DIM), {"mode": "sum", "sparse": sparse}
        )
        for rank in trainer_ranks[1:]:
            rpc.rpc_sync(rank, stash, (f"emb-{sparse}", emb))
    polite_barrier(trainers)
    if trainers.Get_rank() != 0:
        emb = take(f"emb-{sparse}")
    torch.manual_seed(rpc_world.rank)  # different initial fc everywhere: the wrapper fixes it
    fc = ReplicatedModule(nn.Linear(EMBEDDING_DIM, NUM_CLASSES), trainers)
    model = HybridModel(emb, fc)
    opt = DistributedOptimizer(
        torch.optim.SGD, emb.remote_parameters() + fc.parameter_rrefs(), lr=lr
    )

    # The same training, computed locally: the table gets every trainer's step, the fc the mean.
    ref_emb = nn.EmbeddingBag(NUM_EMBEDDINGS, EMBEDDING_DIM, mode="sum")
    ref_emb.load_state_dict(emb.remote_state_dict())
    ref_fc = nn.Linear(EMBEDDING_DIM, NUM_CLASSES)
    ref_fc.load_state_dict(fc.module.state_dict())
    polite_barrier(trainers)  # everyone read the initial table

    me = trainers.Get_rank()
    for it in range(iterations):
        indices, offsets, target = _batch(me, it)
        with dist_autograd.context() as context_id:
            loss = nn.functional.cross_entropy(model(indices, offsets), target)
            dist_autograd.backward(context_id, [loss])
            fc.sync_gradients(context_id)
            opt.step(context_id)
        assert_same_on_every_rank(trainers, list(fc.parameters()))  # bit-identical replicas

        emb_grad, fc_grads = torch.zeros_like(ref_emb.weight), None
        for t in range(len(trainer_ranks)):
            ref_emb.zero_grad()
            ref_fc.zero_grad()
            i, o, y = _batch(t, it)
            nn.functional.cross_entropy(ref_fc(ref_emb(i, o)), y).backward()
            emb_grad += ref_emb.weight.grad
            grads = [p.grad / len(trainer_ranks) for p in ref_fc.parameters()]
            fc_grads = (
                grads if fc_grads is None else [a + b for a, b in zip(fc_grads, grads, strict=True)]
            )
        with torch.no_grad():
            ref_emb.weight -= lr * emb_grad
            for p, g in zip(ref_fc.parameters(), fc_grads, strict=True):
                p -= lr * g

    torch.testing.assert_close(
        emb.remote_state_dict()["weight"], ref_emb.weight.detach(), atol=1e-5, rtol=0
    )
    for p, ref in zip(fc.parameters(), ref_fc.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), ref.detach(), atol=1e-5, rtol=0)
    polite_barrier(trainers)  # nobody drops the table while another trainer still reads it
