"""MPI transport: private communicators and one progress engine.

One lock guards every MPI call and every field of :class:`Transport`. Whoever
holds it posts sends, probes for frames, starts and tests transfers, and
takes the frames that completed; their handlers then run outside the lock, on
that same thread, in arrival order.

Who polls is the :class:`Poller` state. The progress thread polls by
default. A thread that waits for a result may poll in its place
(:meth:`Transport.drive_until`): the reply then wakes no other thread. Nobody
parks inside a blocking MPI call (MPICH spins there, costing a whole core): an
idle poller naps with a doubling backoff (mpi4py.futures style), and peers on
the same node end the nap with the doorbell (see ``_doorbell``).

Nothing a peer sends can stop progress: a frame that fails to decode or
validate goes to ``on_malformed``, an error raised while handling a frame is
logged, and tensor bytes that never arrive are abandoned at the transfer
deadline.

Communicators (all duplicates of the user's, so no one else's traffic can
match ours): ``ctrl`` carries frames (probed with ANY_SOURCE), ``data`` carries
tensor bytes matched by exact (source, tag), ``coll`` carries the shutdown
collectives.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import heapq
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterator

import numpy as np
import torch
from mpi4py import MPI

from ._abort import abort_mpi_job
from ._doorbell import Doorbell, LocalBell
from ._wire import (
    Frame,
    FrameLimits,
    MalformedFrame,
    ReceiveBufferPool,
    allocate_tensor,
    decode_frame,
    prepare_tensor,
    tensor_bytes_view,
    to_target_device,
)

log = logging.getLogger("lightning_distgrad.rpc")

# Tensor bytes go in chunks of at most 1 GiB: portable beyond MPI-4 large counts.
CHUNK_BYTES = 1 << 30
# After traffic, poll without napping this long (only where every rank has a core).
HOT_S = 0.002
# A transfer in flight keeps the poller hot this long after the last completion
# (MPICH moves big messages only inside MPI calls); past it, naps resume.
TRANSFER_HOT_S = 1.0
# Naps double from NAP_MIN_S to NAP_MAX_S; after QUIET_S without traffic, up to
# the quiet cap (longer where every peer can ring: a nap then costs no latency).
NAP_MIN_S = 1.5e-5
NAP_MAX_S = 0.001
QUIET_S = 0.1
QUIET_NAP_S = 0.004
QUIET_NAP_ALL_RING_S = 0.02


class Poller(enum.Enum):
    """Which thread polls MPI."""

    PROGRESS_THREAD = "progress thread"
    WAITER = "a thread waiting for a result"


class State(enum.Enum):
    RUNNING = "running"
    STOPPING = "stopping"  # flushing queued sends, then the progress thread exits
    STOPPED = "stopped"


def _in_default_modes() -> bool:
    """Whether this thread's torch modes are those of a fresh thread."""
    return (torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
            and not torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled("cuda"))


@contextlib.contextmanager
def _default_modes() -> Iterator[None]:
    """Grad mode on, inference mode and autocast off, as on a fresh thread."""
    with contextlib.ExitStack() as modes:
        modes.enter_context(torch.inference_mode(False))
        modes.enter_context(torch.enable_grad())
        modes.enter_context(torch.autocast("cpu", enabled=False))
        if torch.cuda.is_available():
            modes.enter_context(torch.autocast("cuda", enabled=False))
        yield


class _Backoff:
    """Doubling naps, reset by traffic; the bell is armed from the first nap of a quiet
    spell until :meth:`reset`.

    Peers ring only an armed bell, so one poll right after arming finds a frame
    that was posted before peers could see the arming.
    """

    def __init__(self, bell: Doorbell | LocalBell, poll: Callable[[], bool], quiet_cap: float):
        self._bell = bell
        self._poll = poll
        self._quiet_cap = quiet_cap
        self._delay = NAP_MIN_S
        self._armed = False

    def reset(self) -> None:
        self._delay = NAP_MIN_S
        if self._armed:
            self._armed = False
            self._bell.disarm()

    def sleep(self, idle_for: float, limit: float) -> bool:
        """Nap at most ``limit`` s; True, without a nap, if the poll on arming found traffic."""
        if not self._armed:
            self._armed = True
            self._bell.arm()
            if self._poll():
                return True
        self._bell.wait(min(self._delay, limit))
        cap = self._quiet_cap if idle_for > QUIET_S else NAP_MAX_S
        self._delay = min(cap, self._delay * 2)
        return False


