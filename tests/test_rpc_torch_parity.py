"""Behaviour that PyTorch's own RPC tests check, as torch's TensorPipe agent shows it.

Worker name checks, a view's strides across an RPC, the callee's print of a user
function's error, ``torch.futures.wait_all``/``collect_all`` ending at a failed RPC,
and ``init_rpc`` alone (``world_size=1``) or with a rank missing.
"""

from __future__ import annotations

import threading

import pytest
import torch
from _timing import scaled
from mpi4py import MPI

import lightning_distgrad.autograd as dist_autograd
from lightning_distgrad import rpc
from lightning_distgrad.rpc import WorkerInfo
from lightning_distgrad.rpc._calls.payload import decode_payload, encode_payload

EXPECTED = "Expected error"

# ---------------------------------------------------------------------------
# Remote functions


def raise_value_error():
    raise ValueError(EXPECTED)


def raise_multiline_error():
    raise ValueError("\nFirst line of error \n next line of error \n last line of error")


def describe(t):
    return t.is_contiguous(), t.stride(), t.clone()


def narrow_view(t):
    return t.narrow(1, 2, 2)


def twice(t):
    return t * 2


def add(x, y):
    return x + y


_released = threading.Event()


def wait_for_release():
    """Blocks its worker thread until :func:`release` runs on the same worker."""
    if not _released.wait(scaled(30)):
        raise TimeoutError("never released")
    return 1


def release():
    _released.set()


# ---------------------------------------------------------------------------
# Worker names (no agent needed)


@pytest.mark.parametrize(
    "name, message",
    [
        ("abc*", "Worker name must match"),
        (" ", "Worker name must match"),
        ("", "must be non-empty"),
        ("a" * 500, "shorter than 128"),
    ],
)
def test_worker_info_rejects_the_names_torch_rejects(name, message):
    with pytest.raises(RuntimeError, match=message):
        WorkerInfo(name, 0)
    assert WorkerInfo("trainer-0:a_b", 3).name == "trainer-0:a_b"


# ---------------------------------------------------------------------------
# Views keep their strides


def test_a_view_is_pickled_with_its_strides_and_values():
    base = torch.arange(25.0).view(5, 5)
    cases = [base.narrow(1, 2, 2), base.t(), torch.ones(1).expand(1000), base[::2, 1::2]]
    for view in cases:
        payload, tensors, _ = encode_payload((view,), 0)
        (received,) = decode_payload(payload, [t.contiguous().clone() for t in tensors])
        assert received.stride() == view.stride() and torch.equal(received, view)


def test_a_view_of_a_big_storage_is_sent_as_a_compact_copy():
    # As torch's RPC: the span would be 20 times the view's own bytes, and over 8 KiB.
    view = torch.rand(100, 100)[:, :2]
    payload, tensors, _ = encode_payload((view,), 0)
    assert [t.numel() for t in tensors] == [200]
    (received,) = decode_payload(payload, [t.contiguous() for t in tensors])
    assert torch.equal(received, view)


@pytest.mark.mpi(min_size=2)
def test_non_contiguous_tensors_arrive_and_return_with_their_strides(rpc_world):
    t = torch.rand(5, 5)
    for view in (t.narrow(1, 2, 2), t.t(), torch.ones(1).expand(7)):
        contiguous, stride, values = rpc.rpc_sync(rpc_world.peer(), describe, (view,))
        assert not contiguous and stride == view.stride() and torch.equal(values, view)
    returned = rpc.rpc_sync(rpc_world.peer(), narrow_view, (t,))
    assert not returned.is_contiguous() and torch.equal(returned, t.narrow(1, 2, 2))
    assert torch.equal(rpc.rpc_async(rpc_world.peer(), narrow_view, (t,)).wait(), t[:, 2:4])
    assert torch.equal(rpc.remote(rpc_world.peer(), narrow_view, (t,)).to_here(), t[:, 2:4])


@pytest.mark.mpi(min_size=2)
def test_gradients_through_a_view_sent_over_rpc_equal_local_autograd(rpc_world):
    x = torch.rand(5, 5, requires_grad=True)
    weights = torch.arange(10.0).view(5, 2)
    with dist_autograd.context() as context_id:
        y = rpc.rpc_sync(rpc_world.peer(), twice, (x.narrow(1, 1, 2),))
        dist_autograd.backward(context_id, [(y * weights).sum()])
        grad = dist_autograd.get_gradients(context_id)[x]
    x_local = x.detach().clone().requires_grad_()
    (twice(x_local.narrow(1, 1, 2)) * weights).sum().backward()
    assert torch.equal(grad, x_local.grad)


# ---------------------------------------------------------------------------
# The callee prints a user function's error


