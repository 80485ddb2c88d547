"""Bad input gives a clear error on the caller, and the agent stays usable afterwards.

Every test ends with :func:`assert_usable`: a normal RPC to each worker right
after the error.
"""

from __future__ import annotations

import builtins
import pickle
import re
import sys
import threading
import time
import types

import pytest
import torch
from _dist_utils import open_gate, wait_at_gate, wait_until
from _timing import scaled

from lightning_distgrad import rpc
from lightning_distgrad.rpc import WorkerInfo
from lightning_distgrad.rpc._calls import dispatch, pending
from lightning_distgrad.rpc._transport import Kind

pytestmark = pytest.mark.mpi(min_size=2)


# ---------------------------------------------------------------------------
# Remote functions


def raise_value_error(text):
    raise ValueError(text)


def raise_key_error():
    return {}["missing-key"]


class CustomError(Exception):
    pass


class NeedsTwoArgsError(Exception):
    """Cannot be rebuilt from a single message string."""

    def __init__(self, code, detail):
        super().__init__(code, detail)


def raise_custom():
    raise CustomError("custom failure")


def raise_needs_two_args():
    raise NeedsTwoArgsError(7, "detail")


def deep_failure(depth):
    if depth == 0:
        raise ZeroDivisionError("deep down")
    return deep_failure(depth - 1)


def return_lock():
    return threading.Lock()


def takes_one(x):
    return x


def make_meta_tensor():
    return torch.empty(3, device="meta")


def sleep_then_return(seconds, value):
    time.sleep(seconds)
    return value


def raise_attribute_error():
    return object().missing_attribute


@rpc.functions.async_execution
def async_raise():
    fut = torch.futures.Future()
    fut.set_exception(IndexError("async failure"))
    return fut


@rpc.functions.async_execution
def async_nested_raise(to):
    return rpc.rpc_async(to, raise_value_error, ("nested failure",))


# ---------------------------------------------------------------------------
# Helpers


def assert_usable(world) -> None:
    """A normal RPC to every worker (self included) works right now."""
    futs = [
        rpc.rpc_async(name, torch.add, (torch.ones(2), i)) for i, name in enumerate(world.names)
    ]
    for i, fut in enumerate(futs):
        assert torch.equal(fut.wait(), torch.full((2,), 1.0 + i))
    assert rpc.rpc_sync(world.peer(), builtins.abs, (-2,)) == 2


class SentRequests:
    """Counts REQUEST frames this worker sends (replies to other ranks are not counted)."""

    def __init__(self, monkeypatch):
        transport = rpc.api._get_current_rpc_agent().transport
        original = transport.send
        self.requests = 0

        def spy(dst, frame, *args, **kwargs):
            if frame.kind is Kind.REQUEST:
                self.requests += 1
            return original(dst, frame, *args, **kwargs)

        monkeypatch.setattr(transport, "send", spy)


@pytest.fixture
def sent(monkeypatch, rpc_world):
    return SentRequests(monkeypatch)


# ---------------------------------------------------------------------------
# Destinations


@pytest.mark.parametrize("api", ["rpc_sync", "rpc_async", "remote"])
def test_unknown_destination_name_raises_before_sending(rpc_world, sent, api):
    call = getattr(rpc, api)
    with pytest.raises(RuntimeError, match="could not find destination name WorkerUnknown"):
        call("WorkerUnknown", torch.add, (torch.ones(1), 1))
    with pytest.raises(RuntimeError, match="could not find destination"):
        rpc.get_worker_info("WorkerUnknown")
    assert sent.requests == 0
    assert_usable(rpc_world)


