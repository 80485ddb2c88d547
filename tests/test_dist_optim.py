"""DistributedOptimizer: torch's dist_optimizer_test cases, plus state dicts and sparse grads.

Every rank runs each test at the same time and drives its own optimizer over
parameters on its neighbours (``peer(1)``, ``peer(2)``; on 2 ranks ``peer(2)``
is the rank itself), so owners serve several optimizers at once. Results are
compared with the same ``torch.optim`` optimizer run locally on the same
gradients.
"""

from __future__ import annotations

import io
import threading
import time

import pytest
import torch

from lightning_distgrad import autograd as dist_autograd
from lightning_distgrad import rpc
from lightning_distgrad.nn import RemoteModule
from lightning_distgrad.optim import DistributedOptimizer
from lightning_distgrad.rpc._calls import dispatch

pytestmark = pytest.mark.mpi(min_size=2)


# ---------------------------------------------------------------------------
# Remote helpers (module level: the callee imports them by name)


class MyModule:
    """torch's test module: ``forward(t) = w @ t``, ``w`` a 3x3 leaf."""

    def __init__(self, requires_grad: bool = True, w: torch.Tensor | None = None):
        g = torch.Generator().manual_seed(0)
        init = torch.rand((3, 3), generator=g) if w is None else w.detach().clone()
        self.w = init.requires_grad_(requires_grad)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return torch.mm(self.w, t)

    def get_w(self) -> torch.Tensor:
        return self.w


def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def remote_method(method, rref, *args):
    return rpc.remote(rref.owner(), _call_method, (method, rref, *args))


def rpc_async_method(method, rref, *args):
    return rpc.rpc_async(rref.owner(), _call_method, (method, rref, *args))


def grad_is_none(rref) -> bool:
    return rref.local_value().grad is None


def grad_layouts(context_id: int) -> list[torch.layout]:
    return [g.layout for g in dist_autograd.get_gradients(context_id).values()]


class FailingOptimizer(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure=None):
        raise ValueError("Error running optimizer.")


class OptimizerFailingOnConstructor(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {})
        raise ValueError("Error creating optimizer.")


class SGDFailingOn(torch.optim.SGD):
    """Fails on worker ``fail_on``; elsewhere steps slowly (so an early raise would show)."""

    def __init__(self, params, fail_on: str, lr: float):
        super().__init__(params, lr=lr)
        self.fail_on = fail_on

    def step(self, closure=None):
        if rpc.get_worker_info().name == self.fail_on:
            raise ValueError(f"Error running optimizer on {self.fail_on}.")
        time.sleep(0.2)
        return super().step(closure)


class ProbeSGD(torch.optim.SGD):
    """SGD that records how many steps ran at once in this process."""

    lock = threading.Lock()
    active = 0
    max_active = 0

    def step(self, closure=None):
        with ProbeSGD.lock:
            ProbeSGD.active += 1
            ProbeSGD.max_active = max(ProbeSGD.max_active, ProbeSGD.active)
        time.sleep(0.005)
        try:
            return super().step(closure)
        finally:
            with ProbeSGD.lock:
                ProbeSGD.active -= 1


def probe_max_active() -> int:
    return ProbeSGD.max_active


def reset_probe() -> None:
    ProbeSGD.max_active = 0


# ---------------------------------------------------------------------------
# Matching the local optimizer


OPTIMIZERS = [
    pytest.param(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}, id="SGD-momentum"),
    pytest.param(
        torch.optim.SGD,
        {"lr": 1e-3, "momentum": 1, "weight_decay": 1, "nesterov": True},
        id="SGD-nesterov-wd",
    ),
    pytest.param(torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}, id="Adam-amsgrad"),
    pytest.param(torch.optim.AdamW, {"lr": 0.05, "amsgrad": True}, id="AdamW-amsgrad"),
    pytest.param(torch.optim.RMSprop, {"lr": 0.05}, id="RMSprop"),
    pytest.param(torch.optim.Adagrad, {"lr": 0.05}, id="Adagrad"),
    pytest.param(torch.optim.Adadelta, {"rho": 0.95}, id="Adadelta"),
    pytest.param(torch.optim.Adamax, {"lr": 0.05}, id="Adamax"),
    pytest.param(torch.optim.Rprop, {"lr": 0.05}, id="Rprop"),
]


