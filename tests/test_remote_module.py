"""RemoteModule: torch's remote_module_test cases (CPU, no TorchScript), plus training.

Every rank runs each test at the same time and places its modules on its
neighbours; on 2 ranks ``peer(2)`` is the rank itself.
"""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from torch import nn

from lightning_distgrad import autograd as dist_autograd
from lightning_distgrad import rpc
from lightning_distgrad.nn import RemoteModule
from lightning_distgrad.nn.remote_module import (
    _REMOTE_MODULE_PICKLED_ATTRIBUTES,
    _UNSUPPORTED_METHODS,
)
from lightning_distgrad.optim import DistributedOptimizer

pytestmark = pytest.mark.mpi(min_size=2)


# ---------------------------------------------------------------------------
# Modules and remote helpers (module level: the callee imports them by name)


class MyModule(nn.Module):
    def __init__(self, first_arg, first_kwarg=-1):
        super().__init__()
        self.param1 = nn.Parameter(torch.ones(1))

    def forward(self, tensor, number, word="default"):
        return word, number, tensor

    def is_training(self):
        return self.training


class BadModule:
    def __init__(self, first_arg, first_kwarg=-1):
        pass


class Encoder(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16))


def remote_module_attributes(remote_module: RemoteModule) -> list[str]:
    return list(remote_module.__dict__)


def remote_module_fields(remote_module: RemoteModule) -> dict:
    return {
        k: getattr(remote_module, k) for k in ("on", "device", "is_device_map_set", "is_scriptable")
    }


def remote_forward(remote_module: RemoteModule, args: tuple):
    return remote_module.forward(*args)


def remote_forward_async(remote_module: RemoteModule, args: tuple):
    return remote_module.forward_async(*args).wait()


def remote_call(remote_module: RemoteModule, args: tuple):
    return remote_module(*args)


def has_attribute(remote_module: RemoteModule, name: str) -> bool:
    return name in remote_module.__dict__


def is_training(module_rref: rpc.RRef) -> bool:
    return module_rref.local_value().training


def _destinations(rpc_world) -> list[str]:
    peer = rpc_world.peer(1)
    return [f"{peer}/cpu", peer, f"rank:{rpc_world.peer_rank(1)}/cpu"]


def _create(dst: str, cls=MyModule) -> RemoteModule:
    return RemoteModule(dst, cls, (1,), {"first_kwarg": 2})


ARGS = (torch.ones(1), 2, "3")


# ---------------------------------------------------------------------------
# Construction


def test_bad_module_raises_at_first_use(rpc_world):
    for dst in _destinations(rpc_world):
        with pytest.raises(
            ValueError,
            match=r"Expect `module_cls\(\*args, \*\*kwargs\)` returns "
            r"an instance of <class nn.Module>, but it returns "
            r"an instance of <class '.*BadModule'>",
        ):
            _create(dst, BadModule).forward()


@pytest.mark.parametrize(
    "bad",
    [
        "worker1/cpu/0",
        "/cpu",
        "rank:x/cpu",
        "rank:1:2/cpu",
        "worker1:1/cpu",
        "worker1/not_a_device",
        "rank:/cpu",
        "",
    ],
)
def test_malformed_remote_device_raises(rpc_world, bad):
    expected = (
        f"Could not parse remote_device: {bad}. The valid format is "
        "'<workername>/<device>' or 'rank:<rank>/<device>' or '<device>'"
    )
    with pytest.raises(ValueError) as info:
        RemoteModule(bad, MyModule, (1,))
    assert str(info.value) == expected


def test_unknown_worker_raises_at_construction(rpc_world):
    with pytest.raises(
        ValueError,
        match="'nobody/cpu' names a worker that is not in this RPC "
        "job. Known workers: worker0 \\(rank 0\\)",
    ):
        RemoteModule("nobody/cpu", MyModule, (1,))
    with pytest.raises(ValueError, match="'rank:99/cpu' names a worker that is not in this RPC"):
        RemoteModule("rank:99/cpu", MyModule, (1,))