@pytest.mark.parametrize("api", ["rpc_sync", "rpc_async", "remote"])
def test_unknown_destination_rank_raises_before_sending(rpc_world, sent, api):
    call = getattr(rpc, api)
    for bad in (rpc_world.size, rpc_world.size + 1, -1):
        with pytest.raises(RuntimeError, match=f"could not find destination id {bad}"):
            call(bad, torch.add, (torch.ones(1), 1))
    for bad in (rpc_world.peer_rank() + 0.5, None, [0]):
        with pytest.raises(ValueError, match="Cannot get WorkerInfo from name"):
            call(bad, torch.add, (torch.ones(1), 1))
    # A WorkerInfo whose name and id do not belong together.
    with pytest.raises(RuntimeError, match="could not find destination"):
        call(WorkerInfo(rpc_world.peer(), rpc_world.size + 3), torch.add, (torch.ones(1), 1))
    assert sent.requests == 0
    assert_usable(rpc_world)


# ---------------------------------------------------------------------------
# Functions and arguments


@pytest.mark.parametrize("api", ["rpc_sync", "rpc_async", "remote"])
def test_non_callable_func_raises_type_error_before_sending(rpc_world, sent, api):
    with pytest.raises(TypeError, match="function should be callable"):
        getattr(rpc, api)(rpc_world.peer(), 3, (1,))
    assert sent.requests == 0
    assert_usable(rpc_world)


@pytest.mark.parametrize("api", ["rpc_sync", "rpc_async", "remote"])
@pytest.mark.parametrize(
    "bad", ["lambda_arg", "lock_arg", "lock_kwarg", "lambda_func", "local_func"]
)
def test_unpicklable_call_raises_type_error(rpc_world, sent, api, bad):
    def local_func(x):
        return x

    func, args, kwargs = takes_one, (torch.ones(1),), None
    if bad == "lambda_arg":
        args = (lambda: 1,)
    elif bad == "lock_arg":
        args = ([torch.ones(2), {"lock": threading.Lock()}],)
    elif bad == "lock_kwarg":
        args, kwargs = (), {"x": threading.Lock()}
    elif bad == "lambda_func":
        func = lambda x: x  # noqa: E731
    else:
        func = local_func
    with pytest.raises(TypeError, match="pickle"):
        getattr(rpc, api)(rpc_world.peer(), func, args, kwargs)
    assert sent.requests == 0
    assert_usable(rpc_world)


def test_unpicklable_result_raises_on_caller(rpc_world):
    with pytest.raises(TypeError, match="pickle"):
        rpc.rpc_sync(rpc_world.peer(), return_lock)
    with pytest.raises(TypeError, match="pickle"):
        rpc.rpc_async(rpc_world.peer(), return_lock).wait()
    assert_usable(rpc_world)


def test_wrong_arguments_raise_type_error_or_torchs_schema_error(rpc_world):
    with pytest.raises(TypeError, match="takes_one"):
        rpc.rpc_sync(rpc_world.peer(), takes_one, (1, 2, 3))
    # An operator: torch's RuntimeError, with the operator's own text.
    schema = "Overloaded torch operator invoked from Python failed to match any schema"
    with pytest.raises(RuntimeError, match=f"{schema}: add\\(\\): argument .input"):
        rpc.rpc_sync(rpc_world.peer(), torch.add, ("not", "tensors"))
    with pytest.raises(RuntimeError, match=schema):
        rpc.rpc_async(rpc_world.peer(), torch.add, args=()).wait()
    assert_usable(rpc_world)


def test_function_missing_on_callee_raises_runtime_error(rpc_world):
    # A module that exists only in this process: pickled by reference, the
    # callee cannot import it. torch raises RuntimeError there.
    module = types.ModuleType(f"only_on_rank_{rpc_world.rank}")
    exec("def f(x):\n    return x\n", module.__dict__)
    sys.modules[module.__name__] = module
    try:
        with pytest.raises(RuntimeError, match=f"ModuleNotFoundError: .*{module.__name__}"):
            rpc.rpc_sync(rpc_world.peer(), module.f, (1,))
    finally:
        del sys.modules[module.__name__]
    assert_usable(rpc_world)