class _Incoming:
    """A frame whose tensor bytes are still arriving."""

    __slots__ = ("source", "frame", "tensors", "requests", "sizes", "deadline")

    def __init__(self, source, frame, tensors, requests, sizes, deadline):
        self.source = source
        self.frame = frame
        self.tensors = tensors
        self.requests = requests
        self.sizes = sizes  # bytes expected by each request
        self.deadline = deadline


class Transport:
    """Moves frames and tensors between ranks of ``comm``.

    ``on_frame(source, frame, tensors)`` runs for every complete incoming
    message, in arrival order, on the polling thread, outside the lock.
    ``on_malformed(source, error)`` runs for a frame that could not be read
    (``error.frame`` is its header when that decoded). ``transfer_timeout``
    bounds how long tensor bytes may take to arrive after their frame.
    """

    def __init__(self, comm: MPI.Comm, on_frame: Callable[[int, Frame, list], None],
                 on_malformed: Callable[[int, MalformedFrame], None], *,
                 limits: FrameLimits, transfer_timeout: float):
        if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            raise RuntimeError(
                "lightning_distgrad needs MPI initialised with MPI_THREAD_SERIALIZED or "
                f"higher (got level {MPI.Query_thread()}); do not lower "
                "mpi4py.rc.thread_level (its default, 'multiple', works)")
        self.ctrl = comm.Dup()
        self.data = comm.Dup()
        self.coll = comm.Dup()
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._tag_mod = min((self.ctrl.Get_attr(MPI.TAG_UB) or 32767) + 1, 1 << 20)
        self._bell, all_ring, oversubscribed = _node_doorbell(comm, self.rank)
        # Spinning only pays where every rank of the node has a core of its own.
        self.spin = not oversubscribed
        self._quiet_nap = QUIET_NAP_ALL_RING_S if all_ring else QUIET_NAP_S
        self._on_frame = on_frame
        self._on_malformed = on_malformed
        self._limits = limits
        self._transfer_timeout = transfer_timeout
        self._buffers = ReceiveBufferPool()
        self._status = MPI.Status()
        # Everything below is guarded by _lock.
        self._lock = threading.Lock()
        self._state = State.RUNNING
        self._poller = Poller.PROGRESS_THREAD
        self._waiter: int | None = None  # ident of the waiting thread that polls
        self._waiter_work: collections.deque = collections.deque()  # run by that thread
        # The progress thread sleeps while a waiter polls: when the waiter leaves, the
        # bell is armed so that peers ring it for the next frame (see _hand_back).
        self._armed_for_hand_back = False
        self._handlers_running = 0
        self._send_seq = [0] * self.size
        self._frames_sent = 0
        self._sends: list[tuple[list[MPI.Request], object]] = []
        self._incoming: list[_Incoming] = []
        self._ready: collections.deque = collections.deque()  # frames and deferred calls
        self._deliverer: int | None = None  # ident of the thread handling _ready's items
        # Calls queued without the lock (call_soon); a deque's append is atomic.
        self._soon: collections.deque = collections.deque()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._timer_seq = 0
        self._last_traffic = time.monotonic()
        self._stop_deadline = float("inf")
        # Receives cancelled at their deadline, until MPI confirms the cancellation.
        self._cancelled: list[MPI.Request] = []
        self._thread = threading.Thread(target=self._progress_thread, daemon=True,
                                        name="distgrad-progress")

    def start(self) -> None:
        """Start the progress thread (once the owner is ready for ``on_frame``)."""
        self._thread.start()

    # -- called from any thread -------------------------------------------------

    def send(self, dst: int, frame: Frame, tensors: list[torch.Tensor],
             devices: list[str] | None = None) -> None:
        """Send ``frame`` (whose ``metas`` get filled here) and its tensors to ``dst``.

        ``devices`` gives each tensor's device on the receiver (default: CPU).
        """
        buffers = []
        metas = []
        for i, t in enumerate(tensors):
            meta, data = prepare_tensor(t, devices[i] if devices else "cpu")
            metas.append(meta)
            if data is not None:
                buffers.append(data)
        self.send_raw(dst, frame.dumps(tuple(metas)), buffers)

    def send_raw(self, dst: int, raw: bytes, buffers: list[torch.Tensor] = ()) -> None:
        """Post encoded frame bytes, then each buffer's bytes, to ``dst`` (in order)."""
        with self._lock:
            seq = self._send_seq[dst]
            self._send_seq[dst] = seq + 1
            tag = seq % self._tag_mod
            self._frames_sent += 1
            requests = [self.ctrl.Isend([raw, MPI.BYTE], dst, tag)]
            for t in buffers:
                for chunk in _chunks(tensor_bytes_view(t)):
                    requests.append(self.data.Isend([chunk, MPI.BYTE], dst, tag))
            self._sends.append((requests, (raw, buffers)))
        if dst == self.rank:
            self._bell.ring_self()  # our own poller may nap
        else:
            self._bell.ring(dst)

    def drive_until(self, done: Callable[[], bool]) -> bool:
        """Poll on this thread until ``done()``; False at once if another thread waits
        here already (then wait for the result some other way)."""
        me = threading.get_ident()
        with self._lock:
            if self._poller is Poller.WAITER or self._state is not State.RUNNING:
                return False
            self._poller, self._waiter = Poller.WAITER, me
            self._disarm_hand_back()
        if not _in_default_modes():
            # Frames handled here (requests, received tensors, recorded autograd) belong
            # to other threads and ranks: not to this caller's no_grad or autocast.
            with _default_modes():
                self._drive(done)
        else:
            self._drive(done)
        return True

    def run_on_waiter(self, ident: int, fn: Callable[[], None]) -> bool:
        """Run ``fn`` on thread ``ident`` if that thread polls in :meth:`drive_until`
        (before it returns); False if it does not."""
        with self._lock:
            if self._waiter != ident:
                return False
            self._waiter_work.append(fn)
            return True

    def frames_sent(self) -> int:
        with self._lock:
            return self._frames_sent

    def is_progress_thread(self, ident: int) -> bool:
        return ident == self._thread.ident

    def busy(self, delta: int) -> None:
        """Count running request handlers: the poller naps rather than spins meanwhile."""
        with self._lock:
            self._handlers_running += delta

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the polling thread, outside the lock, after ``delay`` s."""
        with self._lock:
            self._timer_seq += 1
            entry = (time.monotonic() + delay, self._timer_seq, fn)
            heapq.heappush(self._timers, entry)
            # A napping progress thread must wake for a timer earlier than its nap's end;
            # a waiter that polls fires timers itself.
            ring = self._timers[0] is entry and self._poller is Poller.PROGRESS_THREAD
        if ring:
            self._bell.ring_self()

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the polling thread soon. Takes no lock: safe from ``__del__``,
        which garbage collection may run on a thread that holds the lock."""
        self._soon.append(fn)
        self._bell.ring_self()

    def has_queued(self) -> bool:
        """Whether calls queued by :meth:`call_soon` have yet to run."""
        return bool(self._soon)

    def allreduce_sum(self, values: list[int], timeout: float | None = None) -> list[int] | None:
        """Sum ``values`` over all ranks; None if that took longer than ``timeout`` s.

        Blocks the caller, never the poller. A timed-out collective stays posted
        (MPI cannot cancel one): use ``coll`` for nothing else afterwards.
        """
        send = np.array(values, dtype=np.int64)
        recv = np.zeros_like(send)
        with self._lock:
            request = self.coll.Iallreduce(send, recv, MPI.SUM)
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = NAP_MIN_S
        while True:
            with self._lock:
                finished = request.Test()
            if finished:
                return recv.tolist()
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(delay)
            delay = min(NAP_MAX_S, delay * 2)

    def stop(self, flush_timeout: float = 5.0) -> None:
        """Stop the progress thread once queued sends completed (or ``flush_timeout``
        passed: a peer that stopped receiving cannot hold this rank forever)."""
        with self._lock:
            self._state = State.STOPPING
            self._stop_deadline = time.monotonic() + flush_timeout
        self._bell.ring_self()
        self._thread.join()

    def free(self) -> None:
        for comm in (self.ctrl, self.data, self.coll):
            comm.Free()
        self._bell.close()

    # -- polling ----------------------------------------------------------------

    def _progress_thread(self) -> None:
        try:
            self._poll_loop()
        except BaseException:
            # Only a fault of MPI or of this module gets here (frames' own errors are
            # caught): a dead poller would leave every rank waiting, so fail-stop.
            traceback.print_exc()
            abort_mpi_job(f"lightning_distgrad: RPC progress thread failed on rank "
                          f"{self.rank}; aborting the MPI job.\n")

    def _poll_loop(self) -> None:
        backoff = _Backoff(self._bell, self._poll_and_run, self._quiet_nap)
        while True:
            with self._lock:
                if self._state is State.STOPPING and (
                        not self._sends or time.monotonic() > self._stop_deadline):
                    self._state = State.STOPPED
                    break
                stepped_aside = self._poller is Poller.WAITER
                if not stepped_aside:
                    self._disarm_hand_back()
            if stepped_aside:
                # The waiter polls, fires timers and answers rings; it arms our bell
                # and rings it when it leaves (see _hand_back).
                backoff.reset()
                self._bell.wait(QUIET_NAP_ALL_RING_S)
                continue
            self._poll_step(backoff)
        backoff.reset()

    def _drive(self, done: Callable[[], bool]) -> None:
        backoff = None if self.spin else _Backoff(self._bell, self._poll_and_run, NAP_MAX_S)
        work = self._waiter_work
        try:
            while not done():
                progressed = self._poll_and_run()
                while work:
                    self._run(work.popleft())
                if progressed:  # done() may be true now: check before yielding
                    if backoff is not None:
                        backoff.reset()
                elif backoff is None:
                    os.sched_yield()
                elif backoff.sleep(0.0, self._until_next_timer()):
                    backoff.reset()
        finally:
            if backoff is not None:
                backoff.reset()
            left = self._hand_back()
            for fn in left:  # handed to this waiter before it left: run them all the same
                self._run(fn)

    def _hand_back(self) -> list:
        """The waiter leaves: the progress thread polls again. Its bell is armed so that
        peers ring it, and rung now only if work is waiting (waking it for nothing, once
        per call, costs more than it saves)."""
        with self._lock:
            self._poller, self._waiter = Poller.PROGRESS_THREAD, None
            left = list(self._waiter_work)
            self._waiter_work.clear()
            if not self._armed_for_hand_back:
                self._armed_for_hand_back = True
                self._bell.arm()
            pending = bool(self._sends or self._incoming or self._ready or self._soon
                           or (self._timers and self._timers[0][0] <= time.monotonic())
                           or self._frame_waiting())
        if pending:
            self._bell.ring_self()
        return left

    def _disarm_hand_back(self) -> None:
        """Under the lock: someone polls again, so peers need not ring for it."""
        if self._armed_for_hand_back:
            self._armed_for_hand_back = False
            self._bell.disarm()

    def _frame_waiting(self) -> bool:
        # Twice: MPICH matches before it makes progress (see _poll_frames).
        return bool(self.ctrl.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
                    or self.ctrl.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG))

    def _poll_step(self, backoff: _Backoff) -> None:
        """One step of the progress thread: poll, then spin or nap if nothing came."""
        if self._poll_and_run():
            backoff.reset()
            return
        now = time.monotonic()
        with self._lock:
            idle_for = now - self._last_traffic
            hot = self.spin and not self._handlers_running and (
                idle_for < HOT_S or (self._incoming and idle_for < TRANSFER_HOT_S)
                or (self._sends and idle_for < TRANSFER_HOT_S))
            limit = self._until_next_timer_locked(now)
        if hot:
            os.sched_yield()
        elif backoff.sleep(idle_for, limit):
            backoff.reset()

    def _poll_and_run(self) -> bool:
        """Poll once under the lock, then run what completed outside it.

        One thread delivers at a time, so frames are handled in arrival order: a
        thread that finds another delivering leaves its frames to that one, which
        takes them before it stops. A handler that polls again (a nested wait)
        delivers too, and the outer call releases the turn.
        """
        me = threading.get_ident()
        soon = self._soon
        while soon:
            self._run(soon.popleft())
        with self._lock:
            progressed = self._post_and_poll()
            now = time.monotonic()
            if progressed:
                self._last_traffic = now
            while self._timers and self._timers[0][0] <= now:
                self._ready.append(heapq.heappop(self._timers)[2])
            if not self._ready or self._deliverer not in (None, me):
                return progressed
            outer = self._deliverer is None
            self._deliverer = me
            items = list(self._ready)
            self._ready.clear()
        while items:
            for item in items:
                self._run_item(item)
            with self._lock:
                items = list(self._ready)
                self._ready.clear()
                if not items and outer:
                    self._deliverer = None
        return progressed

    def _run_item(self, item) -> None:
        if callable(item):
            self._run(item)
        elif isinstance(item, MalformedFrame):
            self._run(lambda: self._on_malformed(item.source, item))
        else:
            self._run(lambda: self._deliver(*item))

    def _run(self, fn: Callable[[], None]) -> None:
        """Run a handler; its failure is logged and stops nothing else."""
        try:
            fn()
        except Exception:
            log.error("lightning_distgrad: a message handler failed on rank %d:\n%s",
                      self.rank, traceback.format_exc())

    def _deliver(self, source: int, frame: Frame, tensors: list) -> None:
        if any(meta[4] != "cpu" for meta in frame.metas):
            tensors = [to_target_device(t, m) for t, m in zip(tensors, frame.metas, strict=True)]
        self._on_frame(source, frame, tensors)

    # -- under the lock ----------------------------------------------------------

    def _post_and_poll(self) -> bool:
        progressed = self._poll_frames()
        progressed |= self._test_requests()
        if self._cancelled:
            self._cancelled = [r for r in self._cancelled if not _settled(r)]
        return progressed

    def _poll_frames(self) -> bool:
        status = self._status
        progressed = False
        probed_again = False
        while True:
            message = self.ctrl.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            if message is None:
                if progressed or probed_again:
                    return progressed
                # MPICH's Improbe looks for a match before it makes progress, not
                # after: a frame that arrived during a nap shows only at the next call.
                probed_again = True
                continue
            progressed = True
            source, tag = status.Get_source(), status.Get_tag()
            raw = bytearray(status.Get_count(MPI.BYTE))
            message.Recv([raw, MPI.BYTE])
            try:
                self._receive(source, tag, raw)
            except MalformedFrame as e:
                e.source = source
                self._ready.append(e)

    def _receive(self, source: int, tag: int, raw: bytearray) -> None:
        if len(raw) > self._limits.max_message_bytes:
            raise MalformedFrame(f"a frame of {len(raw)} bytes is above max_message_bytes")
        frame = decode_frame(raw, self._limits)
        tensors = []
        requests = []
        sizes = []
        try:
            for meta in frame.metas:
                t = allocate_tensor(meta, self._buffers)
                tensors.append(t)
                if meta[3] is None:  # not inline: the bytes follow on ``data``
                    for chunk in _chunks(tensor_bytes_view(t)):
                        requests.append(self.data.Irecv([chunk, MPI.BYTE], source, tag))
                        sizes.append(chunk.size)
        except MemoryError:
            self._abandon(requests)
            raise MalformedFrame("no memory for its tensors", frame) from None
        # Frames from one source are handed over in the order they came: one whose
        # bytes are still arriving holds back the later ones.
        if requests or any(item.source == source for item in self._incoming):
            self._incoming.append(_Incoming(source, frame, tensors, requests, sizes,
                                            time.monotonic() + self._transfer_timeout))
        else:
            self._ready.append((source, frame, tensors))

    def _test_requests(self) -> bool:
        progressed = False
        if self._sends:
            pending = [s for s in self._sends if not MPI.Request.Testall(s[0])]
            progressed = len(pending) != len(self._sends)
            self._sends = pending
        if self._incoming:
            now = time.monotonic()
            still = []
            waiting: set[int] = set()  # sources with an earlier frame still arriving
            for item in self._incoming:
                problem = None if item.source in waiting else self._transfer_problem(item, now)
                if problem is None:
                    waiting.add(item.source)
                    still.append(item)
                    continue
                progressed = True
                if problem is _COMPLETE:
                    self._ready.append((item.source, item.frame, item.tensors))
                else:
                    error = MalformedFrame(problem, item.frame)
                    error.source = item.source
                    self._ready.append(error)
            self._incoming = still
        return progressed

    def _transfer_problem(self, item: _Incoming, now: float) -> object | None:
        """None while the bytes arrive; _COMPLETE once all did; else what went wrong
        (the transfer is then abandoned and its buffers freed)."""
        statuses = [MPI.Status() for _ in item.requests]
        try:
            if not MPI.Request.Testall(item.requests, statuses):
                if now < item.deadline:
                    return None
                self._abandon(item.requests)
                return (f"its tensor bytes did not arrive within {self._transfer_timeout:g} s; "
                        "the transfer was abandoned")
        except MPI.Exception as e:
            self._abandon(item.requests)
            return f"its tensor bytes could not be received ({e.Get_error_string()})"
        received = [s.Get_count(MPI.BYTE) for s in statuses]
        if received != item.sizes:
            return f"it declared {sum(item.sizes)} tensor bytes but {sum(received)} arrived"
        return _COMPLETE

    def _abandon(self, requests: list[MPI.Request]) -> None:
        """Cancel receives; they are tested until MPI confirms (never waited for)."""
        for request in requests:
            if request != MPI.REQUEST_NULL:
                with contextlib.suppress(MPI.Exception):
                    request.Cancel()
                if not _settled(request):
                    self._cancelled.append(request)

    def _until_next_timer(self) -> float:
        with self._lock:
            return self._until_next_timer_locked(time.monotonic())

    def _until_next_timer_locked(self, now: float) -> float:
        return max(0.0, self._timers[0][0] - now) if self._timers else float("inf")


