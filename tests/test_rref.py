"""RRefs: the owner/user API, passing RRefs around, and reference counting.

Lifetime tests check the owner's side through RPCs: its RRef table
(``num_owner_rrefs``) and whether the value object still exists. Every rank
runs each test at once, each as the creator of its own RRefs, so owners see
traffic from several users at the same time.
"""

from __future__ import annotations

import contextlib
import gc
import queue
import re
import threading
import time
import weakref

import pytest
import torch
from _timing import scaled

from lightning_distgrad import rpc

pytestmark = pytest.mark.mpi(min_size=2)

#: Seconds a lifetime test waits for deletes to reach the owners.
SETTLE_TIMEOUT_S = scaled(20.0)


# ---------------------------------------------------------------------------
# Remote functions and state (module level: the callee imports them by name)


class Tracked:
    """A value whose lifetime the owner can report (see :func:`alive`)."""

    def __init__(self, tag, value=0):
        self.tag = tag
        self.value = value
        _ALIVE.add(self)

    def get(self):
        return self.value

    def add(self, n):
        self.value += n
        return self.value

    @rpc.functions.async_execution
    def add_later(self, n):
        fut = torch.futures.Future()
        threading.Timer(0.05, lambda: fut.set_result(self.value + n)).start()
        return fut


_ALIVE: weakref.WeakSet = weakref.WeakSet()
_HELD: dict = {}
_HELD_LOCK = threading.Lock()


def make_tracked(tag, value=0):
    return Tracked(tag, value)


def alive(tag) -> int:
    """How many ``Tracked`` objects with ``tag`` exist in this process."""
    return sum(1 for t in list(_ALIVE) if t.tag == tag)


def owner_table() -> dict:
    """The owner's table (for failure messages): rref id -> fork ids."""
    from lightning_distgrad.rpc._rrefs import bookkeeping

    gc.collect()
    return {k: sorted(e.forks) for k, e in list(bookkeeping.current_context().owners.items())}


def owner_rref_count() -> int:
    return rpc._rref_context_get_debug_info()["num_owner_rrefs"]


def hold(key, rref):
    with _HELD_LOCK:
        _HELD[key] = rref
    return rref.is_owner()


def hold_and_fetch(key, rref):
    hold(key, rref)
    return fetch_held(key)


def fetch_held(key):
    rref = _HELD[key]
    if rref.is_owner():
        return rref.local_value().get()
    return rref.to_here(timeout=scaled(20)).get()


def drop_held(key):
    with _HELD_LOCK:
        del _HELD[key]


def fetch(rref):
    return rref.to_here()


def fetch_sum(a, b):
    return a.to_here() + b.to_here()


def describe(rref):
    """What the callee sees of an RRef it received."""
    return {
        "is_owner": rref.is_owner(),
        "owner": rref.owner(),
        "owner_name": rref.owner_name(),
        "value": rref.local_value() if rref.is_owner() else rref.to_here(),
    }


def local_value_of(rref):
    return rref.local_value()


def make_local_rref(value):
    return rpc.RRef(value)


def make_rref_pair(a, b):
    return (rpc.RRef(a), rpc.RRef(b))


def make_remote_on(to, value):
    return rpc.remote(to, torch.add, (value, 0))


def pass_on(to, rref):
    """A user that receives an RRef hands it to ``to`` and drops its own copy at once."""
    result = rpc.rpc_sync(to, hold_and_fetch, (("passed", rpc.get_worker_info().id), rref))
    return result


def confirmed(rref):
    return rref.confirmed_by_owner()


def fetch_soon(rref):
    """``to_here`` with a short timeout: a lost fetch fails the test instead of hanging it."""
    return rref.to_here(timeout=scaled(10)).get()


def get_through_proxy(rref):
    return rref.rpc_sync(timeout=scaled(10)).get()


_GATES: dict = {}
_GATES_LOCK = threading.Lock()


def _gate(tag) -> threading.Event:
    with _GATES_LOCK:
        return _GATES.setdefault(tag, threading.Event())


def make_tracked_when_opened(tag, value):
    """A creation that runs until :func:`open_gate` (bounded: a lost open fails the test)."""
    assert _gate(tag).wait(SETTLE_TIMEOUT_S), "the gate was never opened"
    return Tracked(tag, value)


def open_gate(tag) -> None:
    _gate(tag).set()