NOT_IMPORTABLE = "must be importable under the same module path on every rank"


def test_function_missing_on_callee_error_says_how_to_define_it(rpc_world):
    # Defined at test time on this rank only, as under `if rank == 0:`: an attribute
    # of this module that the callee's copy lacks, and a module the callee lacks.
    name = f"defined_only_on_rank_{rpc_world.rank}"
    this_module = sys.modules[__name__]
    exec(f"def {name}(x):\n    return x\n", this_module.__dict__)
    module = types.ModuleType(f"module_only_on_rank_{rpc_world.rank}")
    exec("def f(x):\n    return x\n", module.__dict__)
    sys.modules[module.__name__] = module
    try:
        # torch's type, and the text its tests match ("RPC pickler does not serialize").
        with pytest.raises(RuntimeError, match="RPC pickler does not serialize") as info:
            rpc.rpc_sync(rpc_world.peer(), getattr(this_module, name), (1,))
        assert name in str(info.value)
        assert NOT_IMPORTABLE in str(info.value) and "module level" in str(info.value)
        with pytest.raises(RuntimeError, match=module.__name__) as info:
            rpc.rpc_async(rpc_world.peer(), module.f, (1,)).wait()
        assert NOT_IMPORTABLE in str(info.value)
        with pytest.raises(RuntimeError, match=NOT_IMPORTABLE):
            rpc.remote(rpc_world.peer(), module.f, (1,))._get_future().wait()
        # Nothing was created on the owner: to_here reports the creation's error
        # instead of waiting for a value that will never exist.
        with pytest.raises(RuntimeError, match=NOT_IMPORTABLE):
            rpc.remote(rpc_world.peer(), module.f, (1,)).to_here(timeout=scaled(20))
    finally:
        delattr(this_module, name)
        del sys.modules[module.__name__]
    # The function's own errors are left as they are.
    with pytest.raises(AttributeError, match="missing_attribute") as info:
        rpc.rpc_sync(rpc_world.peer(), raise_attribute_error)
    assert NOT_IMPORTABLE not in str(info.value)
    assert rpc.rpc_sync(rpc_world.peer(), takes_one, (5,)) == 5
    assert_usable(rpc_world)


def test_tensor_on_unmapped_device_is_refused_and_nothing_hangs(rpc_world, sent):
    # No CUDA here: a meta tensor stands in for a device tensor without a
    # device map. Neither the refused call nor the refused result may leave a
    # pending call behind (graceful shutdown would wait for it forever).
    agent = rpc.api._get_current_rpc_agent()
    for api in ("rpc_sync", "rpc_async", "remote"):
        with pytest.raises(RuntimeError, match="Cannot send a tensor on meta"):
            getattr(rpc, api)(rpc_world.peer(), torch.numel, (torch.empty(2, device="meta"),))
    assert sent.requests == 0 and agent.num_pending() == 0
    with pytest.raises(RuntimeError, match="Cannot send a tensor on meta"):
        rpc.rpc_sync(rpc_world.peer(), make_meta_tensor)
    assert agent.num_pending() == 0
    assert_usable(rpc_world)


# ---------------------------------------------------------------------------
# Remote exceptions


def test_callee_error_keeps_original_type(rpc_world):
    peer = rpc.get_worker_info(rpc_world.peer())
    with pytest.raises(ValueError) as info:
        rpc.rpc_sync(peer, raise_value_error, ("Expected error",))
    text = str(info.value)
    assert "Expected error" in text
    assert f"On {peer}" in text  # where it happened
    assert "Traceback (most recent call last)" in text and "raise_value_error" in text
    with pytest.raises(KeyError, match="missing-key"):
        rpc.rpc_sync(peer, raise_key_error)
    with pytest.raises(CustomError, match="custom failure"):
        rpc.rpc_async(peer, raise_custom).wait()
    assert_usable(rpc_world)


