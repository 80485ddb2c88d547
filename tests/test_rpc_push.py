"""Pushed tensors: big tensors to a peer on this node are written by their sender.

Every rank of these jobs shares one node, so each peer is pushed to where the kernel
allows cross-process writes; elsewhere these tests are skipped. Hostile cases play the
sender by hand through the transport's ``push`` communicator.
"""

from __future__ import annotations

import errno

import numpy as np
import pytest
import torch
from _dist_utils import wait_until
from _timing import scaled
from mpi4py import MPI

from lightning_distgrad import rpc
from lightning_distgrad.rpc._calls import dispatch
from lightning_distgrad.rpc._transport import FrameLimits, Kind, direct_writes, tensor_bytes
from lightning_distgrad.rpc._transport.tensor_bytes import PUSHED

mpi = pytest.mark.mpi(min_size=2)

FLOAT32 = tensor_bytes.DTYPE_CODES[torch.float32]
N = direct_writes.PUSH_MIN_BYTES // 4  # float32 elements of the smallest pushed tensor


def echo(obj):
    return obj


def make(n: int, seed: float) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * seed


@pytest.fixture
def transport(rpc_world):
    transport = dispatch.require_agent().transport
    writes = rpc_world.peer_rank() in transport._sender.push_pids
    can = rpc_world.comm.allreduce(writes, op=MPI.LAND)
    if not can:
        pytest.skip("this kernel refuses writes into a peer process (no ptrace permission)")
    return transport


@pytest.fixture
def writes(monkeypatch):
    """Byte counts of the pushes this rank wrote during the test."""
    written = []
    original = direct_writes.PushSend.write

    def write(self):
        written.append(sum(s.nbytes for s in self.sources))
        return original(self)

    monkeypatch.setattr(direct_writes.PushSend, "write", write)
    return written


def test_which_tensors_are_pushed(monkeypatch):
    mib = 1 << 20
    assert not direct_writes.should_push(mib - 1, False)  # small: pulled
    assert direct_writes.should_push(mib, False) and direct_writes.should_push(64 * mib, False)
    assert not direct_writes.should_push(4 * mib, True)  # a receive buffer: pulled
    # Where torch puts its tensors on huge pages, big ones are pulled too.
    monkeypatch.setattr(direct_writes, "TORCH_HUGE_PAGES", True)
    assert direct_writes.should_push(direct_writes.PULL_MIN_BYTES - 1, False)
    assert not direct_writes.should_push(direct_writes.PULL_MIN_BYTES, False)


