"""Profiling as torch's RPC profiling does it: the legacy ``torch.autograd.profiler_legacy``
profiler's remote events and node ids, the callee's ``record_shapes`` / ``profile_memory``,
torch's names of the send and recv functions in a distributed backward, RRefs'
profiling futures, and the server-side process-global profiler.

torch's own tests of these (``torch/testing/_internal/distributed/rpc/rpc_test.py``,
``dist_autograd_test.py``) run with ``from torch.autograd.profiler_legacy import profile``.
"""

from __future__ import annotations

import contextlib
import json
import time

import pytest
import torch
from torch.autograd.profiler_legacy import profile as legacy_profile

import lightning_distgrad.autograd as dist_autograd
from lightning_distgrad import profiler, rpc
from lightning_distgrad._compat import CFuture
from lightning_distgrad.rpc._calls import remote_events, server_profiler

REMOTE_OP = "#remote_op: "
#: What ``ops`` runs, as a profiler names it (torch's EXPECTED_REMOTE_EVENTS, in short).
OPS = ["aten::ones", "aten::add", "aten::mul", "aten::relu", "aten::sigmoid"]


def ops():
    t = torch.add(torch.ones(1), torch.ones(1))
    return torch.mul(t, t).relu().sigmoid()


def sleep_then_mul(seconds):
    time.sleep(seconds)
    return torch.mul(torch.tensor(1), torch.tensor(1))


def slow_add(x, y):
    time.sleep(0.2)
    return torch.add(x, y)


@rpc.functions.async_execution
def slow_add_on(worker, x, y):
    return rpc.rpc_async(worker, slow_add, (x, y))


def events_of(profile_rref):
    return profile_rref.local_value().process_global_function_events


def top_level_names(per_request: list) -> list[str]:
    """Names of the events no other event of their request contains (torch's check)."""
    names = []
    for events in per_request:
        last_end = 0
        for event in events:
            if event.time_range.start > last_end:
                names.append(event.name)
                last_end = event.time_range.end
    return sorted(names)


@pytest.mark.mpi(min_size=2)
def test_the_legacy_profiler_lists_the_callees_events_with_their_node(rpc_world, tmp_path):
    me, peer, peer_rank = rpc_world.name, rpc_world.peer(), rpc_world.peer_rank()
    with legacy_profile() as prof:
        rpc.rpc_async(peer, ops).wait()
    events = prof.function_events
    key = f"rpc_async#ops({me} -> {peer})"
    (call,) = [e for e in events if e.name == key]
    assert call.node_id == rpc_world.rank  # local events carry this worker's id
    remote = {e.name: e for e in events if e.is_remote}
    for op in OPS:
        event = remote[f"{key}{REMOTE_OP}{op}"]
        assert event.node_id == peer_rank
        # Inside the call, and listed after it: the call is the first event naming it.
        assert call.time_range.start <= event.time_range.start
        assert event.time_range.end <= call.time_range.end
    assert [e for e in events if "rpc_async" in e.name][0] is call
    assert not [n for n in remote if "rpc_serve#" in n]  # what the function ran, only
    # The chrome trace a user opens shows the remote events too.
    path = tmp_path / f"trace{rpc_world.rank}.json"
    prof.export_chrome_trace(str(path))
    names = {event["name"] for event in json.loads(path.read_text())}
    assert {key, f"{key}{REMOTE_OP}aten::mul"} <= names
    assert not remote_events._expected


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["legacy", "kineto"])
def test_record_shapes_and_profile_memory_reach_the_callee(rpc_world, kind):
    peer = rpc_world.peer()
    if kind == "legacy":
        profile = legacy_profile
    else:  # Kineto records RPCs inside record_rpcs() only (torch's records none)

        @contextlib.contextmanager
        def profile(**kwargs):
            with profiler.record_rpcs(), torch.autograd.profiler.profile(**kwargs) as prof:
                yield prof

    t1, t2 = torch.ones(100), torch.ones(100)
    with profile(record_shapes=True) as prof:
        rpc.rpc_sync(peer, torch.add, (t1, t2))
    (remote_add,) = [
        e for e in prof.function_events if e.is_remote and e.name.endswith("aten::add")
    ]
    with profile(record_shapes=True) as local:
        torch.add(t1, t2)
    (local_add,) = [e for e in local.function_events if e.name == "aten::add"]
    assert local_add.input_shapes[:2] == [[100], [100]]
    assert remote_add.input_shapes == local_add.input_shapes
    # Memory: recorded by the callee when the caller's profiler records it, only then.
    for profile_memory in (True, False):
        with profile(profile_memory=profile_memory) as prof:
            rpc.rpc_async(peer, ops).wait()
        remote = [e for e in prof.function_events if e.is_remote]
        assert remote
        usage = {e.cpu_memory_usage for e in remote}
        assert (usage != {0}) is profile_memory, usage
        if not profile_memory:
            assert {e.cpu_memory_usage for e in prof.function_events} == {0}


