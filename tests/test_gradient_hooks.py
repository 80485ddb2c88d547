"""torch features that act on gradients outside the autograd graph, inside a distributed pass.

Each gives torch's distributed autograd result, compared with plain local torch on the same
values (the context's gradients against a local backward's), or raises an error that says what
to do; none trains wrong quietly. Every forward pass takes its input from the next rank over RPC,
so the gradients travel and the engine's general path runs, and ``.grad`` must stay untouched.

* ``Tensor.register_post_accumulate_grad_hook``: raises (it runs when AccumulateGrad writes
  ``.grad``, which a distributed pass never does; torch's engine skips such hooks silently).
* AccumulateGrad pre-hooks (``node.register_prehook``) change the gradient the context gets, as
  in torch's engine.
* ``torch.utils.checkpoint``: ``use_reentrant=False`` gives local torch's gradients;
  ``use_reentrant=True`` raises torch's own error (it cannot run under ``torch.autograd.grad``,
  in torch's distributed engine either), which names the fix.
* ``torch.amp.GradScaler`` with a local optimizer reading the context's gradients.
* ``torch.nn.utils.parametrizations.weight_norm``.
* A module under ``torch.compile`` (backends ``eager`` and ``aot_eager``: the compiled backward
  of ``aot_eager`` is the custom autograd function inductor's would be, without compiling C++
  on every rank of a test job).
* FSDP (``FullyShardedDataParallel`` and ``fully_shard``): raises (it reduce-scatters ``.grad``
  at the end of a local backward); ``fully_shard`` is skipped on torch 2.5, whose FSDP2 needs
  CUDA.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from _dist_utils import gloo_process_group, mlp
from torch import nn
from torch.utils.checkpoint import checkpoint

import lightning_distgrad.autograd as dist_autograd
from lightning_distgrad import rpc

pytestmark = pytest.mark.mpi(min_size=2)


def batch(world) -> torch.Tensor:
    return torch.randn((5, 4), generator=torch.Generator().manual_seed(world.rank))


def distributed_grads(world, forward, module: nn.Module, x: torch.Tensor) -> dict:
    """``forward(module, h)`` on ``h = sin(x)`` computed by the next rank; the context's
    gradients of ``module``'s parameters and of ``x``, by name."""
    x = x.detach().clone().requires_grad_()
    with dist_autograd.context() as context_id:
        h = rpc.rpc_sync(world.peer(), torch.sin, (x,))
        dist_autograd.backward(context_id, [forward(module, h)])
        grads = dist_autograd.get_gradients(context_id)
        named = {n: grads.get(p) for n, p in module.named_parameters()}
        named["x"] = grads.get(x)
    assert all(p.grad is None for p in module.parameters()), ".grad changed"
    return named


def local_grads(forward, module: nn.Module, x: torch.Tensor) -> dict:
    """The same with plain local autograd on a copy."""
    module = copy.deepcopy(module)
    x = x.detach().clone().requires_grad_()
    forward(module, torch.sin(x)).backward()
    named = {n: p.grad for n, p in module.named_parameters()}
    named["x"] = x.grad
    return named


