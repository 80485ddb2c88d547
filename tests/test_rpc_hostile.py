"""Frames no agent would send: each is answered or dropped, and the agent goes on serving.

Rank 0 sends every frame through the transport's real send path (``send_raw``)
to rank 1, whose agent must neither abort nor let the frame surface in an
unrelated call. A malformed request is answered with an error saying what was
wrong; anything else is dropped with one log line naming the sender. Frames
sent past the agent, by plain MPI sends on its communicator, must not keep a
graceful shutdown from ending.
"""

from __future__ import annotations

import pickle
import random
import sys
import threading
import time

import pytest
import torch
from _dist_utils import wait_until
from _timing import VARIABLE as SLOWDOWN_VARIABLE
from _timing import scaled
from mpi4py import MPI

from lightning_distgrad import rpc
from lightning_distgrad._backoff import wait_all
from lightning_distgrad.rpc._calls import dispatch
from lightning_distgrad.rpc._transport import Kind, engine, tensor_bytes

pytestmark = pytest.mark.mpi(min_size=2)

FLOAT32 = tensor_bytes.DTYPE_CODES[torch.float32]
#: Bounds the calls of these tests (a lost answer fails the test instead of hanging it).
CALL_TIMEOUT_S = scaled(30)
TIB = 1 << 40


def raw_frame(
    kind=Kind.REQUEST, call_id=-1, payload=None, metas=(), body=None, forks=(), sparse=()
):
    return pickle.dumps((int(kind), call_id, payload, metas, body, forks, sparse))


def good_meta(n=3):
    return (FLOAT32, (n,), 4 * n, bytearray(4 * n), "cpu")


#: Frames that cannot be answered (no readable call): dropped and logged.
UNANSWERABLE = {
    "random bytes": bytes(range(7, 250, 3)),
    "truncated pickle": raw_frame(payload=b"x" * 40)[:-9],
    "pickle of a dict": pickle.dumps({"kind": 0}),
    "tuple of 5": pickle.dumps((0, 1, None, (), None)),
    "tuple of 6 (no sparse table)": pickle.dumps((0, 1, None, (), None, ())),
    "unknown kind": raw_frame(kind=99),
    "call id not an int": raw_frame(call_id="seven"),
    "one-way body of the wrong length": raw_frame(Kind.RREF_FORK, body=(1, 2)),
    "one-way body not a tuple": raw_frame(Kind.CONTEXT_RELEASE, body=17),
}