@pytest.mark.parametrize(("optim_cls", "kwargs"), OPTIMIZERS)
def test_dist_optim_matches_local_optimizer(rpc_world, optim_cls, kwargs):
    local1, local2 = MyModule(), MyModule()
    local_optim = optim_cls([local1.w, local2.w], **kwargs)
    module1 = rpc.remote(rpc_world.peer(1), MyModule)
    module2 = rpc.remote(rpc_world.peer(2), MyModule)
    w1 = remote_method(MyModule.get_w, module1)
    w2 = remote_method(MyModule.get_w, module2)
    assert torch.equal(w1.to_here(), local1.w) and torch.equal(w2.to_here(), local2.w)
    old_w1, old_w2 = w1.to_here().detach().clone(), w2.to_here().detach().clone()
    dist_optim = DistributedOptimizer(optim_cls, [w1, w2], **kwargs)

    g = torch.Generator().manual_seed(rpc_world.rank)
    for _ in range(3):
        t1, t2 = torch.rand((3, 3), generator=g), torch.rand((3, 3), generator=g)
        local_optim.zero_grad()
        torch.add(local2.forward(local1.forward(t2)), t1).sum().backward()
        local_optim.step()
        with dist_autograd.context() as context_id:
            out1 = rpc_async_method(MyModule.forward, module1, t2).wait()
            out2 = rpc_async_method(MyModule.forward, module2, out1).wait()
            dist_autograd.backward(context_id, [torch.add(out2, t1).sum()])
            dist_optim.step(context_id)

    new_w1, new_w2 = w1.to_here(), w2.to_here()
    assert not torch.equal(new_w1, old_w1) and not torch.equal(new_w2, old_w2)
    torch.testing.assert_close(new_w1, local1.w.detach())
    torch.testing.assert_close(new_w2, local2.w.detach())
    # Gradients live in the context: the step does not leave them on ``.grad``.
    assert rpc.rpc_sync(w1.owner(), grad_is_none, (w1,))


@pytest.mark.parametrize(
    "optim_cls",
    [
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.RMSprop,
        torch.optim.Rprop,
        torch.optim.Adadelta,
    ],
)
def test_dist_optim_leaves_params_without_grad_unchanged(rpc_world, optim_cls):
    kwargs = {} if optim_cls is torch.optim.Adadelta else {"lr": 0.05}
    local1, local2 = MyModule(), MyModule(requires_grad=False)
    local_optim = optim_cls([local1.w, local2.w], **kwargs)
    module1 = rpc.remote(rpc_world.peer(1), MyModule)
    module2 = rpc.remote(rpc_world.peer(2), MyModule, (False,))
    w1 = module1.remote().get_w()
    w2 = module2.remote().get_w()
    old_w1, old_w2 = w1.to_here().detach().clone(), w2.to_here().detach().clone()
    dist_optim = DistributedOptimizer(optim_cls, [w1, w2], **kwargs)

    t1, t2 = torch.rand((3, 3)), torch.rand((3, 3))
    local_optim.zero_grad()
    torch.add(local2.forward(local1.forward(t2)), t1).sum().backward()
    local_optim.step()
    with dist_autograd.context() as context_id:
        out1 = module1.rpc_async().forward(t2).wait()
        out2 = module2.rpc_async().forward(out1).wait()
        dist_autograd.backward(context_id, [torch.add(out2, t1).sum()])
        dist_optim.step(context_id)

    new_w1, new_w2 = w1.to_here(), w2.to_here()
    assert not torch.equal(new_w1, old_w1)
    assert torch.equal(new_w2, old_w2)
    torch.testing.assert_close(new_w1, local1.w.detach())
    assert torch.equal(new_w2, local2.w)


def test_local_and_remote_parameters_in_one_optimizer(rpc_world):
    local_w, reference = MyModule(), MyModule()
    remote_module = rpc.remote(rpc_world.peer(1), MyModule)
    remote_w = remote_module.remote().get_w()
    local_ref = MyModule()
    dist_optim = DistributedOptimizer(torch.optim.Adam, [rpc.RRef(local_w.w), remote_w], lr=0.1)
    local_optim = torch.optim.Adam([reference.w, local_ref.w], lr=0.1)
    for _ in range(2):
        t = torch.rand((3, 3))
        local_optim.zero_grad()
        local_ref.forward(reference.forward(t)).sum().backward()
        local_optim.step()
        with dist_autograd.context() as context_id:
            out = remote_module.rpc_sync().forward(local_w.forward(t))
            dist_autograd.backward(context_id, [out.sum()])
            dist_optim.step(context_id)
    torch.testing.assert_close(local_w.w.detach(), reference.w.detach())
    torch.testing.assert_close(remote_w.to_here(), local_ref.w.detach())
    assert local_w.w.grad is None