def test_callee_error_message_has_remote_traceback(rpc_world):
    with pytest.raises(ZeroDivisionError) as info:
        rpc.rpc_sync(rpc_world.peer(), deep_failure, (3,))
    text = str(info.value)
    assert "deep down" in text
    assert text.count("deep_failure") >= 4  # every remote frame is listed
    assert "test_rpc_errors.py" in text
    assert_usable(rpc_world)


def test_callee_error_of_unbuildable_type_becomes_runtime_error(rpc_world):
    with pytest.raises(RuntimeError) as info:
        rpc.rpc_sync(rpc_world.peer(), raise_needs_two_args)
    text = str(info.value)
    assert "Failed to create original exception type" in text
    assert "Original exception on remote side was" in text and "NeedsTwoArgsError" in text
    assert_usable(rpc_world)


def test_callee_error_in_remote_raises_at_to_here(rpc_world):
    rref = rpc.remote(rpc_world.peer(), raise_value_error, ("remote failure",))
    with pytest.raises(ValueError, match="remote failure"):
        rref.to_here()
    with pytest.raises(ValueError, match="remote failure"):
        rref._get_future().wait()
    with pytest.raises(TypeError):
        rpc.remote(rpc_world.peer(), takes_one, (1, 2)).to_here()
    assert_usable(rpc_world)


def test_error_from_async_execution_keeps_type(rpc_world):
    with pytest.raises(IndexError, match="async failure"):
        rpc.rpc_sync(rpc_world.peer(), async_raise)
    with pytest.raises(ValueError, match="nested failure"):
        rpc.rpc_sync(rpc_world.peer(), async_nested_raise, (rpc_world.peer(2),))
    with pytest.raises(IndexError, match="async failure"):
        rpc.remote(rpc_world.peer(), async_raise).to_here()
    assert_usable(rpc_world)


def test_callee_keeps_serving_after_many_errors(rpc_world):
    futs = [rpc.rpc_async(rpc_world.peer(), raise_value_error, (f"e{i}",)) for i in range(100)]
    for i, fut in enumerate(futs):
        with pytest.raises(ValueError, match=f"e{i}\\b"):
            fut.wait()
    assert_usable(rpc_world)


# ---------------------------------------------------------------------------
# Timeouts


def test_call_exceeding_its_timeout_raises(rpc_world):
    with pytest.raises(RuntimeError, match="RPC ran for more than"):
        rpc.rpc_sync(rpc_world.peer(), sleep_then_return, (0.6, 1), timeout=0.1)
    fut = rpc.rpc_async(rpc_world.peer(), sleep_then_return, (0.6, 2), timeout=0.1)
    with pytest.raises(RuntimeError, match="RPC ran for more than"):
        fut.wait()
    assert_usable(rpc_world)
    # timeout=0 means no timeout.
    assert rpc.rpc_sync(rpc_world.peer(), sleep_then_return, (0.2, 3), timeout=0) == 3


def test_remote_exceeding_its_timeout_fails_at_to_here(rpc_world):
    rref = rpc.remote(rpc_world.peer(), sleep_then_return, (0.6, 4), timeout=0.1)
    with pytest.raises(RuntimeError, match="RPC ran for more than"):
        rref._get_future().wait()
    with pytest.raises(RuntimeError, match="RRef creation via rpc.remote\\(\\) timed out"):
        rref.to_here()
    assert_usable(rpc_world)


def test_default_timeout_applies_to_calls_issued_afterwards(rpc_world):
    slow = rpc.rpc_async(rpc_world.peer(), sleep_then_return, (0.5, 5))  # default: 60 s
    try:
        rpc._set_rpc_timeout(0.1)
        with pytest.raises(RuntimeError, match="RPC ran for more than"):
            rpc.rpc_sync(rpc_world.peer(), sleep_then_return, (0.6, 6))
        # An explicit timeout overrides the default.
        assert rpc.rpc_sync(rpc_world.peer(), sleep_then_return, (0.3, 7), timeout=scaled(5)) == 7
    finally:
        rpc._set_rpc_timeout(60.0)
    assert slow.wait() == 5  # issued before the change: not cut short
    assert_usable(rpc_world)