def test_remote_device_forms_set_on_and_device(rpc_world):
    peer, peer_rank = rpc_world.peer(1), rpc_world.peer_rank(1)
    m = _create(f"{peer}/cpu")
    assert (m.on, m.device, m.is_device_map_set, m.is_scriptable) == (peer, "cpu", False, False)
    m = _create(peer)
    assert (m.on, m.device) == (peer, "cpu")
    m = _create(f"rank:{peer_rank}/cpu")
    assert (m.on, m.device) == (peer_rank, "cpu")
    assert m.get_module_rref().owner().name == peer
    # A bare device places the module on this worker.
    m = _create("cpu")
    assert m.on == rpc_world.name and m.get_module_rref().is_owner()
    assert m.forward(*ARGS) == ("3", 2, torch.ones(1))


# ---------------------------------------------------------------------------
# Forward


def test_forward_sync(rpc_world):
    for dst in _destinations(rpc_world):
        assert _create(dst).forward(*ARGS) == tuple(reversed(ARGS))


def test_forward_async(rpc_world):
    for dst in _destinations(rpc_world):
        fut = _create(dst).forward_async(*ARGS)
        assert isinstance(fut, torch.futures.Future)
        assert fut.wait() == tuple(reversed(ARGS))


def test_forward_with_kwargs(rpc_world):
    for dst in _destinations(rpc_world):
        m = _create(dst)
        assert m.forward(torch.ones(1), 2, word="3") == ("3", 2, torch.ones(1))
        assert m.forward_async(torch.ones(1), number=2).wait() == ("default", 2, torch.ones(1))
        assert m(torch.ones(1), 2, word="x") == ("x", 2, torch.ones(1))  # nn.Module.__call__


class Hybrid(nn.Module):
    def __init__(self, encoder: RemoteModule):
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.encoder(x))


def test_remote_module_as_submodule_of_a_local_module(rpc_world):
    model = Hybrid(RemoteModule(rpc_world.peer(1), Encoder))
    assert model(torch.randn(5, 8)).shape == (5, 1)
    model.eval()
    assert not rpc.rpc_sync(rpc_world.peer(1), is_training, (model.encoder.get_module_rref(),))


# ---------------------------------------------------------------------------
# Remote state


def test_remote_parameters(rpc_world):
    for dst in _destinations(rpc_world):
        param_rrefs = _create(dst).remote_parameters()
        assert len(param_rrefs) == 1
        assert all(isinstance(r, rpc.RRef) for r in param_rrefs)
        assert torch.equal(param_rrefs[0].to_here(), torch.ones(1))
    encoder = RemoteModule(rpc_world.peer(1), Encoder)
    assert len(encoder.remote_parameters()) == 4
    assert len(encoder.remote_parameters(recurse=False)) == 0


def test_get_module_rref(rpc_world):
    for dst in _destinations(rpc_world):
        m = _create(dst)
        rref = m.get_module_rref()
        assert rref is m.module_rref
        for param in rref.to_here().parameters():
            assert torch.equal(param, torch.ones(1))


def test_train_eval(rpc_world):
    for dst in _destinations(rpc_world):
        m = _create(dst)
        owner = m.get_module_rref().owner()
        assert m.train() is m
        assert rpc.rpc_sync(owner, is_training, (m.get_module_rref(),))
        assert m.eval() is m and not m.training
        assert not rpc.rpc_sync(owner, is_training, (m.get_module_rref(),))
        m.train(True)
        assert rpc.rpc_sync(owner, is_training, (m.get_module_rref(),))


def test_remote_state_dict_round_trip(rpc_world):
    local = Encoder()
    remote = RemoteModule(rpc_world.peer(1), Encoder)
    state = remote.remote_state_dict()
    assert list(state) == list(local.state_dict())
    result = remote.load_remote_state_dict(local.state_dict())
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    for k, v in remote.remote_state_dict().items():
        assert torch.equal(v, local.state_dict()[k])
    x = torch.randn(3, 8)
    assert torch.equal(remote(x), local(x))
    partial = {"0.weight": torch.zeros(16, 8)}
    with pytest.raises(RuntimeError, match="Missing key"):
        remote.load_remote_state_dict(partial)
    result = remote.load_remote_state_dict(partial, strict=False)
    assert "0.bias" in result.missing_keys
    assert torch.equal(remote.remote_state_dict()["0.weight"], torch.zeros(16, 8))


