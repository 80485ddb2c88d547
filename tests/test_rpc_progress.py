"""The progress loop: polling against a communicator that probes the way MPICH does,
and the doorbells that wake a napping progress thread."""

from __future__ import annotations

import os
import select
import threading
import time

import pytest
from _dist_utils import wait_until
from _timing import scaled
from _transports import make_transport
from mpi4py import MPI

from lightning_distgrad.rpc._calls.waiting import Waiter
from lightning_distgrad.rpc._transport import (
    Frame,
    Kind,
    Transport,
    progress,
)
from lightning_distgrad.rpc._transport import doorbell as _doorbell
from lightning_distgrad.rpc._transport.doorbell import ArmedBackoff, Doorbell, LocalBell
from lightning_distgrad.rpc._transport.engine import QUIET_NAP_S, RUNG_QUIET_NAP_S

BODY = Frame(Kind.RREF_FORK, -1, None, (), ("body",))
#: Tries at a check that needs the progress thread in a nap (not between two) at one instant.
ATTEMPTS = 20


class _Message:
    def __init__(self, raw: bytes):
        self.raw = raw

    def Recv(self, buf) -> None:  # noqa: N802 - mpi4py's name
        buf[0][:] = self.raw


class _MatchBeforeProgressComm:
    """``Improbe`` as MPICH 5 does it: look for a match, then make progress.

    A frame that arrived while the poller slept reaches the matching queue
    during the first call, which therefore reports nothing; the second call
    finds it.
    """

    def __init__(self, raw: bytes):
        self.in_flight: bytes | None = raw
        self.matchable: bytes | None = None
        self.calls = 0

    def Improbe(self, source: int, tag: int, status: MPI.Status):  # noqa: N802
        self.calls += 1
        if self.matchable is None:
            self.matchable, self.in_flight = self.in_flight, None  # progress
            return None
        raw, self.matchable = self.matchable, None
        status.Set_source(0)
        status.Set_tag(0)
        status.Set_elements(MPI.BYTE, len(raw))
        return _Message(raw)


def test_one_poll_after_a_nap_delivers_a_frame_that_the_first_probe_misses():
    delivered = []
    transport = make_transport(
        MPI.COMM_SELF, lambda source, frame, tensors: delivered.append(frame)
    )
    receiver = transport._receiver
    own_ctrl = receiver.ctrl
    late = receiver.ctrl = _MatchBeforeProgressComm(BODY.dumps())
    try:
        # One wake-up of the progress thread is one call; the frame must not wait
        # for the next one (a whole nap later).
        assert transport._poll_and_run()
        assert [(f.kind, f.body) for f in delivered] == [(Kind.RREF_FORK, ("body",))]
        # With nothing in flight a poll stops after the second empty probe.
        late.calls = 0
        assert not transport._poll_and_run()
        assert late.calls == 2
    finally:
        receiver.ctrl = own_ctrl
        transport.free()


# ---------------------------------------------------------------------------
# Doorbells: a napping progress thread is woken by a sender on its node


def test_a_ring_wakes_a_napping_peer():
    token = os.urandom(8).hex()
    ringer = Doorbell.create(token, 0, [0, 1])  # the node's first agent creates the board
    sleeper = Doorbell.create(token, 1, [0, 1])
    assert isinstance(sleeper, Doorbell) and isinstance(ringer, Doorbell)
    napping = threading.Event()

    def nap() -> None:
        sleeper.arm()
        napping.set()
        sleeper.wait(600.0)
        sleeper.disarm()

    try:
        napper = threading.Thread(target=nap, daemon=True)
        napper.start()
        assert napping.wait(scaled(60.0))
        ringer.ring(1)
        napper.join(scaled(60.0))  # a nap of 600 s that only a ring ends early
        assert not napper.is_alive()
    finally:
        ringer.ring(1)
        sleeper.close()
        ringer.close()


def _queued_rings(bell: Doorbell) -> int:
    readable, _, _ = select.select([bell._sock], [], [], 0)
    return len(readable)