@mpi
def test_big_tensors_are_pushed_and_arrive_exactly(rpc_world, transport, writes):
    g = torch.Generator().manual_seed(rpc_world.rank)
    raw = torch.randint(0, 256, (4 * N + 12,), dtype=torch.uint8, generator=g)
    small = torch.ones(N // 2)  # under PUSH_MIN_BYTES: moved by MPI
    back = rpc.rpc_sync(rpc_world.peer(), echo, ([raw.view(torch.float32), small],))
    assert torch.equal(back[0].view(torch.uint8), raw) and torch.equal(back[1], small)
    made = rpc.rpc_sync(rpc_world.peer(), make, (N * 3, 2.0))
    assert torch.equal(made, make(N * 3, 2.0))
    rpc_world.barrier()  # the peer's requests have been answered too
    # Our request's tensor and the result made by our peer's request: pushed. The echo's
    # reply is a receive buffer, which its receiver pulls (MPI) instead.
    assert sorted(writes) == sorted([raw.numel(), N * 3 * 4])
    peers = rpc.api._get_debug_info()["peers"]
    assert (
        peers[rpc_world.peer()]["writes_directly"] and not peers[rpc_world.name]["writes_directly"]
    )


@mpi
def test_pushing_is_off_with_its_variable_at_zero(rpc_world, transport, monkeypatch):
    assert set(direct_writes.writable_peers(rpc_world.comm)) == set(transport._sender.push_pids)
    monkeypatch.setenv(direct_writes.PUSH_ENV, "0")
    assert direct_writes.writable_peers(rpc_world.comm) == {}


@mpi
def test_a_tensor_moved_many_times_stays_exact(rpc_world, transport):
    t = make(N + 1, 1.0)
    for _ in range(5):
        t = rpc.rpc_sync(rpc_world.peer(), torch.add, (t, 1.0))
    assert torch.equal(t, make(N + 1, 1.0) + 5)


@mpi
def test_a_refused_push_fails_the_call_and_ends_on_the_sender(rpc_world, transport):
    """A receiver that refuses the message answers the clear-to-send with a refusal: the
    sender writes nothing, and its send is over."""
    receiver = transport._receiver
    receiver.limits, limits = FrameLimits(N * 4, receiver.limits.devices), receiver.limits
    rpc_world.barrier()
    try:
        with pytest.raises(RuntimeError, match="max_message_bytes"):
            rpc.rpc_sync(rpc_world.peer(), echo, (torch.ones(2 * N),))
        rpc_world.barrier()  # every call was refused
    finally:
        receiver.limits = limits
        rpc_world.barrier()
    assert wait_until(lambda: not transport._sender.sends and not receiver.promised)
    assert torch.equal(
        rpc.rpc_sync(rpc_world.peer(), echo, (torch.ones(2 * N),)), torch.ones(2 * N)
    )


def _pushed_request(transport, world, nbytes: int) -> tuple[rpc.Future, tuple[int, int]]:
    """A request whose one tensor is marked pushed, sent with no push of our own:
    the test writes (or not) by hand. Returns its future and push tags."""
    meta = (FLOAT32, (nbytes // 4,), nbytes, PUSHED, "cpu")
    original = transport.send
    tags = []

    def hostile(dst, frame, tensors, devices=None):
        if frame.kind is not Kind.REQUEST:  # replies of other threads go out intact
            return original(dst, frame, tensors, devices)
        # The tag is this frame's only if no other thread (a server's reply) posts to
        # dst between our post and the read: both happen under the transport's lock.
        with transport._lock:
            transport._sender.post(dst, frame.dumps((meta,)), [], "raw", [])
            tag = (transport._sender.next_seq[dst] - 1) % transport.comms.tag_mod
        transport._bell.ring(dst)
        tags.append(direct_writes.push_tags(tag, transport.comms.tag_mod))

    transport.send = hostile
    try:
        future = rpc.rpc_async(world.peer(), echo, (torch.ones(3),), timeout=scaled(60))
    finally:
        transport.send = original
    return future, tags[0]


def _clear_to_send(transport, peer: int, tag: int) -> np.ndarray:
    header = np.zeros(2, dtype=np.uint64)
    with transport._lock:
        request = transport.comms.push.Irecv([header, MPI.BYTE], peer, tag)
    assert wait_until(lambda: _locked_test(transport, request)), "no clear-to-send came"
    return header


def _locked_test(transport, request) -> bool:
    with transport._lock:
        return request.Test()


def _done(transport, peer: int, tag: int, outcome: int) -> None:
    with transport._lock:
        transport.comms.push.Isend(
            [np.array([outcome], dtype=np.int64), MPI.BYTE], peer, tag
        ).Wait()


@mpi
def test_bytes_written_by_hand_arrive(rpc_world, transport):
    """The protocol as a sender runs it: clear-to-send, write, DONE."""
    peer = rpc_world.peer_rank()
    future, (cts, done) = _pushed_request(transport, rpc_world, 4 * N)
    header = _clear_to_send(transport, peer, cts)
    assert header[0] == direct_writes.CLEAR
    values = make(N, 3.0)
    outcome = direct_writes.write_remote(
        transport._sender.push_pids[peer], tensor_bytes.tensor_bytes_view(values), int(header[1])
    )
    assert outcome == 0
    _done(transport, peer, done, direct_writes.WRITTEN)
    assert torch.equal(future.wait(), values)


@mpi
def test_a_failed_write_fails_the_call_saying_why(rpc_world, transport):
    peer = rpc_world.peer_rank()
    future, (cts, done) = _pushed_request(transport, rpc_world, 4 * N)
    _clear_to_send(transport, peer, cts)
    _done(transport, peer, done, errno.EFAULT)
    with pytest.raises(RuntimeError, match="could not write its tensor bytes .Bad address"):
        future.wait()


@mpi
def test_a_push_never_written_is_abandoned_and_its_buffer_kept_until_done(
    rpc_world, transport, monkeypatch
):
    """The receiver gives up at the transfer deadline, but keeps the buffer it named
    until the sender's DONE: a late write must never land in freed memory."""
    receiver = transport._receiver
    monkeypatch.setattr(receiver, "transfer_timeout", 0.3)
    rpc_world.barrier()
    peer = rpc_world.peer_rank()
    future, (cts, done) = _pushed_request(transport, rpc_world, 4 * N)
    header = _clear_to_send(transport, peer, cts)
    with pytest.raises(RuntimeError, match="did not arrive within 0.3 s"):
        future.wait()
    rpc_world.barrier()  # both receivers abandoned their transfer
    assert len(receiver.promised) == 1 and receiver.promised[0][1][0].numel() == N
    rpc_world.barrier()  # both looked before either sends its DONE
    # The late write still lands in live memory; DONE then frees it.
    values = make(N, 5.0)
    outcome = direct_writes.write_remote(
        transport._sender.push_pids[peer], tensor_bytes.tensor_bytes_view(values), int(header[1])
    )
    assert outcome == 0
    _done(transport, peer, done, direct_writes.WRITTEN)
    assert wait_until(lambda: not receiver.promised and not receiver.incoming)
    rpc_world.barrier()


@mpi
def test_a_sender_without_clear_to_send_gives_up_at_its_deadline(rpc_world, transport, caplog):
    """A frame the receiver cannot read gets no clear-to-send: the sender's push ends at
    the transfer deadline (DONE says it gave up) instead of holding its send forever."""
    sender = transport._sender
    sender.transfer_timeout, timeout = 1.0, sender.transfer_timeout
    rpc_world.barrier()
    try:
        transport.send_raw(rpc_world.peer_rank(), b"not a frame", [], "raw", [torch.ones(N)])
        assert sender.sends
        assert wait_until(lambda: not sender.sends, timeout=10.0)
    finally:
        sender.transfer_timeout = timeout
    assert wait_until(lambda: "malformed frame" in caplog.text), caplog.text
    rpc_world.barrier()