#: Tensor tables a request may not carry, and what the error must say.
BAD_METAS = {
    "bad dtype code": ((10**6, (3,), 12, bytearray(12), "cpu"), "unknown dtype code"),
    "negative shape": ((FLOAT32, (-3,), 12, bytearray(12), "cpu"), "not a tuple of non-negative"),
    "shape against bytes": ((FLOAT32, (3,), 16, bytearray(16), "cpu"), "(12 expected)"),
    "inline bytes mismatch": ((FLOAT32, (3,), 12, bytearray(5), "cpu"), "inline bytes"),
    "4 TiB declared": ((FLOAT32, (TIB // 4,), TIB, None, "cpu"), "max_message_bytes"),
    "missing device": ((FLOAT32, (3,), 12, bytearray(12), "cuda:7"), "which this worker lacks"),
    "CUDA IPC export to the CPU": ((FLOAT32, (3,), 12, ("cuda-ipc", (), 0), "cpu"), "IPC export"),
    "not a tuple": ([FLOAT32, (3,), 12, bytearray(12), "cpu"], "description"),
}


def call_with_metas(world, metas, timeout=CALL_TIMEOUT_S):
    """``rpc_sync(torch.add)`` whose frame carries ``metas`` instead of its own table."""
    transport = dispatch.require_agent().transport
    original = transport.send

    def corrupt(dst, frame, tensors, devices=None):
        if frame.kind is not Kind.QUICK_REQUEST:  # replies of other threads go out intact
            return original(dst, frame, tensors, devices)
        transport.send_raw(dst, frame.dumps(metas), [])

    transport.send = corrupt
    try:
        future = rpc.rpc_async(world.peer(), torch.add, (torch.ones(3), 1), timeout=timeout)
    finally:
        transport.send = original
    return future


def answers_normally(world):
    return torch.equal(
        rpc.rpc_sync(world.peer(), torch.add, (torch.ones(2), 1)), torch.full((2,), 2.0)
    )


@pytest.mark.parametrize("case", sorted(UNANSWERABLE))
def test_unreadable_frames_are_dropped_with_a_log_line_naming_the_sender(rpc_world, caplog, case):
    world = rpc_world
    world.barrier()  # every rank captures logs before anything is sent
    if world.rank == 0:
        dispatch.require_agent().transport.send_raw(1, UNANSWERABLE[case])
    if world.rank == 1:
        assert wait_until(lambda: "malformed frame from rank 0" in caplog.text), caplog.text
    world.barrier()
    assert answers_normally(world)


@pytest.mark.parametrize("case", sorted(BAD_METAS))
def test_a_request_with_a_bad_tensor_table_fails_saying_what_was_wrong(rpc_world, case):
    meta, says = BAD_METAS[case]
    with pytest.raises(RuntimeError, match="could not read this request") as info:
        call_with_metas(rpc_world, (meta,)).wait()
    assert says in str(info.value)
    assert answers_normally(rpc_world)


class NapLog:
    """Seconds the progress thread of ``transport`` has spent napping in its doorbell's wait
    (where an idle poller sleeps instead of polling), read at any moment."""

    def __init__(self, transport, monkeypatch):
        self._transport = transport
        self._wait = transport._bell.wait
        self._lock = threading.Lock()
        self._total = 0.0
        self._since: float | None = None  # start of the nap in progress
        monkeypatch.setattr(transport._bell, "wait", self._timed_wait)

    def _timed_wait(self, timeout: float) -> None:
        if not self._transport.is_progress_thread(threading.get_ident()):
            return self._wait(timeout)
        with self._lock:
            self._since = time.monotonic()
        try:
            return self._wait(timeout)
        finally:
            with self._lock:
                self._total += time.monotonic() - self._since
                self._since = None

    def napped(self) -> float:
        with self._lock:
            now = time.monotonic()
            return self._total + (0.0 if self._since is None else now - self._since)


#: The share of a hung transfer's wait that the poller must spend napping. A napping
#: poller wakes every few milliseconds for a poll of some microseconds and naps well over
#: 90% of the time, however slow or busy the machine; a spinning one never naps.
MIN_NAPPING_SHARE = 0.5


def test_bytes_that_never_arrive_are_abandoned_and_the_poller_naps(rpc_world, monkeypatch):
    """A frame declares a tensor whose bytes never follow: the receiver waits until the
    transfer deadline, napping (not spinning), then abandons it and answers the call."""
    world = rpc_world
    transport = dispatch.require_agent().transport
    receiver = transport._receiver
    deadline = scaled(1.5)
    monkeypatch.setattr(receiver, "transfer_timeout", deadline)
    # After a transfer's last progress the poller stays hot (spins) this long before it
    # naps; shortened from its 1 s so that the naps fit well before the deadline.
    hot = 0.05
    monkeypatch.setattr(engine, "TRANSFER_HOT_S", hot)
    naps = NapLog(transport, monkeypatch)
    world.barrier()
    n = tensor_bytes.INLINE_LIMIT  # above the inline limit: its bytes would follow on ``data``
    future = call_with_metas(world, ((FLOAT32, (n,), 4 * n, None, "cpu"),))
    assert wait_until(lambda: receiver.incoming), "the frame from the peer never came"
    time.sleep(2 * hot)
    napped0, start = naps.napped(), time.monotonic()
    time.sleep(0.5)
    napped, window = naps.napped() - napped0, time.monotonic() - start
    hanging = bool(receiver.incoming)
    with pytest.raises(RuntimeError, match=f"did not arrive within {deadline:g} s"):
        future.wait()
    everyone = world.comm.allgather((napped / window, hanging))
    assert all(hung for _, hung in everyone), (
        f"the transfer ended before the measurement did, per rank: {everyone}; "
        f"on a slow machine raise {SLOWDOWN_VARIABLE}"
    )
    shares = [round(share, 3) for share, _ in everyone]
    assert min(shares) >= MIN_NAPPING_SHARE, (
        f"share of the time each rank's poller napped while a transfer hung: {shares} "
        f"(a napping poller naps most of it, a spinning one never)"
    )
    assert wait_until(lambda: not receiver.incoming and not receiver.cancelled)
    assert answers_normally(world)


def test_tensor_bytes_of_the_wrong_size_fail_the_call(rpc_world):
    n = tensor_bytes.INLINE_LIMIT
    meta = (FLOAT32, (n,), 4 * n, None, "cpu")
    transport = dispatch.require_agent().transport
    original = transport.send
    for sent in (4 * n - 8, 4 * n + 8):

        def short(dst, frame, tensors, devices=None, sent=sent):
            if frame.kind is not Kind.QUICK_REQUEST:
                return original(dst, frame, tensors, devices)
            transport.send_raw(dst, frame.dumps((meta,)), [torch.zeros(sent, dtype=torch.uint8)])

        transport.send = short
        try:
            future = rpc.rpc_async(rpc_world.peer(), torch.add, (torch.ones(3), 1))
        finally:
            transport.send = original
        with pytest.raises(RuntimeError, match="could not read this request"):
            future.wait()
    assert answers_normally(rpc_world)


def test_a_malformed_response_fails_its_call(rpc_world):
    """A response whose tensor table is bad fails the caller's call at once."""
    world = rpc_world
    agent = dispatch.require_agent()
    call_id = 10**8 + world.rank
    future = torch.futures.Future()
    agent._pending[call_id] = _agent_pending(future, world)
    bad = raw_frame(Kind.RESPONSE, call_id, None, ((10**6, (1,), 4, bytearray(4), "cpu"),))
    agent.transport.send_raw(world.rank, bad)  # to itself: its own response
    with pytest.raises(RuntimeError, match="response from .* could not be read"):
        future.wait()
    assert answers_normally(world)


def _agent_pending(future, world):
    from lightning_distgrad.rpc._calls.pending import Pending

    return Pending(future, rpc.get_worker_info(world.name), False, None, 0)


def fuzz_frames(seed: int, count: int) -> list[tuple[bytes, list]]:
    """Frames built from every field the format has, each mutated at random."""
    rng = random.Random(seed)
    # No value names a context of the sender's (ids from 0 up): a well-formed release of
    # one would release it here, as a real one does.
    values = [
        None,
        0,
        -1,
        7,
        2**40,
        "x",
        b"",
        b"\x80\x04junk",
        1.5,
        (),
        (1, 2),
        [-7],
        {},
        bytearray(4),
        (FLOAT32, (1,), 4, bytearray(4), "cpu"),
    ]
    frames = []
    for _ in range(count):
        kind = rng.choice([*Kind, 99, -3, "REQUEST", None])
        meta = list(good_meta(rng.choice([0, 1, 3])))
        if rng.random() < 0.5:
            meta[rng.randrange(5)] = rng.choice(values)
        if rng.random() < 0.2:
            meta = [FLOAT32, (17000,), 68000, None, "cpu"]  # bytes follow, maybe
        # Call ids the sender never uses itself: an answer must not meet a real call.
        fields = [
            kind,
            rng.choice([-1, 10**9 + rng.randrange(1000), "id"]),
            rng.choice([None, b"", b"\x80\x04N.", rng.randbytes(20)]),
            rng.choice([(), (tuple(meta),), (tuple(meta), tuple(meta)), "m"]),
            rng.choice([None, (), (-7,), (1, 2), "b"]),
            rng.choice([(), ((1, 2),), "f"]),
            rng.choice([(), ((0, "coo", (3,), False),), ((1, "csr", (2, 2), None),), "s"]),
        ]
        if rng.random() < 0.3:
            fields[rng.choice([0, 2, 3, 4, 5, 6])] = rng.choice(values)
        raw = pickle.dumps(tuple(fields))
        if rng.random() < 0.1:
            raw = raw[: rng.randrange(len(raw))]
        elif rng.random() < 0.1:
            raw = rng.randbytes(rng.randrange(1, 64))
        buffers = [torch.zeros(68000, dtype=torch.uint8)] if rng.random() < 0.1 else []
        frames.append((raw, buffers))
    return frames


def take_bytes_nobody_waits_for(transport, source: int) -> None:
    """Receive the tensor bytes from ``source`` waiting on the agent's data communicator:
    those of frames this agent could not read, or abandoned. Nothing else receives them, so
    the sender's sends would never complete (its next shutdown gives up on them after its
    flush timeout)."""
    status = MPI.Status()
    with transport._lock:
        while transport.comms.data.Iprobe(source, MPI.ANY_TAG, status):
            buffer = bytearray(status.Get_count(MPI.BYTE))
            transport.comms.data.Recv([buffer, MPI.BYTE], source, status.Get_tag())


def test_a_thousand_fuzzed_frames_leave_the_agent_serving(rpc_world, monkeypatch):
    """Seeded fuzz through the real send path; then normal calls work both ways, and
    every send of the fuzzed frames completes once their stray bytes are received."""
    world = rpc_world
    transport = dispatch.require_agent().transport
    monkeypatch.setattr(transport._receiver, "transfer_timeout", 1.0)
    world.barrier()
    if world.rank == 0:
        for raw, buffers in fuzz_frames(seed=1234, count=1200):
            transport.send_raw(1, raw, buffers)
    world.barrier()
    assert answers_normally(world)
    assert wait_until(lambda: not transport._receiver.incoming, timeout=30)
    assert answers_normally(world)
    for _ in range(60):
        if world.rank == 1:
            take_bytes_nobody_waits_for(transport, 0)
        world.barrier()
        sent = world.rank != 0 or wait_until(lambda: not transport._sender.sends, timeout=0.5)
        if all(world.comm.allgather(sent)):
            break
    else:
        pytest.fail(f"rank 0 still has {len(transport._sender.sends)} sends of fuzzed frames")


def test_an_error_printed_by_a_deallocator_does_not_abort_the_job(rpc_world, capsys):
    """CPython reports an error raised where nothing can catch it (a bytearray freed while
    still exported, say) through sys.excepthook with no traceback, and goes on: the
    excepthook that aborts the job on an uncaught exception must let it be."""
    error = SystemError("deallocated bytearray object has exported buffers")
    sys.excepthook(SystemError, error, None)
    assert "deallocated bytearray" in capsys.readouterr().err
    assert answers_normally(rpc_world)


def slow_add(seconds, x):
    time.sleep(seconds)
    return x + 1


def send_past_the_agent(comm, seed: int, count: int) -> None:
    """``count`` frames to random ranks by plain MPI sends on ``comm`` (the agent's frame
    communicator): no agent counts them as sent. Random bytes of many sizes on random
    tags, small ones (those the agents' own frames use) included, and fuzzed frames
    (without their tensor bytes) on tags far above those: a readable frame that declares
    tensor bytes posts a receive for them under its tag, which would take the bytes of a
    real frame of the same tag."""
    rng = random.Random(seed)
    tag_ub = comm.Get_attr(MPI.TAG_UB)
    fuzzed = [raw for raw, _ in fuzz_frames(seed, count)]
    requests, keep = [], []
    for i in range(count):
        if i % 2:
            raw = fuzzed[i]
            tag = rng.randrange(tag_ub // 2, tag_ub + 1)
        else:
            raw = rng.randbytes(rng.choice([0, 1, 9, 200, 4096, 70_000]))
            tag = rng.randrange(16) if rng.random() < 0.5 else rng.randrange(tag_ub + 1)
        keep.append(raw)
        requests.append(comm.Isend([raw, MPI.BYTE], rng.randrange(comm.Get_size()), tag))
    wait_all(*requests)


def test_graceful_shutdown_ends_after_frames_no_agent_sent(rpc_stopped, monkeypatch):
    """Frames that bypass every agent's count, before and during shutdown: calls still
    work, a call still running when shutdown starts is answered, and graceful shutdown
    returns on every rank, within a bound far below the default transfer timeout.

    A readable frame that declares tensor bytes holds back its sender's later frames
    until its deadline, which the receiver fixes when the frame arrives: every rank sets
    the short transfer timeout before any such frame can reach it, even a rank that gets
    here late (rank 0, as under load; at 4 ranks rank 2 sends it one)."""
    world = rpc_stopped
    rpc.init_rpc()
    agent = dispatch.require_agent()
    if world.rank == 0:
        time.sleep(2.0)
    monkeypatch.setattr(agent.transport._receiver, "transfer_timeout", 1.0)
    world.barrier()
    start = time.monotonic()
    send_past_the_agent(agent.transport.comms.ctrl, seed=world.rank, count=300)
    world.barrier()
    for distance in range(world.size):
        assert answers_normally_to(world.peer(distance))
    running = rpc.rpc_async(world.peer(), slow_add, (0.5, world.rank))
    # No barrier: these land while the job drains.
    send_past_the_agent(agent.transport.comms.ctrl, seed=1000 + world.rank, count=100)
    returned = threading.Event()

    def shut_down() -> None:
        rpc.shutdown()
        returned.set()

    thread = threading.Thread(target=shut_down, daemon=True)
    thread.start()
    thread.join(scaled(60))  # a hung shutdown fails the test, which aborts the job
    assert returned.is_set(), "graceful shutdown did not return"
    assert running.done() and running.wait() == world.rank + 1
    # Missing tensor bytes cost each sender's frames at most a second or so here.
    assert time.monotonic() - start < scaled(30)


def answers_normally_to(worker: str) -> bool:
    return torch.equal(rpc.rpc_sync(worker, torch.add, (torch.ones(2), 1)), torch.full((2,), 2.0))
