"""What travels: every dtype and layout, nested structures, big tensors, heavy concurrency.

Tensors up to 64 KiB ride inside the frame, bigger ones follow as raw buffers
on the data communicator; both paths are checked for exact (bitwise) round
trips.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import NamedTuple

import pytest
import torch
from _dist_utils import wait_until
from _timing import scaled

from lightning_distgrad import rpc
from lightning_distgrad.rpc._calls import dispatch, one_way
from lightning_distgrad.rpc._transport import Kind, direct_writes, receive_buffers, tensor_bytes

pytestmark = pytest.mark.mpi(min_size=2)

#: Element counts: empty, one, just under and over the inline limit, 1 MiB+.
SMALL, BIG = 7, tensor_bytes.INLINE_LIMIT + 1

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


# ---------------------------------------------------------------------------
# Remote functions


def echo(obj):
    return obj


def describe_tensors(obj):
    """Dtype, shape, contiguity and class of every tensor the callee received."""
    out = []

    def walk(o):
        if isinstance(o, torch.Tensor):
            out.append(
                (
                    type(o).__name__,
                    o.dtype,
                    tuple(o.shape),
                    o.layout,
                    o.requires_grad if isinstance(o, torch.nn.Parameter) else None,
                )
            )
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    return out


def tag_value(thread, i):
    return (rpc.get_worker_info().id, thread, i)


def slow_tag_value(thread, i):
    time.sleep(0.2)
    return tag_value(thread, i)


def checksum(t):
    return int(t.view(torch.uint8).to(torch.int64).sum()), t.numel()


def make_tensor(n, seed):
    return torch.arange(n, dtype=torch.float32) * seed


# ---------------------------------------------------------------------------
# Helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (exact comparison even for NaN, -0.0 and float8)."""
    t = t.resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert type(a) is type(b)
    assert (a.dtype, a.shape, a.layout) == (b.dtype, b.shape, b.layout)
    if a.layout == torch.sparse_coo:
        assert_same(a._indices(), b._indices())
        assert_same(a._values(), b._values())
        return
    assert torch.equal(bits(a), bits(b))