def test_only_a_napping_peer_is_rung():
    # A peer that polls without napping would only collect rings it never reads
    # (and a full queue makes each ring raise): it is not rung.
    token = os.urandom(8).hex()
    bell = Doorbell.create(token, 0, [0, 1])
    peer = Doorbell.create(token, 1, [0, 1])
    assert bell.has_board() and peer.has_board()
    try:
        bell.ring(1)
        assert _queued_rings(peer) == 0
        peer.arm()
        bell.ring(1)
        assert _queued_rings(peer) == 1
        peer.arm()  # a second napping thread of the same agent...
        peer.disarm()  # ...that woke up
        peer.wait(0.0)  # takes the ring
        bell.ring(1)  # still armed: the first thread naps on
        assert _queued_rings(peer) == 1
        peer.wait(0.0)
        peer.disarm()
        bell.ring(1)
        assert _queued_rings(peer) == 0
    finally:
        bell.close()
        peer.close()
    assert not os.path.exists(bell._board_path)  # no file left behind in /dev/shm


def test_agents_without_a_shared_board_ring_every_frame(monkeypatch, tmp_path):
    token = os.urandom(8).hex()
    first = Doorbell.create(token, 0, [0, 1])
    # A peer with a private /dev/shm (a container) that even holds a stranger's file of
    # that name: it must not take that file, or its own, for the node's board.
    (tmp_path / f"lightning_distgrad-{token}").write_bytes(bytes(64))
    monkeypatch.setattr(_doorbell, "BOARD_DIR", str(tmp_path))
    peer = Doorbell.create(token, 1, [0, 1])
    try:
        assert first.has_board() and not peer.has_board()
        first.ring(1)
        assert _queued_rings(peer) == 0  # with the board: a peer that does not nap
        first.drop_board()  # as the transport does unless every agent has the board
        first.ring(1)
        assert _queued_rings(peer) == 1  # rung, napping or not
    finally:
        first.close()
        peer.close()


def test_rings_are_hints_that_never_fail():
    token = os.urandom(8).hex()
    bell = Doorbell.create(token, 0, [0, 1, 2])
    peer = Doorbell.create(token, 1, [0, 1, 2])
    try:
        peer.arm()
        for _ in range(100):  # far beyond the socket's queue: the extra rings are dropped
            bell.ring(1)
        bell._board[2] = 1  # as if rank 2 napped, then died without a word
        bell.ring(2)  # on this node but not listening (gone, or not started yet)
        bell.ring(7)  # not on this node: never rung
        peer.wait(0.0)  # takes every pending ring at once...
        assert _queued_rings(peer) == 0  # ...so the next nap is not cut short by stale rings
    finally:
        bell.close()
        peer.close()


def test_without_a_socket_only_this_process_can_wake_the_nap():
    token = os.urandom(8).hex()
    first = Doorbell.create(token, 0, [0])
    second = Doorbell.create(token, 0, [0])  # the address is taken: no socket
    try:
        assert isinstance(first, Doorbell) and isinstance(second, LocalBell)
        second.ring(0)  # a no-op
        nap = threading.Thread(target=second.wait, args=(600.0,))
        nap.start()
        second.ring_self()
        nap.join(scaled(60.0))
        assert not nap.is_alive()
    finally:
        first.close()
        second.close()


def test_a_quiet_spell_arms_the_bell_once_and_polls_once_more_before_the_first_nap():
    events = []

    class Bell(LocalBell):
        def arm(self) -> None:
            events.append("arm")

        def disarm(self) -> None:
            events.append("disarm")

        def wait(self, timeout: float) -> None:
            events.append("nap")

    def poll(found: bool) -> bool:
        events.append("poll")
        return found

    backoff = ArmedBackoff(Bell(), lambda: poll(False))
    for _ in range(3):
        assert backoff.sleep(float("inf"), 0.004) is False
    backoff.reset()  # traffic came
    backoff.reset()
    assert events == ["arm", "poll", "nap", "nap", "nap", "disarm"]
    # A frame posted before the arming showed: found by that poll, no nap.
    events.clear()
    backoff = ArmedBackoff(Bell(), lambda: poll(True))
    assert backoff.sleep(float("inf"), 0.004) is True
    assert events == ["arm", "poll"]