# ---------------------------------------------------------------------------
# Unsupported nn.Module methods


def test_unsupported_methods(rpc_world):
    m = _create(rpc_world.peer(1))
    with pytest.raises(
        ValueError,
        match=r"^Method ``parameters`` not supported for "
        r"RemoteModule. Please use ``remote_parameters`` "
        r"instead.$",
    ):
        m.parameters()
    calls = {
        "register_buffer": ("b", torch.ones(1)),
        "register_parameter": ("p", None),
        "add_module": ("m", nn.Linear(1, 1)),
        "apply": (lambda mod: None,),
        "cuda": (),
        "ipu": (),
        "xpu": (),
        "cpu": (),
        "type": (torch.float,),
        "float": (),
        "double": (),
        "half": (),
        "bfloat16": (),
        "to": ("cpu",),
        "register_backward_hook": (None,),
        "register_forward_pre_hook": (None,),
        "register_forward_hook": (None,),
        "state_dict": (),
        "load_state_dict": ({},),
        "named_parameters": (),
        "buffers": (),
        "named_buffers": (),
        "children": (),
        "named_children": (),
        "modules": (),
        "named_modules": (),
        "requires_grad_": (),
        "zero_grad": (),
        "share_memory": (),
        "extra_repr": (),
    }
    assert set(calls) == set(_UNSUPPORTED_METHODS)
    for name, args in calls.items():
        with pytest.raises(ValueError, match=f"^Method ``{name}`` not supported for RemoteModule"):
            getattr(m, name)(*args)
    with pytest.raises(ValueError, match="Please use ``remote_state_dict`` instead"):
        m.state_dict()
    assert repr(m) == f"RemoteModule(on={rpc_world.peer(1)!r}, device='cpu')"


# ---------------------------------------------------------------------------
# Pickling


def test_python_pickle_and_torch_save_are_not_supported(rpc_world):
    m = _create(rpc_world.peer(1))
    message = (
        "Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled "
        "when using RPC"
    )
    with pytest.raises(RuntimeError, match=message):
        torch.save(m, io.BytesIO())
    with pytest.raises(RuntimeError, match=message):
        pickle.dumps(m)


def test_remote_module_round_trips_through_rpc(rpc_world):
    m = _create(rpc_world.peer(1))
    back = rpc.rpc_sync(rpc_world.peer(1), remote_forward, (m, ARGS))
    assert back == tuple(reversed(ARGS))
    echoed = rpc.rpc_sync(rpc_world.peer(1), _echo, (m,))
    assert isinstance(echoed, RemoteModule) and echoed is not m
    assert echoed.get_module_rref().owner() == m.get_module_rref().owner()
    assert echoed.forward(*ARGS) == tuple(reversed(ARGS))


def _echo(obj):
    return obj


@pytest.mark.mpi(min_size=3)
def test_send_remote_module_over_the_wire(rpc_world):
    owner, third = rpc_world.peer(1), rpc_world.peer(2)
    m = _create(f"{owner}/cpu")
    attrs = rpc.rpc_sync(third, remote_module_attributes, (m,))
    # As torch's: exactly the pickled attributes, then the installed methods.
    assert list(attrs) == [*_REMOTE_MODULE_PICKLED_ATTRIBUTES, "forward_async", "forward"]
    fields = rpc.rpc_sync(third, remote_module_fields, (m,))
    assert fields == {
        "on": owner,
        "device": "cpu",
        "is_device_map_set": False,
        "is_scriptable": False,
    }
    # The third worker uses the module that lives on the owner.
    assert rpc.rpc_sync(third, remote_forward, (m, ARGS)) == tuple(reversed(ARGS))
    assert rpc.rpc_sync(third, remote_forward_async, (m, ARGS)) == tuple(reversed(ARGS))
    assert rpc.rpc_sync(third, remote_call, (m, ARGS)) == tuple(reversed(ARGS))