def fetch_and_drop(rref):
    """Use an RRef at once; the caller's copy is dropped on return (a delete to the owner)."""
    return rref.to_here(timeout=scaled(10)).get()


# ---------------------------------------------------------------------------
# Helpers


def wait_for(predicate, what: str, details=None, timeout: float = SETTLE_TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = f": {details()}" if details is not None else ""
            raise AssertionError(f"timed out after {timeout} s waiting for {what}{extra}")
        time.sleep(0.01)


class _SlowLink:
    """Holds back every frame this rank sends to ``dst`` for ``delay`` s, keeping their order.

    MPI keeps the frames between one pair of ranks in order, but nothing orders
    frames from different senders: a frame this rank sends to ``dst`` may
    arrive after a later one that went through a third rank (another node, a
    busy link). This makes that happen every time.
    """

    def __init__(self, transport, dst: int, delay: float):
        self._transport = transport
        self._send = transport.send
        self._dst = dst
        self._delay = delay
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._forward, daemon=True)

    def send(self, dst, frame, tensors, devices=None):
        if dst == self._dst:
            with self._lock:
                if not self._closed:
                    self._queue.put((time.monotonic() + self._delay, frame, tensors, devices))
                    return None
            self._thread.join()  # closed meanwhile: the frames held back go first
        return self._send(dst, frame, tensors, devices)

    def _forward(self):
        while (item := self._queue.get()) is not None:
            due, frame, tensors, devices = item
            time.sleep(max(0.0, due - time.monotonic()))
            self._send(self._dst, frame, tensors, devices)

    def __enter__(self):
        self._thread.start()
        self._transport.send = self.send
        return self

    def __exit__(self, *exc):
        with self._lock:
            self._closed = True
            self._queue.put(None)
        self._thread.join()  # the held-back frames are sent by now
        del self._transport.send  # back to the class's method


@contextlib.contextmanager
def slow_link_to(to: str, delay: float = 0.3):
    """Delay this rank's frames to worker ``to`` (see :class:`_SlowLink`)."""
    from lightning_distgrad.rpc._calls import dispatch

    with _SlowLink(dispatch.require_agent().transport, rpc.get_worker_info(to).id, delay):
        yield


def settle(world) -> None:
    """Drop garbage everywhere, then wait until every owner table is empty."""
    gc.collect()
    world.barrier()
    for name in world.names:
        wait_for(
            lambda n=name: rpc.rpc_sync(n, owner_rref_count) == 0,
            f"{name}'s RRef table to empty",
            lambda n=name: rpc.rpc_sync(n, owner_table),
        )
    world.barrier()


# ---------------------------------------------------------------------------
# Owner and user API


def test_local_rref_is_owner_and_returns_the_value_itself(rpc_world):
    value = {"t": torch.ones(2)}
    rref = rpc.RRef(value)
    assert rref.is_owner() and rref.confirmed_by_owner()
    assert rref.owner() == rpc.get_worker_info()
    assert rref.owner_name() == rpc_world.name
    assert rref.local_value() is value
    assert rref.to_here() is value
    assert rpc.RRef(35).local_value() == 35
    assert re.fullmatch(
        r"OwnerRRef\(GloballyUniqueId\(created_on=\d+, local_id=\d+\)\)", repr(rref)
    )


def test_remote_returns_user_rref_to_value_on_owner(rpc_world):
    x = torch.arange(4.0)
    rref = rpc.remote(rpc_world.peer(), torch.add, (x, 1))
    assert isinstance(rref, rpc.RRef)
    assert not rref.is_owner()
    owner = rpc.get_worker_info(rpc_world.peer())
    assert rref.owner() == owner and rref.owner_name() == owner.name
    assert hash(rref.owner()) == hash(owner)
    assert torch.equal(rref.to_here(), x + 1)
    rref._get_future().wait()
    assert rref.confirmed_by_owner()
    assert re.fullmatch(
        rf"UserRRef\(RRefId = GloballyUniqueId\(created_on={rpc_world.rank}, local_id=(\d+)\), "
        rf"ForkId = GloballyUniqueId\(created_on={rpc_world.rank}, local_id=(\d+)\)\)",
        repr(rref),
    )
    rref_id, fork_id = map(int, re.search(r"local_id=(\d+).*local_id=(\d+)", repr(rref)).groups())
    assert fork_id == rref_id + 1