class _RecordingBell(LocalBell):
    def __init__(self):
        super().__init__()
        self.rung: list = []

    def ring(self, rank: int) -> None:
        self.rung.append(rank)

    def ring_self(self) -> None:
        self.rung.append("self")


def _poll_until(transport: Transport, done) -> bool:
    """Drive ``transport`` by hand (its progress thread is not started) until ``done()``."""

    def polled() -> bool:
        transport._poll_and_run()
        return done()

    return wait_until(polled, timeout=60, interval=0.0005)


def _drain_sends(transport: Transport) -> None:
    # A send completes once its receive matches.
    assert _poll_until(transport, lambda: not transport._sender.sends), (
        "the frame was never received"
    )


def test_a_frame_to_ourselves_wakes_our_own_napping_progress_thread():
    transport = make_transport(MPI.COMM_SELF)
    own, transport._bell = transport._bell, _RecordingBell()
    try:
        transport.send(0, BODY, [])
        assert transport._bell.rung == ["self"]
    finally:
        _drain_sends(transport)
        transport._bell = own
        transport.free()


@pytest.mark.mpi(min_size=2)
def test_posting_a_frame_rings_its_destination(mpi_comm):
    delivered = []
    transport = make_transport(mpi_comm, lambda source, frame, tensors: delivered.append(source))
    own, transport._bell = transport._bell, _RecordingBell()
    try:
        if transport.rank == 0:
            transport.send(1, BODY, [])
            assert transport._bell.rung == [1]
            _drain_sends(transport)
        elif transport.rank == 1:
            assert _poll_until(transport, lambda: bool(delivered)), "no frame from rank 0"
            assert delivered == [0] and transport._bell.rung == []
    finally:
        transport._bell = own
        transport.free()


def test_a_nap_never_runs_past_the_next_timer():
    transport = make_transport(MPI.COMM_SELF)
    # (nap asked for, when the earliest timer is due then, when the thread's last nap
    # ended): the progress thread reads the clock for its next nap after that end.
    naps = []
    last_end = [float("-inf")]

    class RecordingNaps(LocalBell):
        def wait(self, timeout: float, *args) -> None:
            now = time.monotonic()
            naps.append((timeout, now + transport._timers.until_next(now), last_end[0]))
            super().wait(timeout)
            last_end[0] = time.monotonic()

    own, transport._bell = transport._bell, RecordingNaps()
    transport._last_traffic -= 10.0  # long idle: naps grow to their longest
    transport.start()
    try:
        # Naps did grow to their longest.
        assert wait_until(lambda: max((n for n, _, _ in naps), default=0.0) >= QUIET_NAP_S)
        fired = threading.Event()
        # Long enough to nap a few times while it pends even when other processes hold the
        # cores; the last naps before it fires must end by then.
        transport.call_later(0.2, fired.set)
        assert fired.wait(scaled(60))
    finally:
        transport.stop()
        transport._bell = own
        transport.free()
    while_pending = [nap for nap in naps if nap[1] != float("inf")]
    assert while_pending, "no nap was taken while the timer was pending"
    # A nap may last until the timer is due as seen when it was chosen: at the latest,
    # as seen when the nap before it ended (however late this thread got the core).
    late = [(nap, due - end) for nap, due, end in while_pending if nap > max(due - end, 0.0)]
    assert not late, f"naps longer than the time left to the timer: {late}"


# ---------------------------------------------------------------------------
# Work handed to a waiting thread runs on that thread