# ---------------------------------------------------------------------------
# Errors


def test_constructor_error_is_raised_on_caller(rpc_world):
    module1 = rpc.remote(rpc_world.peer(1), MyModule)
    module2 = rpc.remote(rpc_world.peer(2), MyModule)
    params = [module1.remote().get_w(), module2.remote().get_w()]
    with pytest.raises(ValueError, match="Error creating optimizer."):
        DistributedOptimizer(OptimizerFailingOnConstructor, params)


def test_step_error_is_raised_on_caller(rpc_world):
    module1 = rpc.remote(rpc_world.peer(1), MyModule)
    module2 = rpc.remote(rpc_world.peer(2), MyModule)
    w1, w2 = module1.remote().get_w(), module2.remote().get_w()
    dist_optim = DistributedOptimizer(FailingOptimizer, [w1, w2])
    with dist_autograd.context() as context_id:
        t1, t2 = torch.rand((3, 3)), torch.rand((3, 3))
        out1 = rpc_async_method(MyModule.forward, module1, t2).wait()
        out2 = rpc_async_method(MyModule.forward, module2, out1).wait()
        dist_autograd.backward(context_id, [torch.add(out2, t1).sum()])
        with pytest.raises(ValueError, match="Error running optimizer"):
            dist_optim.step(context_id)


def test_step_waits_for_every_owner_before_raising(rpc_world):
    failing, slow = rpc_world.peer(1), rpc_world.peer(2)  # slow is this rank on 2 ranks
    module1 = rpc.remote(failing, MyModule)
    module2 = rpc.remote(slow, MyModule)
    w1, w2 = module1.remote().get_w(), module2.remote().get_w()
    old_w2 = w2.to_here().detach().clone()
    dist_optim = DistributedOptimizer(SGDFailingOn, [w1, w2], failing, lr=0.5)
    with dist_autograd.context() as context_id:
        out = module2.rpc_sync().forward(module1.rpc_sync().forward(torch.ones(3, 3)))
        dist_autograd.backward(context_id, [out.sum()])
        with pytest.raises(ValueError, match=f"Error running optimizer on {failing}"):
            dist_optim.step(context_id)
    # The slow owner's step finished before step() raised.
    assert not torch.equal(w2.to_here(), old_w2)


def test_step_with_unknown_context_raises(rpc_world):
    module1 = rpc.remote(rpc_world.peer(1), MyModule)
    dist_optim = DistributedOptimizer(torch.optim.SGD, [module1.remote().get_w()], lr=0.1)
    with pytest.raises(RuntimeError, match="Could not find autograd context with id: 123456"):
        dist_optim.step(123456)
    with dist_autograd.context() as context_id:
        pass
    with pytest.raises(
        RuntimeError, match=f"Could not find autograd context with id: {context_id}"
    ):
        dist_optim.step(context_id)