_COMPLETE = object()


def _settled(request: MPI.Request) -> bool:
    try:
        return request.Test()
    except MPI.Exception:
        return True


def _chunks(view: np.ndarray) -> Iterator[np.ndarray]:
    for start in range(0, view.size, CHUNK_BYTES):
        yield view[start:start + CHUNK_BYTES]


def _node_doorbell(comm: MPI.Comm, rank: int) -> tuple[Doorbell | LocalBell, bool, bool]:
    """This rank's doorbell; whether every peer can ring it; whether the node has
    more ranks than this rank has cores. A collective over ``comm``."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        oversubscribed = node.Get_size() > len(os.sched_getaffinity(0))
        token = node.bcast(os.urandom(8).hex() if node.Get_rank() == 0 else None)
        node_ranks = node.allgather(rank)
        first = node.Get_rank() == 0  # its bell creates the nap board, the others open it
        bell = Doorbell.create(token, rank, node_ranks) if first else None
        node.Barrier()
        if not first:
            bell = Doorbell.create(token, rank, node_ranks)
        # A peer that never napped on the board was never rung: ring all unless all have it.
        if not node.allreduce(bell.has_board(), op=MPI.LAND):
            bell.drop_board()
        bell.forget_board()  # every agent of the node has opened it
        all_ring = isinstance(bell, Doorbell) and node.Get_size() == comm.Get_size()
        return bell, all_ring, oversubscribed
    finally:
        node.Free()