@pytest.mark.mpi(min_size=2)
def test_the_callee_prints_a_user_functions_error_to_its_stderr(rpc_world, capsys):
    rpc_world.barrier()  # every rank captures its stderr before any call can reach it
    with pytest.raises(ValueError, match=EXPECTED):
        rpc.rpc_async(rpc_world.peer(), raise_value_error).wait()
    with pytest.raises(ValueError, match=EXPECTED):
        rpc.remote(rpc_world.peer(), raise_value_error).to_here()
    with pytest.raises(RuntimeError, match="size of tensor"):  # an operator: not printed
        rpc.rpc_sync(rpc_world.peer(), torch.add, (torch.rand(10), torch.rand(5)))
    rpc_world.barrier()  # every rank's calls, so every callee's prints, are done
    err = capsys.readouterr().err
    me = f"On WorkerInfo(id={rpc_world.rank}, name={rpc_world.name}):"
    assert err.count(me) == 2 and err.count(f"ValueError: {EXPECTED}") == 2, err
    assert "size of tensor" not in err


@pytest.mark.mpi(min_size=2)
def test_a_remote_errors_text_shows_line_breaks_not_escapes(rpc_world):
    with pytest.raises(ValueError) as info:
        rpc.rpc_sync(rpc_world.peer(), raise_multiline_error)
    text = str(info.value)
    assert "ValueError('\nFirst line of error \n next line of error" in text
    assert text == text.encode("utf-8").decode("unicode_escape")  # as torch's test checks


# ---------------------------------------------------------------------------
# torch.futures.wait_all / collect_all end at a failed RPC


@pytest.mark.mpi(min_size=2)
def test_wait_all_raises_a_failed_rpcs_error_without_waiting_for_the_others(rpc_world):
    _released.clear()
    rpc_world.barrier()  # every rank cleared its event before any call can arrive
    blocked = rpc.rpc_async(rpc_world.peer(), wait_for_release, timeout=scaled(20))
    futures = [blocked] + [rpc.rpc_async(rpc_world.peer(), raise_value_error) for _ in range(2)]
    with pytest.raises(ValueError, match=EXPECTED):
        torch.futures.wait_all(futures)
    assert not blocked.done()  # it returned before the blocked call ended
    with pytest.raises(ValueError, match=EXPECTED):
        torch.futures.collect_all(futures).wait()
    assert not blocked.done()
    builtin = [rpc.rpc_async(rpc_world.peer(), torch.add, (torch.rand(10), torch.rand(5)))]
    with pytest.raises(RuntimeError, match="size of tensor"):
        torch.futures.wait_all([blocked, *builtin])
    rpc.rpc_sync(rpc_world.peer(), release)
    assert blocked.wait() == 1


@pytest.mark.mpi(min_size=2)
def test_wait_all_and_collect_all_still_return_every_result(rpc_world):
    futures = [rpc.rpc_async(rpc_world.peer(), add, (torch.ones(2), i)) for i in range(5)]
    local = torch.futures.Future()
    local.set_result(7)
    assert [f.sum().item() for f in torch.futures.wait_all(futures)] == [2, 4, 6, 8, 10]
    collected = torch.futures.collect_all([*futures, local]).wait()
    assert [f.wait() for f in collected][-1] == 7
    assert torch.futures.wait_all([local]) == [7]  # torch's own, without an RPC future


# ---------------------------------------------------------------------------
# init_rpc alone, and with a rank missing


@pytest.mark.mpi(min_size=2)
def test_init_rpc_with_world_size_one_runs_rpc_in_this_process_alone(rpc_stopped):
    # As torch's test_world_size_one: only rank 0 calls init_rpc.
    if rpc_stopped.rank == 0:
        rpc.init_rpc(name="me", rank=0, world_size=1)
        assert rpc.get_worker_info() == WorkerInfo("me", 0)
        x = torch.ones(2, 2)
        assert torch.equal(rpc.rpc_sync("me", add, (x, x)), x * 2)
        assert torch.equal(rpc.rpc_async("me", add, (x, x)).wait(), x * 2)
        assert torch.equal(rpc.remote("me", add, (x, x)).to_here(), x * 2)
        with pytest.raises(RuntimeError, match="could not find destination"):
            rpc.rpc_sync("worker1", add, (x, x))
        rpc.shutdown()
    rpc_stopped.barrier()
    with pytest.raises(RuntimeError, match="rank=1 was passed with world_size=1"):
        rpc.init_rpc(rank=1, world_size=1)


@pytest.mark.mpi(min_size=2)
def test_init_rpc_raises_after_the_rpc_timeout_when_a_rank_does_not_call_it(rpc_stopped):
    if rpc_stopped.rank == 0:
        options = rpc.MPIRpcBackendOptions(rpc_timeout=0.5)
        with pytest.raises(RuntimeError, match="init_rpc waited 0.5 s") as info:
            rpc.init_rpc(rpc_backend_options=options)
        assert "every rank of the communicator" in str(info.value)
        with pytest.raises(RuntimeError, match="RPC has not been initialized"):
            rpc.get_worker_info()
    rpc_stopped.barrier()  # the others come late; rank 0's retry meets them
    rpc.init_rpc()
    for r in range(rpc_stopped.size):
        assert rpc.rpc_sync(r, add, (r, 1)) == r + 1
    assert MPI.COMM_WORLD.Get_size() == rpc_stopped.size
    rpc.shutdown()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("whose", ["ours", "torchs"])