def test_remote_python_function_and_multiple_remotes(rpc_world):
    rrefs = [
        rpc.remote(rpc_world.names[i % rpc_world.size], make_tracked, ("multi", i))
        for i in range(20)
    ]
    assert [r.to_here().value for r in rrefs] == list(range(20))
    assert [r.owner().id for r in rrefs] == [i % rpc_world.size for i in range(20)]


def test_remote_to_self_gives_owner_rref(rpc_world):
    rref = rpc.remote(rpc_world.name, make_tracked, ("self", 3))
    assert rref.is_owner()
    assert rref.local_value().value == 3
    assert rref.to_here() is rref.local_value()
    assert rref.owner() == rpc.get_worker_info()


def test_to_here_on_owner_and_user_agree(rpc_world):
    rref = rpc.remote(rpc_world.peer(), torch.ones, (3,))
    on_owner = rpc.rpc_sync(rpc_world.peer(), describe, (rref,))
    assert on_owner["is_owner"] and on_owner["owner_name"] == rpc_world.peer()
    assert torch.equal(on_owner["value"], rref.to_here())


# ---------------------------------------------------------------------------
# Method proxies


def test_rref_proxies_run_methods_on_the_owner(rpc_world):
    rref = rpc.remote(rpc_world.peer(), make_tracked, ("proxy", 10))
    assert rref.rpc_sync().get() == 10
    assert rref.rpc_sync().add(5) == 15
    assert rref.rpc_async().add(1).wait() == 16
    result = rref.remote().add(4)
    assert isinstance(result, rpc.RRef) and result.owner_name() == rpc_world.peer()
    assert result.to_here() == 20
    assert rref.to_here().value == 20  # the owner's object was changed in place
    assert rref.rpc_sync().add_later(2) == 22  # an @async_execution method
    assert rref.rpc_async().add_later(3).wait() == 23
    with pytest.raises(AttributeError, match="non_exist"):
        rref.rpc_sync().non_exist()


def test_rref_proxy_of_a_missing_method_raises_attribute_error(rpc_world):
    # As torch: every proxy looks the method up on the value's type first.
    rref = rpc.remote(rpc_world.peer(), make_tracked, ("missing", 1))
    with pytest.raises(AttributeError, match="has no attribute 'non_exist'"):
        rref.remote().non_exist()
    with pytest.raises(AttributeError, match="has no attribute 'non_exist'"):
        rref.rpc_async().non_exist().wait()
    with pytest.raises(AttributeError, match="has no attribute 'non_exist'"):
        rref.rpc_sync().non_exist()
    assert rref.remote().add(1).to_here() == 2  # the RRef still works
    del rref
    settle(rpc_world)  # failed proxy calls keep nothing alive on the owner


@pytest.mark.parametrize("mode", ["rpc_sync", "rpc_async", "remote"])
def test_rref_proxy_times_out_while_the_value_is_being_created(rpc_world, mode):
    tag = ("gated", mode, rpc_world.rank)
    rref = rpc.remote(rpc_world.peer(), make_tracked_when_opened, (tag, 3))
    proxy = getattr(rref, mode)(timeout=0.05)
    with pytest.raises(RuntimeError, match="RPC ran for more than set timeout"):
        result = proxy.add(1)
        if mode == "rpc_async":
            result.wait()
    rpc.rpc_sync(rpc_world.peer(), open_gate, (tag,))
    result = getattr(rref, mode)(timeout=scaled(10)).get()  # the value exists now
    if mode == "rpc_async":
        result = result.wait()
    elif mode == "remote":
        result = result.to_here()
    assert result == 3
    del rref, proxy
    settle(rpc_world)  # timed-out proxy calls keep nothing alive on the owner


def test_rref_proxies_on_tensor_and_local_rref(rpc_world):
    tensor_rref = rpc.remote(rpc_world.peer(), torch.ones, (2, 3))
    assert tensor_rref.rpc_sync().size() == torch.Size([2, 3])
    assert torch.equal(tensor_rref.rpc_async().add(1).wait(), torch.full((2, 3), 2.0))
    local = rpc.RRef(Tracked("proxy-local", 7))
    assert local.rpc_sync().add(1) == 8
    assert local.remote().get().to_here() == 8