def test_work_handed_to_the_waiting_thread_runs_there_before_it_stops():
    """Work handed to a waiter (served frames it waits for, delivered by another thread)
    runs on the waiting thread, while it waits or as it stops waiting; none is left."""
    waiter_thread_ran = []
    waiter = None
    done = threading.Event()

    def handler() -> None:
        waiter_thread_ran.append(threading.current_thread().name)
        done.set()

    def wait() -> None:
        nonlocal waiter
        waiter = Waiter(threading.get_ident())
        while True:  # as Agent.wait_done's check between polls
            waiter.run_handed_over()
            if done.is_set():
                return
            waiter.sleep(60)

    thread = threading.Thread(target=wait, name="waiting-thread")
    thread.start()
    assert wait_until(lambda: waiter is not None)
    waiter.hand_over(handler)
    thread.join(scaled(60))
    assert not thread.is_alive()
    assert waiter_thread_ran == ["waiting-thread"]
    waiter.hand_over(handler)  # after its last wait: run as it stops
    waiter.run_handed_over()
    assert waiter_thread_ran == ["waiting-thread", "MainThread"]
    waiter.run_handed_over()
    assert len(waiter_thread_ran) == 2


def test_the_standby_reads_a_holders_cpu_time_which_stands_still_while_it_waits():
    """The standby tells a long computation (whose CPU time grows) from a run that only waits
    for a core or a lock (whose CPU time does not), so a preempted run keeps the role."""
    work_s = 0.05  # CPU time the thread computes, as it measures it itself
    parked, go, computed, finish = (threading.Event() for _ in range(4))

    def holder():
        parked.set()
        go.wait()
        start = time.thread_time()
        while time.thread_time() - start < work_s:
            pass
        computed.set()
        finish.wait()

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert parked.wait(scaled(30))
        clock = progress._cpu_time(thread.ident)
        before_wait = clock()
        time.sleep(work_s)  # as long as it will compute, while it waits on an event
        waited = clock() - before_wait
        go.set()
        assert computed.wait(scaled(30))
        assert clock() - before_wait - waited >= work_s
        assert waited < work_s / 10, "a waiting thread's CPU clock went on"
    finally:
        go.set()
        finish.set()
        thread.join()


def test_the_standby_takes_the_role_from_a_computation_however_slowly_it_computes(monkeypatch):
    """A computation on a crowded core uses its CPU time slowly; the standby keeps watching
    it (it goes quiet only once no inline run lasts), here with the quiet spell shortened to
    far less than the CPU time that marks a long computation."""
    monkeypatch.setattr(progress, "QUIET_S", 0.001)
    lock, taken_over, failures = threading.Lock(), threading.Event(), []
    computing, computed = threading.Event(), []

    def run() -> None:  # the poll loop of whichever thread holds the role
        me = threading.get_ident()
        if computing.is_set():  # the standby, now the holder
            taken_over.set()
            with lock:
                role.mark_stopped()
            return
        computing.set()
        assert role.begin_inline()
        start = time.thread_time()
        while role.holder == me and time.thread_time() - start < scaled(10):
            pass  # computes until the role is taken from it
        computed.append(time.thread_time() - start)
        role.end_inline()

    role = progress.ProgressRole(lock, run, lambda: None, failures.append)
    role.start()
    assert taken_over.wait(scaled(20)), "not taken over"
    role.join()
    assert wait_until(lambda: computed)
    assert not failures
    assert role.handoffs == 1
    assert progress.LONG_RUN_CPU_S <= computed[0] < scaled(10)


def _record_naps(transport: Transport, monkeypatch) -> list[float]:
    """The naps the progress thread of ``transport`` asks its doorbell for, as it asks."""
    naps: list[float] = []
    wait = transport._bell.wait

    def recorded(timeout: float) -> None:
        if transport.is_progress_thread(threading.get_ident()):
            naps.append(timeout)
        wait(timeout)

    monkeypatch.setattr(transport._bell, "wait", recorded)
    return naps