def test_a_wait_all_block_waits_for_its_rpc_async_futures(rpc_world, whose):
    # rpc.api._wait_all is private in torch; ported code may use ours or keep torch's.
    if whose == "torchs":
        if not torch.distributed.rpc.is_available():  # the same on every rank
            pytest.skip("this torch has no RPC, hence no rpc.api._wait_all of its own")
        from torch.distributed.rpc.api import _thread_local_var, _wait_all
    else:
        from lightning_distgrad.rpc.api import _thread_local_var, _wait_all

    with pytest.raises(ValueError, match=EXPECTED), _wait_all():
        ok = rpc.rpc_async(rpc_world.peer(), add, (1, 2))
        assert rpc.rpc_sync(rpc_world.peer(), add, (3, 4)) == 7  # not collected
        rpc.rpc_async(rpc_world.peer(), raise_value_error)
        assert len(_thread_local_var.future_list) == 2
    # The block ended at the failed call, as torch's: the other answers (already received)
    # complete their futures on callback threads, in no set order.
    assert ok.wait() == 3
    assert not hasattr(_thread_local_var, "future_list")
    with _wait_all():
        late = rpc.rpc_async(rpc_world.peer(), add, (1, 1))
    assert late.done() and late.wait() == 2


# ---------------------------------------------------------------------------
# Options of the wrong type (no agent needed: init_rpc refuses them before any collective)


class OtherAgentOptions(rpc.RpcBackendOptions):
    """Options of some other RPC agent, as torch's test defines them."""

    def __init__(self, init_method):
        rpc.RpcBackendOptions.__init__(self)
        self.init_method = init_method


def test_init_rpc_names_options_of_the_wrong_type_in_torchs_words():
    with pytest.raises(TypeError, match="must be an instance of RpcBackendOptions"):
        rpc.init_rpc(rpc_backend_options={"init_method": "env://"})
    with pytest.raises(TypeError, match="Could not infer backend for options"):
        rpc.init_rpc(rpc_backend_options=OtherAgentOptions("env://"))
    with pytest.raises(
        TypeError, match="`rpc_backend_options` must be a `TensorPipeRpcBackendOptions`"
    ):
        rpc.init_rpc(
            backend=rpc.BackendType.TENSORPIPE, rpc_backend_options=OtherAgentOptions("env://")
        )
    with pytest.raises(RuntimeError, match="RPC has not been initialized"):
        rpc.get_worker_info()


# ---------------------------------------------------------------------------
# Futures cannot be sent; torch's constants; an RRef before init_rpc


def keep(x):
    return x


@pytest.mark.mpi(min_size=2)
def test_sending_a_future_raises_torchs_runtime_error(rpc_world):
    future = torch.futures.Future()
    for send in (rpc.rpc_sync, rpc.rpc_async, rpc.remote):
        with pytest.raises(RuntimeError, match="Can not pickle torch.futures.Future"):
            send(rpc_world.peer(), keep, args=(future,))
    done = rpc.rpc_async(rpc_world.peer(), add, (1, 2))
    with pytest.raises(RuntimeError, match="Can not pickle torch.futures.Future"):
        rpc.rpc_sync(rpc_world.peer(), keep, args=([done],))  # ours too, inside a list
    assert done.wait() == 3


def test_rpc_constants_have_torchs_names_and_this_agents_values():
    assert rpc.constants.DEFAULT_RPC_TIMEOUT_SEC == 60.0
    assert rpc.constants.UNSET_RPC_TIMEOUT == rpc.UNSET_RPC_TIMEOUT == -1.0
    assert rpc.constants.DEFAULT_NUM_WORKER_THREADS == 16
    assert rpc.MPIRpcBackendOptions().rpc_timeout == rpc.constants.DEFAULT_RPC_TIMEOUT_SEC


def test_an_rref_before_init_rpc_says_so_in_torchs_words():
    with pytest.raises(RuntimeError, match="Current RPC agent is not set") as info:
        rpc.RRef(torch.ones(1))
    assert str(info.value).startswith("RPC has not been initialized")


@pytest.mark.mpi(min_size=2)
def test_dist_autograd_backward_with_arguments_of_wrong_types_raises_type_error(rpc_world):
    with dist_autograd.context() as context_id:
        for bad in ((context_id, None), (None, None)):
            with pytest.raises(TypeError, match="incompatible function arguments"):
                dist_autograd.backward(*bad)