# ---------------------------------------------------------------------------
# Passing RRefs around


def test_user_rref_passed_to_owner_becomes_owner_rref(rpc_world):
    rref = rpc.remote(rpc_world.peer(), make_tracked, ("to-owner", 5))
    seen = rpc.rpc_sync(rpc_world.peer(), describe, (rref,))
    assert seen["is_owner"] and seen["value"].value == 5
    assert rpc.rpc_sync(rpc_world.peer(), local_value_of, (rref,)).value == 5


def test_local_rref_passed_to_user_is_fetched_from_owner(rpc_world):
    value = torch.arange(5.0)
    local = rpc.RRef(value)
    seen = rpc.rpc_sync(rpc_world.peer(), describe, (local,))
    assert not seen["is_owner"]
    assert seen["owner"] == rpc.get_worker_info()
    assert torch.equal(seen["value"], value)
    # Through all three APIs (torch's test_pass_local_rrefs).
    assert torch.equal(rpc.rpc_async(rpc_world.peer(), fetch, (local,)).wait(), value)
    assert torch.equal(rpc.remote(rpc_world.peer(), fetch, (local,)).to_here(), value)


def test_local_rref_passed_to_self(rpc_world):
    local = rpc.RRef(torch.ones(2))
    assert rpc.rpc_sync(rpc_world.name, describe, (local,))["is_owner"]
    user = rpc.remote(rpc_world.peer(), torch.ones, (2,))
    seen = rpc.rpc_sync(rpc_world.name, describe, (user,))
    assert not seen["is_owner"] and torch.equal(seen["value"], torch.ones(2))


@pytest.mark.mpi(min_size=3)
def test_user_rrefs_passed_to_a_third_worker(rpc_world):
    owner, third = rpc_world.peer(1), rpc_world.peer(2)
    a = rpc.remote(owner, torch.add, (torch.ones(2), 1))
    b = rpc.remote(owner, torch.add, (torch.ones(2), 2))
    assert torch.equal(rpc.rpc_sync(third, fetch_sum, (a, b)), torch.full((2,), 5.0))
    seen = rpc.rpc_sync(third, describe, (a,))
    assert not seen["is_owner"] and seen["owner_name"] == owner
    assert torch.equal(rpc.remote(third, fetch, (b,)).to_here(), torch.full((2,), 3.0))


def test_rpc_can_return_rrefs(rpc_world):
    # Owned by the callee.
    rref = rpc.rpc_sync(rpc_world.peer(), make_local_rref, (torch.ones(2),))
    assert rref.owner_name() == rpc_world.peer()
    assert torch.equal(rref.to_here(), torch.ones(2))
    # Owned by the caller: it comes back as the caller's own OwnerRRef.
    back = rpc.rpc_sync(rpc_world.peer(), make_remote_on, (rpc_world.name, torch.ones(2)))
    assert back.is_owner() and torch.equal(back.local_value(), torch.ones(2))
    # Owned by a third worker (the callee itself on 2 ranks).
    third = rpc_world.peer(2)
    other = rpc.rpc_sync(rpc_world.peer(), make_remote_on, (third, torch.ones(2)))
    assert other.owner_name() == third
    assert torch.equal(other.to_here(), torch.ones(2))


@pytest.mark.mpi(min_size=3)
def test_third_worker_overtakes_the_creator_on_its_way_to_the_owner(rpc_world):
    # Every frame from this rank to the owner comes late: the remote() that
    # creates the value and the add_fork of the fork sent to the third worker
    # reach the owner after the third worker's own requests and deletes.
    tag = ("overtaken", rpc_world.rank)
    owner, third = rpc_world.peer(1), rpc_world.peer(2)
    with slow_link_to(owner):
        # The third worker fetches a value whose creation has not reached the owner.
        rref = rpc.remote(owner, make_tracked, (tag, 5))
        assert rpc.rpc_sync(third, fetch_soon, (rref,)) == 5
        # ... and sends it back to the owner in a method call.
        rref = rpc.remote(owner, make_tracked, (tag, 6))
        assert rpc.rpc_sync(third, get_through_proxy, (rref,)) == 6
        # The third worker's delete reaches the owner before the fork's registration
        # and the creation: this worker's reference still keeps the value.
        rref = rpc.remote(owner, make_tracked, (tag, 7))
        assert rpc.rpc_sync(third, fetch_and_drop, (rref,)) == 7
        assert rref.to_here(timeout=scaled(10)).get() == 7
        # A peer creates a value on the worker after it and returns it here; its
        # frames to that owner are late (every rank runs this with its own slow link).
        other = rpc.rpc_sync(rpc_world.peer(), make_remote_on, (third, torch.ones(2)))
        assert torch.equal(other.to_here(timeout=scaled(10)), torch.ones(2))
        del rref, other
    wait_for(
        lambda: rpc.rpc_sync(owner, alive, (tag,)) == 0,
        "the owner to drop the values",
        lambda: rpc.rpc_sync(owner, owner_table),
    )
    settle(rpc_world)