def sample(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """``n`` elements of ``dtype`` with varied bit patterns."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0, 256, (n * torch.empty(0, dtype=dtype).element_size(),), dtype=torch.uint8, generator=g
    )
    if dtype == torch.bool:
        return raw.remainder(2).bool()
    return raw.view(dtype)


# ---------------------------------------------------------------------------
# Dtypes and layouts


@pytest.mark.parametrize("n", [0, 1, SMALL, BIG], ids=["empty", "one", "small", "big"])
def test_every_dtype_round_trips_exactly(rpc_world, n):
    tensors = [sample(dtype, n, seed=i) for i, dtype in enumerate(DTYPES)]
    back = rpc.rpc_sync(rpc_world.peer(), echo, (tensors,))
    assert len(back) == len(tensors)
    for a, b in zip(tensors, back, strict=True):
        assert_same(a, b)


def test_a_result_that_is_one_tensor_round_trips_exactly(rpc_world):
    # A plain tensor result travels as the frame's only tensor, without a pickle;
    # anything else (a Parameter, a sparse tensor) still goes through pickle.
    base = torch.randn(300, 301)
    plain = [sample(dtype, SMALL, seed=i) for i, dtype in enumerate(DTYPES)] + [
        torch.tensor(2.5),
        torch.empty(3, 0),
        base.t(),
        base[::2, 1::3],
        torch.randn(4, dtype=torch.complex64).conj(),
        sample(torch.float32, BIG, seed=1),
    ]
    for t in plain:
        assert_same(t, rpc.rpc_sync(rpc_world.peer(), echo, (t,)))
        assert_same(t, rpc.rpc_async(rpc_world.peer(), echo, (t,)).wait())
    p = torch.nn.Parameter(torch.randn(3))
    back = rpc.rpc_sync(rpc_world.peer(), echo, (p,))
    assert isinstance(back, torch.nn.Parameter) and torch.equal(back.detach(), p.detach())
    sparse = torch.eye(3).to_sparse()
    assert_same(sparse, rpc.rpc_sync(rpc_world.peer(), echo, (sparse,)))


def test_zero_dim_and_zero_size_tensors(rpc_world):
    tensors = [
        torch.tensor(3.5),
        torch.tensor(7, dtype=torch.int64),
        torch.tensor(True),
        torch.tensor(1 + 2j),
        torch.empty(0),
        torch.empty(3, 0, 2),
        torch.empty(0, dtype=torch.bfloat16),
    ]
    back = rpc.rpc_sync(rpc_world.peer(), echo, (tensors,))
    for a, b in zip(tensors, back, strict=True):
        assert_same(a, b)


@pytest.mark.parametrize("size", [SMALL, 300], ids=["inline", "buffer"])
def test_non_contiguous_and_view_tensors_round_trip(rpc_world, size):
    base = torch.randn(size, size + 1)
    cbase = torch.randn(size, size, dtype=torch.complex64)
    views = {
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "sliced_offset": base[1:, 2:],
        "row_of_big": base[size // 2],
        "expanded": torch.randn(size, 1).expand(size, 4),
        "channels_last": torch.randn(2, 3, size, 5).contiguous(memory_format=torch.channels_last),
        "conj": cbase.conj(),
        "neg_view": torch._neg_view(base),
        "conj_transposed": cbase.t().conj(),
        "real_of_complex": cbase.real,
        "flipped": base.flip(0),
    }
    back = rpc.rpc_sync(rpc_world.peer(), echo, (views,))
    assert back.keys() == views.keys()
    for key, t in views.items():
        assert torch.equal(back[key], t), key
        assert back[key].dtype == t.dtype and back[key].shape == t.shape, key
    # Only the view's elements travel, not its whole storage.
    got = rpc.rpc_sync(rpc_world.peer(), checksum, (base[0, :3],))
    assert got[1] == 3


def test_nested_structures_with_tensors(rpc_world):
    obj = {
        "list": [torch.ones(2), [torch.zeros(3, dtype=torch.int32), (torch.tensor(1.5),)]],
        "tuple": (1, "two", torch.arange(4), {"deep": [torch.eye(2), None]}),
        "big": torch.randn(200, 200),
        3: b"bytes",
        "counter": collections.Counter("abca"),
        "empty": [],
    }
    back = rpc.rpc_sync(rpc_world.peer(), echo, (obj,))
    assert back.keys() == obj.keys()
    assert torch.equal(back["list"][0], obj["list"][0])
    assert torch.equal(back["list"][1][0], obj["list"][1][0])
    assert back["list"][1][0].dtype == torch.int32
    assert isinstance(back["list"][1][1], tuple)
    assert torch.equal(back["list"][1][1][0], obj["list"][1][1][0])
    assert back["tuple"][:2] == (1, "two") and torch.equal(back["tuple"][2], obj["tuple"][2])
    assert torch.equal(back["tuple"][3]["deep"][0], torch.eye(2))
    assert back["tuple"][3]["deep"][1] is None
    assert torch.equal(back["big"], obj["big"])
    assert back[3] == b"bytes" and back["counter"] == obj["counter"] and back["empty"] == []
    # Args and kwargs both carry structures.
    seen = rpc.rpc_sync(rpc_world.peer(), describe_tensors, kwargs={"obj": obj})
    assert len(seen) == 6


def test_parameters_and_requires_grad(rpc_world):
    p = torch.nn.Parameter(torch.randn(3, 4))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    back = rpc.rpc_sync(rpc_world.peer(), echo, ([p, frozen],))
    assert isinstance(back[0], torch.nn.Parameter) and back[0].requires_grad
    assert isinstance(back[1], torch.nn.Parameter) and not back[1].requires_grad
    assert torch.equal(back[0].detach(), p.detach())
    assert torch.equal(back[1].detach(), frozen.detach())
    module = torch.nn.Linear(300, 300)  # its weight is past the inline limit
    state = rpc.rpc_sync(rpc_world.peer(), echo, (module.state_dict(),))
    for key, value in module.state_dict().items():
        assert torch.equal(state[key], value)


def test_sparse_coo_tensors(rpc_world):
    indices = torch.tensor([[0, 1, 1, 4], [2, 0, 2, 3]])
    values = torch.tensor([3.0, 4.0, 5.0, -1.0])
    sparse = torch.sparse_coo_tensor(indices, values, (5, 4), check_invariants=True)
    coalesced = sparse.coalesce()
    big = torch.sparse_coo_tensor(
        torch.randint(0, 1000, (2, 20_000)),
        torch.randn(20_000),
        (1000, 1000),
        check_invariants=True,
    ).coalesce()
    back = rpc.rpc_sync(rpc_world.peer(), echo, ([sparse, coalesced, big],))
    for a, b in zip([sparse, coalesced, big], back, strict=True):
        assert b.layout == torch.sparse_coo
        assert b.is_coalesced() == a.is_coalesced()
        assert torch.equal(b.to_dense(), a.to_dense())
    result = rpc.rpc_sync(rpc_world.peer(), torch.sparse.sum, (coalesced,))
    assert result.item() == values.sum().item()


# ---------------------------------------------------------------------------
# Big tensors


def test_64mib_tensor_round_trips_exactly(rpc_world):
    g = torch.Generator().manual_seed(rpc_world.rank)
    raw = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, generator=g)
    as_float = raw.view(torch.float32)  # arbitrary bit patterns, NaNs included
    back = rpc.rpc_sync(rpc_world.peer(), echo, (as_float,))
    assert back.dtype == torch.float32 and back.shape == as_float.shape
    assert torch.equal(back.view(torch.uint8), raw)
    del back
    # The other way round: a 64 MiB result made on the callee.
    made = rpc.rpc_sync(rpc_world.peer(), make_tensor, (16 << 20, 3))
    assert made.numel() * made.element_size() == 64 << 20
    assert torch.equal(made, make_tensor(16 << 20, 3))


def test_tensors_beyond_one_mpi_message_or_one_write_arrive_exactly(rpc_world, monkeypatch):
    """Tensors of several GiB go as several MPI messages, or several writes when pushed:
    both limits shrunk here so that a few MiB take every path."""
    monkeypatch.setattr(tensor_bytes, "CHUNK_BYTES", 100_003)
    monkeypatch.setattr(direct_writes, "_MAX_WRITE", 300_007)
    rpc_world.barrier()  # both sides chunk alike before either sends
    g = torch.Generator().manual_seed(rpc_world.rank)
    smallest_push = direct_writes.PUSH_MIN_BYTES
    pushed = torch.randint(0, 256, (3 * smallest_push + 5,), dtype=torch.uint8, generator=g)
    by_mpi = torch.randint(0, 256, (smallest_push - 3,), dtype=torch.uint8, generator=g)
    back = rpc.rpc_sync(rpc_world.peer(), echo, ([pushed, by_mpi],))
    assert torch.equal(back[0], pushed) and torch.equal(back[1], by_mpi)
    rpc_world.barrier()  # the peer's call is over before either restores the limits


def test_received_big_tensors_kept_alive_are_never_overwritten(rpc_world):
    """Receive buffers are pooled: one is reused only once no tensor (or view) uses it."""
    n = (receive_buffers.POOL_MIN_BYTES // 4) * 2
    kept = [rpc.rpc_sync(rpc_world.peer(), make_tensor, (n, float(i))) for i in range(3)]
    view = rpc.rpc_sync(rpc_world.peer(), make_tensor, (n, 7.0))[: n // 2]  # base dropped
    for _ in range(3):  # reuses freed buffers of the same size
        assert torch.equal(
            rpc.rpc_sync(rpc_world.peer(), make_tensor, (n, -1.0)), make_tensor(n, -1.0)
        )
    for i, t in enumerate(kept):
        assert torch.equal(t, make_tensor(n, float(i)))
    assert torch.equal(view, make_tensor(n, 7.0)[: n // 2])


def test_many_big_messages_in_flight_stay_matched(rpc_world):
    futs = [
        rpc.rpc_async(
            rpc_world.names[i % rpc_world.size],
            echo,
            ([torch.full((40_000 + i,), float(i)), torch.full((i,), -float(i))],),
        )
        for i in range(64)
    ]
    for i, fut in enumerate(futs):
        big, small = fut.wait()
        assert big.shape == (40_000 + i,) and bool((big == i).all())
        assert small.shape == (i,) and bool((small == -i).all())


# ---------------------------------------------------------------------------
# Concurrency


def run_threads(target, count: int) -> None:
    """Run ``target(k)`` on ``count`` threads at once, ``k = 0 .. count - 1``; wait for all."""
    workers = [threading.Thread(target=target, args=(k,)) for k in range(count)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=scaled(120))


def test_many_threads_issuing_rpc_async_lose_and_duplicate_nothing(rpc_world):
    threads, calls = 8, 200
    results: dict[int, list] = {}
    errors = []

    def issue(k):
        try:
            futs = [
                rpc.rpc_async(
                    rpc_world.names[
                        (rpc_world.rank + 1 + (k + i) % (rpc_world.size - 1)) % rpc_world.size
                    ],
                    tag_value,
                    (k, i),
                )
                for i in range(calls)
            ]
            results[k] = [f.wait() for f in futs]
        except BaseException as e:  # surfaced below
            errors.append(e)

    run_threads(issue, threads)
    assert not errors, errors
    assert sorted(results) == list(range(threads))
    seen = set()
    for k in range(threads):
        assert len(results[k]) == calls
        for i, (callee, thread, call) in enumerate(results[k]):
            assert (thread, call) == (k, i)
            assert callee != rpc_world.rank
            seen.add((thread, call))
    assert len(seen) == threads * calls


def test_many_threads_issuing_rpc_sync_and_remote(rpc_world):
    threads, calls = 8, 20
    errors = []
    ok = [0] * threads

    def issue(k):
        try:
            for i in range(calls):
                to = rpc_world.names[(k + i) % rpc_world.size]
                assert rpc.rpc_sync(to, tag_value, (k, i))[1:] == (k, i)
                x = torch.full((k + 1,), float(i))
                assert torch.equal(rpc.remote(to, torch.add, (x, 1)).to_here(), x + 1)
                ok[k] += 1
        except BaseException as e:
            errors.append(e)

    run_threads(issue, threads)
    assert not errors, errors
    assert ok == [calls] * threads


def test_then_callbacks_from_many_futures(rpc_world):
    done = []
    lock = threading.Lock()

    def record(fut):
        with lock:
            done.append(fut.wait())

    futs = []
    for i in range(100):
        fut = rpc.rpc_async(rpc_world.peer(), tag_value, (0, i))
        fut.add_done_callback(record)
        futs.append(fut.then(lambda f: f.wait()[2] * 2))
    assert [f.wait() for f in futs] == [2 * i for i in range(100)]
    torch.futures.wait_all(futs)
    deadline = threading.Event()
    for _ in range(1000):
        if len(done) == 100:
            break
        deadline.wait(0.01)
    assert sorted(v[2] for v in done) == list(range(100))


def test_sender_holding_a_lock_that_a_completion_callback_needs_does_not_deadlock(rpc_world):
    # Internal futures (those distributed autograd uses) complete on the
    # progress thread, which runs their callbacks there. A callback that waits
    # for a lock whose holder is sending must not deadlock the two.
    lock = threading.Lock()
    callback_waiting = threading.Event()
    results = []

    def callback(fut):
        callback_waiting.set()
        with lock:
            results.append(fut.wait())

    def holder():
        with lock:
            # Slow enough that the callback is registered before the response arrives
            # (a done future would run it here, on the lock's holder).
            fut = dispatch.invoke(
                rpc_world.peer(), slow_tag_value, (0, 0), None, 0, user_visible=False
            )
            fut.add_done_callback(callback)
            if callback_waiting.wait(scaled(30)):  # the progress thread now waits for `lock`
                results.append(rpc.rpc_async(rpc_world.peer(), tag_value, (0, 1)))

    thread = threading.Thread(target=holder)
    thread.start()
    thread.join(scaled(60))
    assert not thread.is_alive(), "the sender and the completion callback deadlocked"
    assert callback_waiting.is_set()
    later = results[0]
    assert later.wait()[1:] == (0, 1)
    assert results[1][1:] == (0, 0)


# ---------------------------------------------------------------------------
# Served one-way messages (what distributed autograd's gradient messages are)

_notified: list = []


class Note(NamedTuple):
    value: int


def record_note(source, body, tensors):
    if body.value < 0:
        raise ValueError("a one-way handler failed")
    (tensor,) = tensors
    _notified.append((body.value, tensor.clone()))


def notified_values():
    return [(v, t) for v, t in _notified]


def test_served_one_way_messages_run_on_the_peer_and_errors_stay_there(
    rpc_world, caplog, monkeypatch
):
    world = rpc_world
    _notified.clear()
    monkeypatch.setitem(
        one_way.HANDLERS, Kind.CONTEXT_RELEASE, one_way.OneWay(Note, record_note, True, None)
    )
    world.barrier()
    agent = dispatch.require_agent()
    big = make_tensor(BIG, seed=world.rank)
    agent.send_one_way(world.peer_rank(), Kind.CONTEXT_RELEASE, Note(-1))
    for i in range(3):
        agent.send_one_way(world.peer_rank(), Kind.CONTEXT_RELEASE, Note(i), [big])
    assert wait_until(lambda: len(rpc.rpc_sync(world.peer(), notified_values)) == 3)
    got = rpc.rpc_sync(world.peer(), notified_values)
    assert sorted(v for v, _ in got) == [0, 1, 2]
    for _, t in got:
        assert_same(t, big)
    # The failing handler is logged where it ran (nobody else could be told), and
    # the agent goes on serving.
    assert wait_until(lambda: "a one-way handler failed" in caplog.text)
    assert rpc.rpc_sync(world.peer(), torch.add, (torch.ones(2), 1)).tolist() == [2.0, 2.0]
    world.barrier()