@pytest.mark.mpi(min_size=2)
def test_an_async_functions_nested_call_comes_back_under_the_legacy_profiler(rpc_world):
    me, peer, third = rpc_world.name, rpc_world.peer(), rpc_world.peer(2)
    x = torch.ones(2)
    with legacy_profile() as prof:
        assert torch.equal(rpc.rpc_async(peer, slow_add_on, (third, x, x)).wait(), x + x)
    remote = [e for e in prof.function_events if e.is_remote]
    nested = (
        f"rpc_async#slow_add_on({me} -> {peer}){REMOTE_OP}rpc_async#slow_add({peer} -> {third})"
    )
    assert [e.node_id for e in remote if e.name == nested] == [rpc_world.peer_rank()]
    added = [e.node_id for e in remote if e.name == f"{nested}{REMOTE_OP}aten::add"]
    assert added == [rpc_world.peer_rank(2)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("to_self", [False, True])
def test_an_rref_profiling_future_completes_once_its_creation_is_recorded(rpc_world, to_self):
    me = rpc_world.name
    dst = me if to_self else rpc_world.peer()
    with legacy_profile() as prof:
        rref = rpc.remote(dst, sleep_then_mul, (0.1,))
        assert rref.to_here() == 1
        future = rref._get_profiling_future()
        assert isinstance(future, CFuture)  # as torch's: a torch._C.Future
        future.wait()
    events = prof.function_events
    (creation,) = [e for e in events if e.name == f"rpc_remote#sleep_then_mul({me} -> {dst})"]
    assert creation.node_id == rpc_world.rank
    (mul,) = [e for e in events if e.is_remote and e.name.endswith("aten::mul")]
    assert mul.node_id == rpc.get_worker_info(dst).id
    # The creation's span ended once the owner had run the function.
    assert creation.time_range.start <= mul.time_range.start
    assert mul.time_range.end <= creation.time_range.end


@pytest.mark.mpi(min_size=2)
def test_the_distributed_backward_records_torchs_send_and_recv_functions(rpc_world):
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync(rpc_world.peer(), torch.add, (t1, t2)).sum()
        with torch.autograd.profiler.profile() as prof:
            dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
    assert torch.equal(grads[t1], torch.ones(3, 3))
    events = prof.function_events

    def named(name: str) -> list:
        return [e for e in events if e.name == f"torch::distributed::autograd::{name}"]

    (backward,) = named("backward")
    (send,) = named("SendRpcBackward")  # this pass's: the send of t1 and t2
    (recv,) = named("RecvRpcBackward")  # this pass's: the recv of the sum's input
    for event in (send, recv):
        assert backward.time_range.start <= event.time_range.start
        assert event.time_range.end <= backward.time_range.end
        assert backward.cpu_time_total > event.cpu_time_total


@pytest.mark.mpi(min_size=2)
def test_the_server_side_profile_records_every_request_its_worker_serves(rpc_world):
    dst = rpc_world.peer()
    x, y = torch.tensor(1), torch.tensor(2)
    # Each rank profiles its peer, whose requests all come from this rank.
    outer = rpc.remote(dst, rpc._server_process_global_profile)
    outer.rpc_sync().__enter__()
    rpc.rpc_sync(dst, torch.add, (x, y))
    inner = rpc.remote(dst, rpc._server_process_global_profile)
    inner.rpc_sync().__enter__()
    rpc.rpc_sync(dst, torch.sub, (x, y))
    inner.rpc_sync().__exit__(None, None, None)
    outer.rpc_sync().__exit__(None, None, None)
    inner_names = top_level_names(rpc.rpc_sync(dst, events_of, (inner,)))
    outer_names = top_level_names(rpc.rpc_sync(dst, events_of, (outer,)))
    assert inner_names == ["aten::sub"], inner_names
    assert outer_names == ["aten::add", "aten::sub"], outer_names
    averages = {e.key: e.count for e in outer.rpc_sync().key_averages()}
    assert averages["aten::add"] == averages["aten::sub"] == 1
    rpc_world.barrier()  # every rank's peer has closed its ranges
    assert not server_profiler.ranges
    with pytest.raises(RuntimeError, match="no server-side profiling range is open"):
        rpc._disable_server_process_global_profiler()


@pytest.mark.mpi(min_size=2)
def test_a_range_left_open_ends_with_its_rpc_session(rpc_stopped):
    rpc.init_rpc()
    peer = rpc_stopped.peer()
    left_open = rpc.remote(peer, rpc._server_process_global_profile)
    left_open.rpc_sync().__enter__()  # never exited, as after a failed test
    rpc_stopped.barrier()
    rpc.shutdown()
    assert len(server_profiler.ranges) == 1
    rpc.init_rpc()
    # The next session serves its requests unprofiled, and its ranges start afresh.
    assert not server_profiler.ranges
    rpc_stopped.barrier()  # before any rank opens a range on its peer in this session
    profile = rpc.remote(peer, rpc._server_process_global_profile)
    profile.rpc_sync().__enter__()
    rpc.rpc_sync(peer, torch.add, (torch.ones(1), 1))
    profile.rpc_sync().__exit__(None, None, None)
    assert top_level_names(rpc.rpc_sync(peer, events_of, (profile,))) == ["aten::add"]
    rpc_stopped.barrier()
    rpc.shutdown()


@pytest.mark.mpi(min_size=2)
def test_a_callers_profiler_gets_its_events_while_a_server_side_range_is_open(rpc_world):
    me, peer = rpc_world.name, rpc_world.peer()
    profile = rpc.remote(peer, rpc._server_process_global_profile)
    profile.rpc_sync().__enter__()
    with legacy_profile() as prof:
        rpc.rpc_async(peer, ops).wait()
    profile.rpc_sync().__exit__(None, None, None)
    remote = {e.name for e in prof.function_events if e.is_remote}
    assert {f"rpc_async#ops({me} -> {peer}){REMOTE_OP}{op}" for op in OPS} <= remote