def test_nested_rrefs(rpc_world):
    outer = rpc.remote(rpc_world.peer(), make_rref_pair, (torch.ones(2), torch.zeros(2)))
    first, second = outer.to_here()
    assert first.owner_name() == second.owner_name() == rpc_world.peer()
    assert torch.equal(first.to_here(), torch.ones(2))
    assert torch.equal(second.to_here(), torch.zeros(2))


def test_rrefs_are_confirmed_by_owner(rpc_world):
    rref = rpc.remote(rpc_world.peer(), torch.ones, (2,))
    rref._get_future().wait()
    assert rref.confirmed_by_owner()
    assert rpc.rpc_sync(rpc_world.peer(), confirmed, (rref,))  # on the owner
    # A fork the owner hands out is registered before it is sent.
    assert rpc.rpc_sync(rpc_world.peer(), confirmed, (rpc.RRef(1),))


def test_user_rref_received_from_a_user_is_confirmed_when_its_function_runs(rpc_world):
    # The creator hands its RRef to a worker other than the owner (itself on 2 ranks):
    # as in torch, the function runs once the owner has confirmed that fork.
    owner, receiver = rpc_world.peer(1), rpc_world.peer(2)
    rref = rpc.remote(owner, torch.add, (torch.zeros(2), 1))
    assert rpc.rpc_sync(receiver, confirmed, (rref,))
    assert rpc.remote(receiver, confirmed, (rref,)).to_here()
    assert rpc.rpc_async(receiver, fetch, (rref,)).wait().tolist() == [1.0, 1.0]
    # A fork received before its creation finished is confirmed too.
    tag = ("confirm-gated", rpc_world.rank)
    gated = rpc.remote(owner, make_tracked_when_opened, (tag, 4))
    pending = rpc.rpc_async(receiver, confirmed, (gated,))
    rpc.rpc_sync(owner, open_gate, (tag,))
    assert pending.wait()
    assert gated.to_here(timeout=scaled(10)).value == 4


def test_user_of_a_timed_out_creation_is_no_longer_pending(rpc_world):
    tag = ("creation-timeout", rpc_world.rank)
    rref = rpc.remote(rpc_world.peer(), make_tracked_when_opened, (tag, 1), timeout=0.05)
    with pytest.raises(RuntimeError, match="RPC ran for more than set timeout"):
        rref._get_future().wait()
    assert not rref.confirmed_by_owner()
    # As torch's: it will never be confirmed, so nothing waits for it.
    assert rpc._rref_context_get_debug_info()["num_pending_users"] == 0
    with pytest.raises(RuntimeError, match="RRef creation via rpc.remote\\(\\) timed out"):
        rref.to_here()
    rpc.rpc_sync(rpc_world.peer(), open_gate, (tag,))
    del rref
    settle(rpc_world)


def raise_value_error():
    raise ValueError("creation failed on purpose")


def test_rref_type(rpc_world):
    rref = rpc.remote(rpc_world.peer(), make_tracked, ("type", 1))
    assert rref._get_type() is Tracked
    assert rpc.RRef(3)._get_type() is int
    # As torch's: the non-blocking form returns the one future of the answer, kept.
    other = rpc.remote(rpc_world.peer(), torch.ones, (2,))
    first = other._get_type(blocking=False)
    assert first.wait() is torch.Tensor
    assert other._get_type(blocking=False) is first and other._get_type() is torch.Tensor


@pytest.mark.parametrize("blocking", [True, False])
def test_rref_type_of_a_failed_creation_raises_its_error(rpc_world, blocking):
    rref = rpc.remote(rpc_world.peer(), raise_value_error)
    with pytest.raises(ValueError, match="creation failed on purpose"):
        result = rref._get_type(blocking=blocking)
        if not blocking:
            result.wait()