def test_answered_calls_leave_no_timer_that_wakes_the_agent(rpc_world, monkeypatch):
    """One timer is armed, for the earliest deadline of a call still pending: once the calls
    were answered, nothing wakes the agent to check them (a check every 10 ms did)."""
    checks = []
    expire = pending.Deadlines._expire
    monkeypatch.setattr(
        pending.Deadlines, "_expire", lambda self, at: (checks.append(at), expire(self, at))
    )
    for i in range(20):
        assert rpc.rpc_sync(rpc_world.peer(), torch.add, (torch.ones(2), i), timeout=30)[0] == i + 1
    time.sleep(0.3)
    # At most a timer or two armed for earlier tests' calls, due meanwhile by chance.
    assert len(checks) <= 2, f"{len(checks)} deadline checks in 0.3 s without a pending call"


BAD_TIMEOUTS = [-5, -0.001, -1.5, float("nan"), float("inf"), float("-inf"), "1", None, True]
TIMEOUT_RULE = (
    r"timeout must be a number of seconds >= 0 \(0: no timeout\) or "
    r"UNSET_RPC_TIMEOUT \(-1\) for the default; got "
)


@pytest.mark.parametrize("bad", BAD_TIMEOUTS, ids=repr)
def test_bad_timeout_raises_before_sending(rpc_world, sent, bad):
    peer = rpc_world.peer()
    rref = rpc.remote(peer, takes_one, (torch.ones(1),))
    rref.to_here()
    sent.requests = 0
    calls = [
        lambda: rpc.rpc_sync(peer, takes_one, (1,), timeout=bad),
        lambda: rpc.rpc_async(peer, takes_one, (1,), timeout=bad),
        lambda: rpc.remote(peer, takes_one, (1,), timeout=bad),
        lambda: rref.to_here(timeout=bad),
        lambda: rref.rpc_sync(timeout=bad),
        lambda: rref.rpc_async(timeout=bad),
        lambda: rref.remote(timeout=bad),
        lambda: rref._get_type(timeout=bad),
    ]
    # A number out of range is a ValueError; another type a TypeError, as torch's.
    error = ValueError if type(bad) in (int, float) else TypeError
    for call in calls:
        with pytest.raises(error, match=TIMEOUT_RULE) as info:
            call()
        got = repr(bad) if type(bad) in (int, float) else f"{bad!r} ({type(bad).__name__})"
        assert f"; got {got}" in str(info.value)
    with pytest.raises(
        error,
        match=r"rpc_timeout must be a number of seconds >= 0 "
        r"\(0: no timeout\); got ",
    ):
        rpc._set_rpc_timeout(bad)
    with pytest.raises(ValueError, match="rpc_timeout must be"):
        rpc._set_rpc_timeout(rpc.UNSET_RPC_TIMEOUT)  # the default cannot be "the default"
    assert rpc.get_rpc_timeout() == 60.0
    assert sent.requests == 0
    # The allowed values still work: the default marker, 0 (none) and positive numbers.
    for good in (rpc.UNSET_RPC_TIMEOUT, -1, 0, 0.0, 5, 2.5):
        assert rpc.rpc_sync(peer, takes_one, (good,), timeout=good) == good
        assert rref.rpc_sync(timeout=good).size() == torch.Size([1])
    assert_usable(rpc_world)