def assert_same_grads(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for name, e in expected.items():
        if e is None:
            assert got[name] is None, f"{name}: a gradient where local torch has none"
        else:
            torch.testing.assert_close(got[name], e, msg=lambda m, n=name: f"{n}: {m}")


def plain(module: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return module(h).square().mean()


# ---------------------------------------------------------------------------


def test_post_accumulate_grad_hook_raises(rpc_world):
    net = mlp()
    calls = []
    net[0].weight.register_post_accumulate_grad_hook(calls.append)
    for remote in (True, False):  # the general pass and a context that exchanged nothing
        with dist_autograd.context() as context_id:
            h = rpc.rpc_sync(rpc_world.peer(), torch.sin, (batch(rpc_world),)) if remote else None
            loss = plain(net, h if remote else torch.sin(batch(rpc_world)))
            with pytest.raises(RuntimeError, match="post-accumulate-grad hook") as info:
                dist_autograd.backward(context_id, [loss])
            assert "get_gradients" in str(info.value) and "register_hook" in str(info.value)
    assert calls == []


def test_accumulate_grad_pre_hooks_change_the_gradient_as_in_torch(rpc_world):
    net = mlp()
    x = batch(rpc_world)
    undoubled = local_grads(plain, net, x)
    # A pre-hook lives on the leaf's AccumulateGrad node, kept alive here across the passes.
    nodes = [p.view_as(p).grad_fn.next_functions[0][0] for p in (net[0].weight, net[2].bias)]
    handles = [node.register_prehook(lambda grads: (grads[0] * 2,)) for node in nodes]
    got = distributed_grads(rpc_world, plain, net, x)
    xl = x.clone().requires_grad_()
    plain(net, torch.sin(xl)).backward()  # local torch, the same nodes and hooks
    expected = {n: p.grad for n, p in net.named_parameters()} | {"x": xl.grad}
    for handle in handles:
        handle.remove()
    assert_same_grads(got, expected)
    for name in ("0.weight", "2.bias"):
        torch.testing.assert_close(got[name], 2 * undoubled[name])
    torch.testing.assert_close(got["0.bias"], undoubled["0.bias"])


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpoint(rpc_world, reentrant):
    net = mlp()

    def forward(module, h):
        return checkpoint(module, h, use_reentrant=reentrant).square().mean()

    x = batch(rpc_world)
    if not reentrant:
        assert_same_grads(
            distributed_grads(rpc_world, forward, net, x), local_grads(forward, net, x)
        )
        return
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        distributed_grads(rpc_world, forward, net, x)


def test_grad_scaler_with_a_local_optimizer(rpc_world):
    net, reference = mlp(), mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    scaler, ref_scaler = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    for step in range(3):
        x = batch(rpc_world) + step
        with dist_autograd.context() as context_id:
            h = rpc.rpc_sync(rpc_world.peer(), torch.sin, (x,))
            dist_autograd.backward(context_id, [scaler.scale(plain(net, h))])
            grads = dist_autograd.get_gradients(context_id)
            for p in net.parameters():
                p.grad = grads[p]
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        ref_scaler.scale(plain(reference, torch.sin(x))).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
        assert scaler.get_scale() == ref_scaler.get_scale()
        for p, q in zip(net.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q)


def test_weight_norm_parametrization(rpc_world):
    net = mlp()
    torch.nn.utils.parametrizations.weight_norm(net[0])
    x = batch(rpc_world)
    got = distributed_grads(rpc_world, plain, net, x)
    assert "0.parametrizations.weight.original0" in got
    assert_same_grads(got, local_grads(plain, net, x))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_module(rpc_world, backend):
    torch._dynamo.reset()
    net = mlp()
    compiled = torch.compile(net, backend=backend)
    x = batch(rpc_world)
    got = distributed_grads(rpc_world, lambda _, h: plain(compiled, h), net, x)
    assert_same_grads(got, local_grads(plain, net, x))


def test_fully_shard_raises(rpc_world):
    import torch.distributed as dist

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch 2.5
        from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    with gloo_process_group(rpc_world):
        net = mlp()
        try:
            fully_shard(net, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
            with torch.no_grad():
                net(batch(rpc_world))  # where FSDP2 needs CUDA, it says so here
        except RuntimeError as e:  # the same on every rank
            torch.distributed._composable_state._module_state_mapping.pop(net, None)
            if "requires CUDA" not in str(e):
                raise
            pytest.skip(f"fully_shard does not run on CPU in torch {torch.__version__}: {e}")
        try:
            with pytest.raises(RuntimeError, match="FSDP manages modules") as info:
                distributed_grads(rpc_world, plain, net, batch(rpc_world))
            assert "FSDPSequential" in str(info.value)
        finally:  # later passes in this process must not see it (torch 2.5 keeps it alive)
            torch.distributed._composable_state._module_state_mapping.pop(net, None)


def test_fully_sharded_data_parallel_raises(rpc_world):
    from torch.distributed.fsdp import FullyShardedDataParallel

    with gloo_process_group(rpc_world):
        net = FullyShardedDataParallel(mlp(), device_id=torch.device("cpu"))
        with pytest.raises(RuntimeError, match="FSDP manages modules") as info:
            distributed_grads(rpc_world, plain, net, batch(rpc_world))
        assert "FullyShardedDataParallel" in str(info.value)
        # FSDP holds itself through the hooks its forward set until a local backward runs
        # them (in plain torch too), so the module can go.
        plain(net, batch(rpc_world)).backward()
        del net, info
        gc.collect()
    net, x = mlp(), batch(rpc_world)  # once the FSDP module is gone, passes run again
    assert_same_grads(distributed_grads(rpc_world, plain, net, x), local_grads(plain, net, x))