# ---------------------------------------------------------------------------
# Reference counting and lifetime


def test_local_rref_is_not_in_owner_table_until_shared(rpc_world):
    settle(rpc_world)
    if rpc_world.rank == 0:  # one driver: the counts are exact
        info = rpc._rref_context_get_debug_info
        local = rpc.RRef(torch.ones(2))
        assert info()["num_owner_rrefs"] == 0
        rpc.rpc_sync(rpc_world.peer(), hold, ("shared-local", local))
        assert info()["num_owner_rrefs"] == 1 and info()["num_forks"] == 1
        rpc.rpc_sync(rpc_world.peer(), drop_held, ("shared-local",))
        wait_for(lambda: info()["num_owner_rrefs"] == 0, "the fork delete")
        assert torch.equal(local.local_value(), torch.ones(2))  # the owner's own reference
        r1 = rpc.remote(rpc_world.peer(), torch.ones, (1,))
        r2 = rpc.remote(rpc_world.peer(), torch.ones, (1,))
        r1.to_here(), r2.to_here()
        remote_info = rpc.rpc_sync(rpc_world.peer(), rpc._rref_context_get_debug_info)
        assert remote_info["num_owner_rrefs"] == 2
        assert info()["num_pending_users"] == 0
        del r1, r2
    settle(rpc_world)


def test_owner_drops_value_when_last_user_reference_is_gone(rpc_world):
    tag = ("last-user", rpc_world.rank)
    owner = rpc_world.peer()
    rref = rpc.remote(owner, make_tracked, (tag, 1))
    assert rref.to_here().value == 1
    assert rpc.rpc_sync(owner, alive, (tag,)) == 1
    rpc.rpc_sync(rpc_world.peer(2), hold, (("held", rpc_world.rank), rref))  # a second user
    del rref  # refcounting alone must release it: no gc.collect()
    time.sleep(0.2)
    assert rpc.rpc_sync(owner, alive, (tag,)) == 1  # still used by the second user
    assert rpc.rpc_sync(rpc_world.peer(2), fetch_held, (("held", rpc_world.rank),)) == 1
    rpc.rpc_sync(rpc_world.peer(2), drop_held, (("held", rpc_world.rank),))
    wait_for(lambda: rpc.rpc_sync(owner, alive, (tag,)) == 0, "the owner to drop the value")
    settle(rpc_world)


def test_owner_keeps_value_its_own_handle_dropped_while_a_user_holds_it(rpc_world):
    tag = ("owner-dropped", rpc_world.rank)
    key = ("owner-dropped", rpc_world.rank)
    local = rpc.RRef(Tracked(tag, 9))
    fut = rpc.rpc_async(rpc_world.peer(), hold, (key, local))
    del local  # dropped while the RPC carrying it is in flight
    assert fut.wait() is False
    time.sleep(0.1)
    assert alive(tag) == 1
    assert rpc.rpc_sync(rpc_world.peer(), fetch_held, (key,)) == 9
    rpc.rpc_sync(rpc_world.peer(), drop_held, (key,))
    wait_for(lambda: alive(tag) == 0, "this owner to drop the value")
    settle(rpc_world)


def test_user_hands_rref_back_to_owner_and_drops_it_at_once(rpc_world):
    tag = ("hand-back", rpc_world.rank)
    key = ("hand-back", rpc_world.rank)
    owner = rpc_world.peer()
    rref = rpc.remote(owner, make_tracked, (tag, 4))
    fut = rpc.rpc_async(owner, hold, (key, rref))
    del rref  # refcounting alone must release it: no gc.collect()
    assert fut.wait() is True  # the owner got its own reference back
    time.sleep(0.1)
    assert rpc.rpc_sync(owner, alive, (tag,)) == 1
    assert rpc.rpc_sync(owner, fetch_held, (key,)) == 4
    rpc.rpc_sync(owner, drop_held, (key,))
    wait_for(lambda: rpc.rpc_sync(owner, alive, (tag,)) == 0, "the owner to drop the value")
    settle(rpc_world)