@pytest.mark.parametrize("every_peer_rings", [True, False], ids=["rung", "not rung"])
def test_a_quiet_poller_naps_long_only_where_every_peer_can_ring_it(monkeypatch, every_peer_rings):
    """Where every peer rings the poller's doorbell, its naps grow to RUNG_QUIET_NAP_S after a
    quiet spell: an idle agent wakes a few times a second. Where a peer cannot (on another
    node), they stop at QUIET_NAP_S, so that its frames are seen soon."""
    transport = make_transport(MPI.COMM_SELF)
    assert transport._rung_by_every_peer  # alone: no peer that cannot ring it
    transport._rung_by_every_peer = every_peer_rings
    naps = _record_naps(transport, monkeypatch)
    transport._last_traffic -= 10.0  # long idle
    transport.start()
    cap = RUNG_QUIET_NAP_S if every_peer_rings else QUIET_NAP_S
    try:
        assert wait_until(lambda: bool(naps) and max(naps) >= cap), naps
        window = 5 * RUNG_QUIET_NAP_S
        before = len(naps)
        time.sleep(window)
        woke = len(naps) - before
    finally:
        transport.stop()
        transport.free()
    assert max(naps) == cap
    if every_peer_rings:  # about window / cap wake-ups (fewer on a busy machine, never more)
        assert woke <= window / RUNG_QUIET_NAP_S + 2, f"{woke} naps in {window} s"


@pytest.mark.mpi(min_size=2)
def test_a_send_posted_while_the_poller_naps_long_wakes_it_and_a_waiters_send_does_not(
    mpi_comm, monkeypatch
):
    """A long nap is cut short by this process's own sends (MPI progresses them only while
    someone polls); a send from a thread that polls while it waits (as every ``rpc_sync``
    caller does) rings only its destination."""
    delivered = []
    transport = make_transport(mpi_comm, lambda source, frame, tensors: delivered.append(source))
    if not transport._rung_by_every_peer:  # the same on every rank
        transport.free()
        pytest.skip("the ranks are not all on one node: no poller naps long")
    rung = []
    ring_self, ring = transport._bell.ring_self, transport._bell.ring
    monkeypatch.setattr(transport._bell, "ring_self", lambda: (rung.append("self"), ring_self()))
    monkeypatch.setattr(transport._bell, "ring", lambda rank: (rung.append(rank), ring(rank)))
    try:
        if transport.rank == 0:
            transport._last_traffic -= 10.0
            transport.start()
            # Whether the poller napped long as the send was posted (under the same lock): it
            # may be between two naps, polling, and then needs no ring.
            napping_long_at_post = []
            post = transport._sender.post
            monkeypatch.setattr(
                transport._sender,
                "post",
                lambda *args: (napping_long_at_post.append(transport._napping_long), post(*args)),
            )
            for _ in range(ATTEMPTS):
                assert wait_until(lambda: transport._napping_long), "the poller never napped long"
                rung.clear()
                transport.send(1, BODY, [])
                assert wait_until(lambda: not transport._sender.sends), "the frame was not received"
                if napping_long_at_post[-1]:
                    assert "self" in rung, rung
                    break
            assert any(napping_long_at_post), f"no send met a long nap in {ATTEMPTS} tries"
            rung.clear()
            rung_by_the_send = []

            def sent_once() -> bool:
                if not rung_by_the_send:
                    transport.send(1, BODY, [])
                    rung_by_the_send.append(list(rung))
                return not transport._sender.sends

            assert transport.drive_until(sent_once)
            assert rung_by_the_send == [[1]]  # its destination only
            mpi_comm.send(len(napping_long_at_post), dest=1)  # frames sent to rank 1
        elif transport.rank == 1:
            assert _poll_until(transport, lambda: mpi_comm.Iprobe(source=0)), "no count came"
            sent = mpi_comm.recv(source=0)
            assert _poll_until(transport, lambda: len(delivered) == sent), delivered
    finally:
        if transport.rank == 0:
            transport.stop()
        transport.free()