def test_params_rref_entries_must_be_rrefs(rpc_world):
    w = rpc.remote(rpc_world.peer(1), MyModule).remote().get_w()
    with pytest.raises(TypeError, match=r"params_rref\[1\] is a Tensor, not an RRef") as info:
        DistributedOptimizer(torch.optim.SGD, [w, torch.ones(2)], lr=0.1)
    assert "RRef(param)" in str(info.value) and "remote_parameters()" in str(info.value)
    with pytest.raises(TypeError, match=r"params_rref\[0\] is a Parameter"):
        DistributedOptimizer(torch.optim.SGD, [torch.nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(TypeError, match="params_rref must be a list of RRefs"):
        DistributedOptimizer(torch.optim.SGD, w, lr=0.1)
    with pytest.raises(ValueError, match="empty params_rref"):
        DistributedOptimizer(torch.optim.SGD, [], lr=0.1)


def make_dict():
    return {"weight": torch.ones(2)}


def test_params_rref_values_must_be_tensors(rpc_world, monkeypatch):
    owner = rpc_world.peer(1)
    w = rpc.remote(owner, MyModule).remote().get_w()
    not_tensors = [
        rpc.remote(owner, make_dict),
        rpc.RRef(torch.nn.Parameter(torch.ones(2))),
        rpc.remote(owner, MyModule),
        rpc.RRef([torch.ones(2)]),
    ]
    params = [w, not_tensors[0], not_tensors[1]]
    # One RPC per remote owner: the check rides on the optimizer's construction.
    sent, invoke, me = [], dispatch.invoke, threading.get_ident()

    def counting_invoke(to, func, *args, **kwargs):
        if threading.get_ident() == me:  # not the requests this rank serves meanwhile
            sent.append(func.__name__)
        return invoke(to, func, *args, **kwargs)

    monkeypatch.setattr(dispatch, "invoke", counting_invoke)
    with pytest.raises(TypeError) as info:
        DistributedOptimizer(torch.optim.SGD, params, lr=0.1)
    assert sent == ["_new_local_optimizer"]
    assert str(info.value) == (
        f"DistributedOptimizer: params_rref[1] (owned by {owner}) holds a dict, not a tensor; "
        "pass RRefs to parameters, e.g. RemoteModule.remote_parameters()"
    )
    monkeypatch.undo()
    # A local RRef to a list, and several bad entries: the first is named, the others counted.
    with pytest.raises(
        TypeError,
        match=rf"params_rref\[0\] \(owned by {rpc_world.name}\) holds "
        r"a list, not a tensor; .* \(2 more entries hold no "
        r"tensor either\)$",
    ):
        DistributedOptimizer(
            torch.optim.SGD, [not_tensors[3], w, not_tensors[2], not_tensors[0]], lr=0.1
        )
    # Parameters and plain tensors, local or remote, are accepted.
    DistributedOptimizer(torch.optim.SGD, [w, not_tensors[1]], lr=0.1)


def test_optimizer_class_must_be_an_optimizer_subclass(rpc_world):
    p = torch.nn.Parameter(torch.ones(2))
    w = rpc.RRef(p)
    for bad in (torch.optim.SGD([p], lr=0.1), torch.nn.Linear, "SGD", None):
        with pytest.raises(
            TypeError, match="optimizer_class must be a subclass of torch.optim.Optimizer"
        ):
            DistributedOptimizer(bad, [w], lr=0.1)


# ---------------------------------------------------------------------------
# Concurrency


def test_concurrent_steps_are_serialised_per_worker(rpc_world):
    rpc.rpc_sync(rpc_world.peer(1), reset_probe)
    rpc_world.barrier()
    owner = rpc.remote(rpc_world.peer(1), MyModule, (True, torch.zeros(3, 3)))
    w = owner.remote().get_w()
    dist_optim = DistributedOptimizer(ProbeSGD, [w], lr=1.0)
    errors = []

    def train(k: int) -> None:
        try:
            with dist_autograd.context() as context_id:
                out = owner.rpc_sync().forward(torch.eye(3) * k)  # d(sum)/dw = k per entry
                dist_autograd.backward(context_id, [out.sum()])
                dist_optim.step(context_id)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=train, args=(k,)) for k in range(1, 6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    # Steps of different threads (and of other ranks' optimizers on this owner) never overlapped,
    # and every one applied its own gradient: 0 - (1 + 2 + 3 + 4 + 5).
    assert torch.equal(w.to_here(), torch.full((3, 3), -15.0))
    rpc_world.barrier()
    assert rpc.rpc_sync(rpc_world.peer(1), probe_max_active) == 1


# ---------------------------------------------------------------------------
# State dicts


def test_state_dict_round_trip_resumes_identically(rpc_world):
    owners = [rpc_world.peer(1), rpc_world.peer(2)]

    def build(ws=None):
        modules = [
            rpc.remote(o, MyModule, (True, None if ws is None else ws[i]))
            for i, o in enumerate(owners)
        ]
        return modules, [m.remote().get_w() for m in modules]

    def train_step(modules, optim, t):
        with dist_autograd.context() as context_id:
            out = modules[1].rpc_sync().forward(modules[0].rpc_sync().forward(t))
            dist_autograd.backward(context_id, [out.sum()])
            optim.step(context_id)

    modules_a, params_a = build()
    optim_a = DistributedOptimizer(torch.optim.Adam, params_a, lr=0.05)
    for _ in range(2):
        train_step(modules_a, optim_a, torch.rand(3, 3))
    state = optim_a.state_dict()
    assert set(state) == set(owners)
    for sd in state.values():
        assert sd["state"][0]["step"] == 2 and sd["param_groups"][0]["lr"] == 0.05

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    modules_b, params_b = build([p.to_here() for p in params_a])
    optim_b = DistributedOptimizer(torch.optim.Adam, params_b, lr=0.05)
    optim_b.load_state_dict(loaded)
    t = torch.rand(3, 3)
    train_step(modules_a, optim_a, t)
    train_step(modules_b, optim_b, t)
    for pa, pb in zip(params_a, params_b, strict=True):
        assert torch.equal(pa.to_here(), pb.to_here())

    with pytest.raises(ValueError, match="Missing: .*unexpected: \\['nobody'\\]"):
        optim_b.load_state_dict({"nobody": {}})


# ---------------------------------------------------------------------------
# Sparse gradients: an EmbeddingBag(sparse=True) on a parameter server


NUM_EMBEDDINGS, EMBEDDING_DIM = 20, 4


def _sparse_bags(owner: str) -> tuple[torch.nn.EmbeddingBag, RemoteModule]:
    """A sparse EmbeddingBag here and one on ``owner``, with the same weights."""
    local = torch.nn.EmbeddingBag(NUM_EMBEDDINGS, EMBEDDING_DIM, mode="sum", sparse=True)
    remote = RemoteModule(
        owner,
        torch.nn.EmbeddingBag,
        (NUM_EMBEDDINGS, EMBEDDING_DIM),
        {"mode": "sum", "sparse": True},
    )
    remote.load_remote_state_dict(local.state_dict())
    return local, remote


def _batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    indices = torch.randint(0, NUM_EMBEDDINGS, (12,), generator=g)
    return indices, torch.tensor([0, 3, 7])


@pytest.mark.parametrize(
    ("optim_cls", "kwargs"),
    [
        pytest.param(torch.optim.SGD, {"lr": 0.1}, id="SGD"),
        pytest.param(torch.optim.SparseAdam, {"lr": 0.05}, id="SparseAdam"),
    ],
)
def test_sparse_embedding_bag_on_parameter_server(rpc_world, optim_cls, kwargs):
    ps = rpc_world.names[-1]
    local, remote = _sparse_bags(ps)
    local_optim = optim_cls(local.parameters(), **kwargs)
    dist_optim = DistributedOptimizer(optim_cls, remote.remote_parameters(), **kwargs)
    g = torch.Generator().manual_seed(rpc_world.rank)
    for step in range(3):
        indices, offsets = _batch(g)
        target = torch.randn(3, EMBEDDING_DIM, generator=g)
        local_optim.zero_grad()
        ((local(indices, offsets) - target) ** 2).sum().backward()
        local_optim.step()
        with dist_autograd.context() as context_id:
            loss = ((remote(indices, offsets) - target) ** 2).sum()
            dist_autograd.backward(context_id, [loss])
            if step == 0:
                assert rpc.rpc_sync(ps, grad_layouts, (context_id,)) == [torch.sparse_coo]
            dist_optim.step(context_id)
    torch.testing.assert_close(remote.remote_state_dict()["weight"], local.weight.detach())


def test_sparse_gradients_accumulate_over_backward_passes(rpc_world):
    ps = rpc_world.names[-1]
    local, remote = _sparse_bags(ps)
    indices, offsets = _batch(torch.Generator().manual_seed(rpc_world.rank))
    (local(indices, offsets).pow(2).sum() * 2).backward()
    dist_optim = DistributedOptimizer(torch.optim.SGD, remote.remote_parameters(), lr=1.0)
    with dist_autograd.context() as context_id:
        loss = remote(indices, offsets).pow(2).sum()
        dist_autograd.backward(context_id, [loss], retain_graph=True)
        dist_autograd.backward(context_id, [loss])
        dist_optim.step(context_id)
    expected = local.weight.detach() - local.weight.grad.to_dense()
    torch.testing.assert_close(remote.remote_state_dict()["weight"], expected)


def dense_rows(module_rref) -> torch.Tensor:
    return module_rref.local_value().weight[:2] * 2


def test_leaf_with_sparse_and_dense_gradients_from_two_rpcs(rpc_world):
    ps = rpc_world.names[-1]
    local, remote = _sparse_bags(ps)
    indices, offsets = _batch(torch.Generator().manual_seed(rpc_world.rank))
    (local(indices, offsets).sum() + (local.weight[:2] * 2).sum()).backward()
    dist_optim = DistributedOptimizer(torch.optim.SGD, remote.remote_parameters(), lr=1.0)
    with dist_autograd.context() as context_id:
        sparse_part = remote(indices, offsets)  # sparse gradient first ...
        dense_part = rpc.rpc_sync(ps, dense_rows, (remote.get_module_rref(),))  # ... then dense
        dist_autograd.backward(context_id, [sparse_part.sum() + dense_part.sum()])
        dist_optim.step(context_id)
    expected = local.weight.detach() - local.weight.grad.to_dense()
    torch.testing.assert_close(remote.remote_state_dict()["weight"], expected)