@pytest.mark.mpi(min_size=3)
def test_user_hands_rref_to_third_worker_and_drops_it_at_once(rpc_world):
    tag = ("hand-on", rpc_world.rank)
    owner, third = rpc_world.peer(1), rpc_world.peer(2)
    # 1: the third worker keeps it and uses it later.
    rref = rpc.remote(owner, make_tracked, (tag, 6))
    fut = rpc.rpc_async(third, hold, (("later", rpc_world.rank), rref))
    del rref  # refcounting alone must release it: no gc.collect()
    assert fut.wait() is False
    time.sleep(0.1)
    assert rpc.rpc_sync(owner, alive, (tag,)) == 1
    assert rpc.rpc_sync(third, fetch_held, (("later", rpc_world.rank),)) == 6
    # 2: the third worker uses it at once, while this worker's delete is on its way.
    rref = rpc.remote(owner, make_tracked, (tag, 7))
    fut = rpc.rpc_async(third, hold_and_fetch, (("now", rpc_world.rank), rref))
    del rref  # refcounting alone must release it: no gc.collect()
    assert fut.wait() == 7
    # 3: a chain of users, each handing it on and dropping its copy.
    rref = rpc.remote(owner, make_tracked, (tag, 8))
    fut = rpc.rpc_async(third, pass_on, (rpc_world.peer(3), rref))
    del rref  # refcounting alone must release it: no gc.collect()
    assert fut.wait() == 8
    assert rpc.rpc_sync(owner, alive, (tag,)) == 3
    rpc.rpc_sync(third, drop_held, (("later", rpc_world.rank),))
    rpc.rpc_sync(third, drop_held, (("now", rpc_world.rank),))
    rpc.rpc_sync(rpc_world.peer(3), drop_held, (("passed", rpc_world.peer_rank(2)),))
    wait_for(lambda: rpc.rpc_sync(owner, alive, (tag,)) == 0, "the owner to drop the values")
    settle(rpc_world)


def test_ten_thousand_dropped_remote_rrefs_empty_the_owner_tables(rpc_world):
    settle(rpc_world)
    total = 10_000
    mine = total // rpc_world.size + (rpc_world.rank < total % rpc_world.size)
    others = [n for n in rpc_world.names if n != rpc_world.name]
    start = time.monotonic()
    kept = []
    for i in range(mine):
        rref = rpc.remote(others[i % len(others)], torch.add, (torch.ones(1), i))
        if i % 2:
            kept.append((i, rref))  # half are dropped later, after creation completed
        del rref  # the other half are dropped at once, while their creation is in flight
    last, rref = kept[-1]
    assert rref.to_here().item() == last + 1
    del rref
    kept = [r for _, r in kept]
    torch.futures.wait_all([r._get_future() for r in kept])
    del kept
    rpc_world.barrier()
    for name in others:
        wait_for(
            lambda n=name: rpc.rpc_sync(n, owner_rref_count) == 0, f"{name}'s RRef table to empty"
        )
    info = rpc._rref_context_get_debug_info()
    assert info["num_owner_rrefs"] == 0 and info["num_forks"] == 0
    assert info["num_pending_users"] == 0
    elapsed = time.monotonic() - start
    # A bound on "does not crawl" (it takes 1 to 2 s).
    assert elapsed < scaled(120), f"{mine} remote() calls took {elapsed:.1f} s"


def test_failed_pickling_leaves_no_fork_behind(rpc_world):
    settle(rpc_world)
    tag = ("unpicklable", rpc_world.rank)
    local = rpc.RRef(Tracked(tag, 1))
    user = rpc.remote(rpc_world.peer(), make_tracked, (tag, 2))
    user.to_here()
    for rref in (local, user):
        for to in (rpc_world.name, rpc_world.peer(), rpc_world.peer(2)):
            with pytest.raises(TypeError, match="pickle"):
                rpc.rpc_sync(to, hold, ("never", [rref, threading.Lock()]))
            with pytest.raises(TypeError, match="pickle"):
                rpc.remote(to, hold, ("never", rref), {"lock": threading.Lock()})
    del local, user, rref
    assert alive(tag) == 0  # the local value: no fork was registered for it
    wait_for(
        lambda: rpc.rpc_sync(rpc_world.peer(), alive, (tag,)) == 0,
        "the owner to drop the value",
        lambda: rpc.rpc_sync(rpc_world.peer(), owner_table),
    )
    settle(rpc_world)