def test_timeout_error_names_the_timeout_and_the_destination(rpc_world):
    peer, peer_rank = rpc_world.peer(), rpc_world.peer_rank()
    where = rf"and will now be marked with an error \(call to {peer}, rank {peer_rank}\)$"
    with pytest.raises(
        RuntimeError, match=r"^RPC ran for more than set timeout \(0\.001 ms\) " + where
    ):
        rpc.rpc_sync(peer, sleep_then_return, (0.3, 1), timeout=1e-6)
    with pytest.raises(RuntimeError, match=r"set timeout \(100 ms\) " + where):
        rpc.rpc_async(peer, sleep_then_return, (0.6, 2), timeout=0.1).wait()
    rref = rpc.remote(peer, sleep_then_return, (0.6, 3), timeout=0.0005)
    with pytest.raises(RuntimeError, match=r"set timeout \(0\.5 ms\) " + where):
        rref._get_future().wait()
    with pytest.raises(
        RuntimeError,
        match=r"RRef creation via rpc.remote\(\) timed out, and it "
        r"is possible that the RRef on the owner node does "
        rf"not exist\. \(owner: {peer}, rank {peer_rank}\)",
    ):
        rref.to_here()
    assert_usable(rpc_world)


def test_answered_calls_stop_being_watched_while_calls_keep_coming(rpc_world):
    # One call stays pending throughout, as in any busy job: the deadlines of the
    # answered ones must still be dropped (they once piled up for a whole timeout).
    agent = dispatch.current_agent()
    gate = ("watched", rpc_world.rank)
    slow = rpc.rpc_async(rpc_world.peer(), wait_at_gate, (gate, 9))
    for _ in range(1000):
        rpc.rpc_sync(rpc_world.peer(), torch.add, (torch.ones(1), 1))
    # Each new call drops them from the watch once they outnumber the pending calls.
    assert wait_until(lambda: len(agent._deadlines) <= 2 * agent.num_pending() + 64), (
        f"{len(agent._deadlines)} deadlines watched for {agent.num_pending()} pending calls"
    )
    assert not slow.done()
    rpc.rpc_sync(rpc_world.peer(), open_gate, (gate,))
    assert slow.wait() == 9


def test_to_here_timeout(rpc_world):
    rref = rpc.remote(rpc_world.peer(), sleep_then_return, (0.6, 8))
    with pytest.raises(RuntimeError, match="RPC ran for more than"):
        rref.to_here(timeout=0.1)
    assert rref.to_here() == 8
    assert_usable(rpc_world)


# ---------------------------------------------------------------------------
# RRefs used wrongly


def test_local_value_on_non_owner_raises(rpc_world):
    rref = rpc.remote(rpc_world.peer(), torch.add, (torch.ones(2), 1))
    me, owner = rpc.get_worker_info(), rpc.get_worker_info(rpc_world.peer())
    pattern = (
        r"^For UserRRef\(rref_id=GloballyUniqueId\(created_on=\d+, local_id=\d+\), "
        r"fork_id=GloballyUniqueId\(created_on=\d+, local_id=\d+\)\), can't call localValue\(\) "
        rf"on user {re.escape(repr(me))}\. Call it on owner {re.escape(repr(owner))}$"
    )
    with pytest.raises(RuntimeError, match=pattern):
        rref.local_value()
    assert torch.equal(rref.to_here(), torch.full((2,), 2.0))
    assert_usable(rpc_world)


def test_pickling_rref_outside_rpc_raises(rpc_world, tmp_path):
    local = rpc.RRef(torch.ones(2))
    user = rpc.remote(rpc_world.peer(), torch.add, (torch.ones(2), 1))
    for rref in (local, user):
        with pytest.raises(RuntimeError, match="Can not pickle rref in python pickler"):
            pickle.dumps(rref)
        with pytest.raises(RuntimeError, match="Can not pickle rref in python pickler"):
            torch.save(rref, tmp_path / "rref.pt")
        with pytest.raises(RuntimeError, match="Can not pickle rref in python pickler"):
            torch.save({"nested": [rref]}, tmp_path / "rref.pt")
    assert torch.equal(user.to_here(), torch.full((2,), 2.0))
    assert_usable(rpc_world)