@pytest.mark.mpi(min_size=3)
def test_new_attribute_is_not_pickled_over_the_wire(rpc_world):
    m = _create(rpc_world.peer(1))
    m.new_attr = 1
    with pytest.warns(UserWarning, match="new attribute ``new_attr`` of RemoteModule is ignored"):
        assert not rpc.rpc_sync(rpc_world.peer(2), has_attribute, (m, "new_attr"))
    with pytest.warns(UserWarning):
        assert rpc.rpc_sync(rpc_world.peer(2), remote_forward, (m, ARGS)) == tuple(reversed(ARGS))


@pytest.mark.mpi(min_size=3)
def test_create_remote_module_from_module_rref(rpc_world):
    owner, third = rpc_world.peer(1), rpc_world.peer(2)
    m = _create(f"{owner}/cpu")
    shared = rpc.rpc_sync(
        third, RemoteModule.init_from_module_rref, (f"{owner}/cpu", m.get_module_rref())
    )
    assert shared.forward(*ARGS) == tuple(reversed(ARGS))
    assert shared.get_module_rref().owner().name == owner
    local = RemoteModule.init_from_module_rref(owner, m.get_module_rref())
    assert local.forward_async(*ARGS).wait() == tuple(reversed(ARGS))
    assert rpc.rpc_sync(third, remote_forward, (local, ARGS)) == tuple(reversed(ARGS))


def test_init_from_module_rref_on_another_worker_uses_the_owner(rpc_world):
    # As torch's: a remote_device that names a worker other than the module's owner is
    # accepted (torch's own test names the worker that calls it); every call reaches
    # the module where it lives.
    owner = rpc_world.peer(1)
    m = _create(owner)
    here = RemoteModule.init_from_module_rref(rpc_world.name, m.get_module_rref())
    assert here.on == rpc_world.name and here.get_module_rref().owner().name == owner
    assert here.forward(*ARGS) == tuple(reversed(ARGS))
    assert here.forward_async(*ARGS).wait() == tuple(reversed(ARGS))
    [param] = [p.to_here() for p in here.remote_parameters()]
    assert torch.equal(param, torch.ones(1))
    assert sorted(here.remote_state_dict()) == ["param1"]
    here.eval()
    assert not m.get_module_rref().rpc_sync().is_training()
    here.train()
    assert m.get_module_rref().rpc_sync().is_training()
    with pytest.raises(TypeError, match="module_rref must be an RRef"):
        RemoteModule.init_from_module_rref(rpc_world.peer(1), m)


# ---------------------------------------------------------------------------
# Training: RemoteModule + distributed backward + DistributedOptimizer


def test_training_matches_local_module_trained_with_sgd(rpc_world):
    torch.manual_seed(1000 + rpc_world.rank)
    local_encoder, head = Encoder(), nn.Linear(16, 1)
    reference = nn.Sequential(Encoder(), nn.Linear(16, 1))
    reference[0].load_state_dict(local_encoder.state_dict())
    reference[1].load_state_dict(head.state_dict())
    remote_encoder = RemoteModule(rpc_world.peer(1), Encoder)
    remote_encoder.load_remote_state_dict(local_encoder.state_dict())
    model = Hybrid(remote_encoder)
    model.head = head

    params = remote_encoder.remote_parameters() + [rpc.RRef(p) for p in head.parameters()]
    dist_optim = DistributedOptimizer(torch.optim.SGD, params, lr=0.05, momentum=0.9)
    local_optim = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for _ in range(6):
        x, y = torch.randn(10, 8), torch.randn(10, 1)
        local_optim.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        local_optim.step()
        with dist_autograd.context() as context_id:
            loss = nn.functional.mse_loss(model(x), y)
            dist_autograd.backward(context_id, [loss])
            dist_optim.step(context_id)

    trained = remote_encoder.remote_state_dict()
    for k, v in reference[0].state_dict().items():
        torch.testing.assert_close(trained[k], v, atol=1e-5, rtol=0)
    for k, v in reference[1].state_dict().items():
        torch.testing.assert_close(head.state_dict()[k], v, atol=1e-5, rtol=0)
    assert not torch.equal(trained["0.weight"], local_encoder.state_dict()["0.weight"])
