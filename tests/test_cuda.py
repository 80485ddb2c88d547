"""CUDA tensors over RPC, distributed autograd, RemoteModule and the Lightning strategy on a GPU.

Skipped where torch sees no GPU. Every rank uses ``cuda:0``: with one GPU the ranks share it,
which exercises the same paths as one GPU per rank. Tests with device maps run twice: CUDA
tensors over CUDA IPC, and staged through host memory (IPC forced off), as between nodes.
Results are compared with plain local autograd (or a single-process Lightning run), or with
what was sent, on the same values.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from _dist_utils import make_trainer
from test_lightning_strategy import (
    assert_states_close,
    distributed_state,
    loader,
    local_pipeline,
    pipeline_data,
    pipeline_model,
    reference_state,
)
from torch import nn

import lightning_distgrad.autograd as dist_autograd
from lightning_distgrad import rpc
from lightning_distgrad.nn import RemoteModule
from lightning_distgrad.optim import DistributedOptimizer
from lightning_distgrad.rpc._transport.cuda import IPC_ENV

pytestmark = [
    pytest.mark.mpi(min_size=2),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPU = torch.device("cuda", 0)


# --- Remote functions (module level: the callee imports them by name) ---------------------------


def devices_and_sum(a: torch.Tensor, b: torch.Tensor) -> tuple[str, str, torch.Tensor]:
    return str(a.device), str(b.device), a + b.to(a.device)


def scaled_tanh(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h) * w


class SeededLinear(nn.Linear):
    """Linear(4, 3) whose weights depend on ``seed`` alone: a worker thread builds the remote
    one while the test's thread draws from the global generator."""

    def __init__(self, seed: int):
        super().__init__(4, 3)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.rand(p.shape, generator=generator) - 0.5)


def device_and_echo(t: torch.Tensor) -> tuple[str, torch.Tensor]:
    return str(t.device), t


_kept: list[torch.Tensor] = []


def keep(t: torch.Tensor) -> None:
    """Hold what arrived (the reply carries no tensor that orders anything)."""
    _kept.append(t)


def kept_equals(expected: torch.Tensor) -> bool:
    """Whether the tensor kept last is on the GPU and equals ``expected`` (a CPU copy)."""
    t = _kept.pop()
    return t.device == GPU and torch.equal(t.cpu(), expected)


_pending: dict[str, object] = {}
PRODUCTS, N = 30, 4096


def _chain(a: torch.Tensor) -> torch.Tensor:
    y = a
    for _ in range(PRODUCTS):
        y = y @ a
    return y


def start_long_products() -> None:
    """Queue matrix products on the default stream and free their inputs at once: the
    allocator may hand that memory out again while the products still read it."""
    generator = torch.Generator(device=GPU).manual_seed(0)
    a = torch.randn(N, N, device=GPU, generator=generator) / N**0.5
    _pending["expected"] = _chain(a)
    torch.cuda.synchronize()
    _pending["result"] = _chain(a)
    _pending["still_running"] = not torch.cuda.current_stream().query()


def long_products_ended_right() -> bool:
    torch.cuda.synchronize()
    result, expected = _pending["result"], _pending["expected"]
    ok = _pending["still_running"] and torch.allclose(result, expected, rtol=1e-4, atol=1e-4)
    _pending.clear()
    return ok


def cpu_state(module_rref: rpc.RRef) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in module_rref.local_value().state_dict().items()}


def parameter_device(module_rref: rpc.RRef) -> str:
    return str(next(module_rref.local_value().parameters()).device)


# --- Fixtures ----------------------------------------------------------------------------------


@pytest.fixture(params=["ipc", "staged"])
def mapped_rpc(request, rpc_stopped, monkeypatch):
    """An agent whose device maps send ``cuda:0`` to ``cuda:0`` on every other worker; its
    CUDA tensors travel over CUDA IPC, or staged through host memory (IPC forced off)."""
    if request.param == "staged":
        monkeypatch.setenv(IPC_ENV, "0")
    options = rpc.MPIRpcBackendOptions()
    for name in rpc_stopped.names:
        if name != rpc_stopped.name:
            options.set_device_map(name, {0: 0})
    rpc.init_rpc(rpc_stopped.name, rpc_backend_options=options)
    peers = rpc._get_debug_info()["peers"]
    # One node: every peer passes the probe unless IPC is forced off.
    assert {peers[n]["cuda_ipc"] for n in rpc_stopped.names if n != rpc_stopped.name} == {
        request.param == "ipc"
    }
    yield rpc_stopped
    rpc_stopped.barrier()
    rpc.shutdown()


# --- RPC -----------------------------------------------------------------------------------------


def test_cuda_tensors_arrive_on_the_mapped_device_and_replies_come_back_on_the_gpu(mapped_rpc):
    a = torch.arange(6.0, device=GPU).reshape(2, 3)
    b = torch.ones(2, 3)
    a_device, b_device, total = rpc.rpc_sync(mapped_rpc.peer(), devices_and_sum, (a, b))
    assert (a_device, b_device) == ("cuda:0", "cpu")
    assert total.device == GPU
    torch.testing.assert_close(total, a + b.to(GPU), rtol=0, atol=0)
    big = torch.randn(1 << 20, device=GPU)  # 4 MiB: beyond the inline and direct-write sizes
    _, _, echoed = rpc.rpc_sync(mapped_rpc.peer(), devices_and_sum, (big, torch.zeros(1)))
    torch.testing.assert_close(echoed, big, rtol=0, atol=0)


KIB, MIB = 1 << 10, 1 << 20


@pytest.mark.parametrize("nbytes", [KIB, 64 * KIB + 4, MIB, 16 * MIB, 256 * MIB, 1024 * MIB])
def test_cuda_tensors_of_1_kib_to_1_gib_arrive_exact_on_the_mapped_device(mapped_rpc, nbytes):
    generator = torch.Generator(device=GPU).manual_seed(mapped_rpc.rank)
    x = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=GPU, generator=generator)
    device, back = rpc.rpc_sync(mapped_rpc.peer(), device_and_echo, (x,))
    assert device == "cuda:0" and back.device == GPU
    assert torch.equal(back, x)
    # Strided and offset views travel as their values.
    view = x[1::3][: nbytes // 4]
    assert torch.equal(rpc.rpc_sync(mapped_rpc.peer(), device_and_echo, (view,))[1], view)


def test_what_arrived_stays_when_the_sender_overwrites_or_frees_its_tensor(mapped_rpc):
    torch.manual_seed(mapped_rpc.rank)
    x = torch.randn(16 * MIB // 4, device=GPU)
    y = torch.randn(16 * MIB // 4, device=GPU)
    expected_x, expected_y = x.cpu(), y.cpu()
    rpc.rpc_sync(mapped_rpc.peer(), keep, (x,))
    x.fill_(-1.0)  # overwritten in place at once
    rpc.rpc_sync(mapped_rpc.peer(), keep, (y,))
    del y  # freed: its memory is handed out again at once
    reuse = [torch.full((16 * MIB // 4,), -2.0, device=GPU) for _ in range(4)]
    assert rpc.rpc_sync(mapped_rpc.peer(), kept_equals, (expected_y,))
    assert rpc.rpc_sync(mapped_rpc.peer(), kept_equals, (expected_x,))
    assert all(bool((r == -2.0).all()) for r in reuse)
    # The same storage sent again (a fresh export each time) arrives with its new values.
    for value in (3.0, 4.0):
        x.fill_(value)
        _, back = rpc.rpc_sync(mapped_rpc.peer(), device_and_echo, (x,))
        assert bool((back == value).all())


def test_a_producing_kernel_still_running_is_finished_before_the_receiver_reads(mapped_rpc):
    """The RPC is issued from a side stream while its matrix products still run there."""
    torch.manual_seed(mapped_rpc.rank)
    n = 4096
    a = torch.randn(n, n, device=GPU) / n**0.5
    side = torch.cuda.Stream(GPU)
    side.wait_stream(torch.cuda.current_stream(GPU))
    with torch.cuda.stream(side):
        y = a
        for _ in range(30):
            y = y @ a
        still_running = not side.query()
        rpc.rpc_sync(mapped_rpc.peer(), keep, (y,))
    torch.cuda.synchronize()
    assert still_running  # otherwise this test tests nothing: make the products longer
    assert rpc.rpc_sync(mapped_rpc.peer(), kept_equals, (y.cpu(),))


def test_an_arriving_tensor_waits_for_default_stream_work_on_the_memory_it_gets(mapped_rpc):
    """The receiver's products still read memory freed on the default stream when a tensor
    of the same size arrives: its copy must not write there before they end."""
    rpc.rpc_sync(mapped_rpc.peer(), start_long_products)
    for _ in range(4):
        rpc.rpc_sync(mapped_rpc.peer(), keep, (torch.ones(N, N, device=GPU),))
    assert rpc.rpc_sync(mapped_rpc.peer(), long_products_ended_right)
    mapped_rpc.barrier()  # the peer's tensors arrived here too
    _kept.clear()


def test_a_cuda_tensor_without_a_device_map_is_refused_and_the_agent_goes_on(rpc_world):
    x = torch.ones(3, device=GPU)
    with pytest.raises(RuntimeError, match="no device map entry"):
        rpc.rpc_sync(rpc_world.peer(), devices_and_sum, (x, x))
    _, _, total = rpc.rpc_sync(rpc_world.peer(), devices_and_sum, (x.cpu(), x.cpu()))
    assert torch.equal(total, torch.full((3,), 2.0))


# --- Distributed autograd ------------------------------------------------------------------------


def test_backward_through_cuda_rpcs_matches_local_autograd(mapped_rpc):
    torch.manual_seed(mapped_rpc.rank)
    a = torch.randn(3, 3, device=GPU, requires_grad=True)
    b = torch.randn(3, 3, device=GPU, requires_grad=True)
    with dist_autograd.context() as context_id:
        c = rpc.rpc_sync(mapped_rpc.peer(), torch.mul, (a, b))
        loss = (c * a).sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
    la, lb = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    ((la * lb) * la).sum().backward()
    assert grads[a].device == GPU and grads[b].device == GPU
    torch.testing.assert_close(grads[a], la.grad)
    torch.testing.assert_close(grads[b], lb.grad)


def test_gradients_of_activations_staged_through_host_memory_return_to_the_gpu(rpc_world):
    torch.manual_seed(rpc_world.rank)
    w = torch.randn(4, 4, device=GPU, requires_grad=True)
    x = torch.randn(2, 4, device=GPU)
    scale = torch.randn(2, 4, requires_grad=True)  # a CPU leaf on the same path
    with dist_autograd.context() as context_id:
        h = x @ w
        out = rpc.rpc_sync(rpc_world.peer(), scaled_tanh, (h.cpu(), scale)).to(GPU)
        dist_autograd.backward(context_id, [out.pow(2).sum()])
        grads = dist_autograd.get_gradients(context_id)
    lw, ls = w.detach().clone().requires_grad_(), scale.detach().clone().requires_grad_()
    (torch.tanh(x @ lw).cpu() * ls).to(GPU).pow(2).sum().backward()
    assert grads[w].device == GPU and grads[scale].device == torch.device("cpu")
    torch.testing.assert_close(grads[w], lw.grad)
    torch.testing.assert_close(grads[scale], ls.grad)


# --- RemoteModule --------------------------------------------------------------------------------


def test_remote_module_on_a_gpu_trains_like_a_local_module(rpc_world):
    remote = RemoteModule(f"{rpc_world.peer()}/cuda:0", SeededLinear, args=(7,))
    local = SeededLinear(7)
    assert rpc.rpc_sync(remote.on, parameter_device, (remote.module_rref,)) == "cuda:0"
    opt = DistributedOptimizer(torch.optim.SGD, remote.remote_parameters(), lr=0.1)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1)
    torch.manual_seed(rpc_world.rank)
    for _ in range(3):
        x = torch.randn(5, 4)
        with dist_autograd.context() as context_id:
            out = remote(x)  # no device map: inputs and outputs cross as CPU tensors
            assert out.device == torch.device("cpu")
            dist_autograd.backward(context_id, [out.pow(2).sum()])
            opt.step(context_id)
        local_opt.zero_grad()
        local(x).pow(2).sum().backward()
        local_opt.step()
    trained = rpc.rpc_sync(remote.on, cpu_state, (remote.module_rref,))
    for key, value in local.state_dict().items():
        torch.testing.assert_close(trained[key], value)


def test_remote_module_on_a_gpu_takes_and_gives_gpu_tensors_through_device_maps(mapped_rpc):
    remote = RemoteModule(f"{mapped_rpc.peer()}/cuda:0", SeededLinear, args=(7,))
    local = SeededLinear(7).to(GPU)
    opt = DistributedOptimizer(torch.optim.SGD, remote.remote_parameters(), lr=0.1)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1)
    torch.manual_seed(mapped_rpc.rank)
    for _ in range(3):
        x = torch.randn(5, 4, device=GPU, requires_grad=True)
        with dist_autograd.context() as context_id:
            out = remote(x)
            assert out.device == GPU
            dist_autograd.backward(context_id, [out.pow(2).sum()])
            x_grad = dist_autograd.get_gradients(context_id)[x]
            opt.step(context_id)
        lx = x.detach().clone().requires_grad_()
        local_opt.zero_grad()
        local(lx).pow(2).sum().backward()
        local_opt.step()
        torch.testing.assert_close(x_grad, lx.grad)
    trained = rpc.rpc_sync(remote.on, cpu_state, (remote.module_rref,))
    for key, value in local.state_dict().items():
        torch.testing.assert_close(trained[key], value.cpu())


# --- Lightning -----------------------------------------------------------------------------------


class DevicesSeen(L.Callback):
    """The devices of each training batch and of the local layers while they train."""

    def __init__(self):
        self.seen: set[tuple[str, str]] = set()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.add((str(batch[0].device), str(next(pl_module.first.parameters()).device)))


def test_lightning_trainers_on_the_gpu_train_like_a_single_process(rpc_world):
    data = pipeline_data(steps_per_epoch=3)
    devices = DevicesSeen()
    trainer = make_trainer(accelerator="gpu", devices=1, max_epochs=1, callbacks=[devices])
    trainer.fit(pipeline_model(), loader(data))
    if trainer.strategy.is_server:
        assert trainer.strategy.root_device == torch.device("cpu")
        return
    assert devices.seen == {("cuda:0", "cuda:0")}
    expected = reference_state(local_pipeline(), data, steps=3)
    assert_states_close(distributed_state(trainer), expected, tol=1e-4)
