"""MPI transport: private communicators and the one progress thread.

MPI calls are serialised by one lock. Senders post their frames themselves
when the lock is free (else they leave them on an outbox); the progress thread
polls for incoming frames, and a thread waiting for an RPC result polls in its
place (the progress thread then sleeps on the doorbell, see ``_driver_leaves``).
Nobody parks inside a blocking MPI call (MPICH spins there, costing a whole
core): the poller uses ``Improbe``/``Testall`` and, when idle, first yields for
a short hot window, then sleeps with an exponential backoff capped at 1-4 ms
(mpi4py.futures style). Senders on the same node cut the sleep short with a
doorbell (see ``_doorbell``).

The progress thread runs the request handlers it hands over itself (see
``run_here``); while one runs longer than 1 ms, a stand-in thread polls in its
place, so a handler may block, wait for RPCs or compute for long.

Communicators (all duplicates of the user's, so no one else's traffic can
match ours): ``ctrl`` carries frames (probed with ANY_SOURCE), ``data`` carries
tensor bytes matched by exact (source, tag), ``coll`` carries the shutdown
collectives.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from ._abort import abort_mpi_job
from ._doorbell import Doorbell, LocalBell
from ._wire import (
    Frame,
    ReceiveBufferPool,
    allocate_tensor,
    prepare_tensor,
    tensor_bytes_view,
    to_target_device,
)

# Tensor bytes go in chunks of at most 1 GiB: portable beyond MPI-4 large counts.
CHUNK_BYTES = 1 << 30
# Stay hot (sched_yield polling) this long after the last activity.
HOT_WINDOW_S = 0.002
BACKOFF_MAX_S = 0.001
BACKOFF_MIN_S = BACKOFF_MAX_S / 64
# Without traffic the cap grows: each wake-up costs 50-100 us of CPU on a small
# VM, and an idle agent must stay near zero CPU. (idle for at least, cap) pairs;
# only the first message after a long quiet spell waits for the longer naps.
IDLE_CAPS = ((0.05, 0.002), (0.5, 0.004))
# When every peer shares this node, every frame rings the doorbell, so a nap's
# length costs no latency: naps grow to 20 ms within 0.1 s. (A nap never runs past
# the next timer: timeout checks and shutdown's collectives keep their pace.)
IDLE_CAPS_ALL_RING = ((0.01, 0.004), (0.1, 0.02))
# The progress thread runs requests itself; one that runs longer than this gets a
# stand-in poller. The stand-in checks that often while requests come, and at
# the slower pace once none came for STAND_IN_QUIET_S.
STAND_IN_AFTER_S = 0.001
STAND_IN_CHECK_S = 0.005
STAND_IN_IDLE_CHECK_S = 0.02
STAND_IN_QUIET_S = 0.1
# A sender waits at most this long for the MPI lock, then hands off (see send).
SEND_LOCK_WAIT_S = 0.001
# While a thread drives, the progress thread waits on the doorbell: the driver rings it
# when it leaves work behind, peers on this node once it left (see _driver_leaves). It
# looks by itself this often (every BACKOFF_MAX_S where peers on other nodes cannot ring).
# Waking it every 1 ms cost 7-12% of a 3x3 distributed autograd iteration: each wake
# takes the GIL from the driver, and from the peer's CPU when the scheduler puts it there.
STEP_ASIDE_ALL_RING_S = 0.02


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
    """Doubling naps, reset by activity (mpi4py.futures' Backoff); peers on this node
    ring the bell to end a nap (see ``_doorbell``).

    From the first nap of a quiet spell until :meth:`reset`, the bell is armed
    (peers ring it), and it stays armed across the polls between naps; so one
    extra poll, right after arming, is all it takes to not miss a frame that
    was posted before peers could see the arming.
    """

    def __init__(self, bell: Doorbell | LocalBell, poll: Callable[[], bool],
                 caps: tuple = ()):
        self._bell = bell
        self._poll = poll
        self._caps = caps
        self._delay = BACKOFF_MIN_S
        self._armed = False

    def reset(self) -> None:
        """Traffic came (or the caller stops polling): short naps, bell disarmed."""
        self._delay = BACKOFF_MIN_S
        if self._armed:
            self._armed = False
            self._bell.disarm()

    def sleep(self, idle_for: float = 0.0, limit: float = float("inf")) -> bool:
        """Nap (at most ``limit`` seconds), then lengthen the next nap; True, without a
        nap, if the poll made on arming the bell found traffic."""
        if not self._armed:
            self._armed = True
            self._bell.arm()
            if self._poll():
                return True
        self._bell.wait(min(self._delay, limit))
        cap = BACKOFF_MAX_S
        for after, longer_cap in self._caps:
            if idle_for > after:
                cap = longer_cap
        self._delay = min(cap, self._delay * 2)
        return False


class _Incoming:
    """A frame whose tensor bytes are still arriving."""

    __slots__ = ("source", "frame", "tensors", "requests")

    def __init__(self, source: int, frame: Frame, tensors: list, requests: list):
        self.source = source
        self.frame = frame
        self.tensors = tensors
        self.requests = requests


class Transport:
    """Moves frames and tensors between ranks of ``comm``.

    ``on_frame(source, frame, tensors)`` runs for every complete incoming
    message, in arrival order, on whichever thread is driving progress, after
    that thread has released the MPI lock: a slow callback delays the frames
    behind it, never other threads' sends. It must not wait for other frames.

    MPI calls are serialised by one lock. The progress thread drives by
    default; a thread waiting for an RPC result may drive instead
    (:meth:`drive_until`), and then the progress thread steps aside, because
    two threads polling in one process only fight over the GIL.
    """

    def __init__(self, comm: MPI.Comm, on_frame: Callable[[int, Frame, list], None]):
        self.ctrl = comm.Dup()
        self.data = comm.Dup()
        self.coll = comm.Dup()
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        tag_ub = self.ctrl.Get_attr(MPI.TAG_UB) or 32767
        self._tag_mod = min(tag_ub + 1, 1 << 20)
        # Spinning (sched_yield polling) only pays when every rank of this node
        # has a core of its own; on an oversubscribed node it steals the CPU the
        # peers need, so there we only ever sleep between polls.
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.spin = node.Get_size() <= len(os.sched_getaffinity(0))
        token = node.bcast(os.urandom(8).hex() if node.Get_rank() == 0 else None)
        node_ranks = node.allgather(self.rank)
        first = node.Get_rank() == 0  # its bell creates the nap board, the others open it
        if first:
            self._bell = Doorbell.create(token, self.rank, node_ranks)
        node.Barrier()
        if not first:
            self._bell = Doorbell.create(token, self.rank, node_ranks)
        # Peers that do not nap are not rung only where every agent shares the board.
        if not node.allreduce(self._bell.has_board(), op=MPI.LAND):
            self._bell.drop_board()
        self._bell.forget_board()  # every agent of the node has opened it
        self._all_ring = isinstance(self._bell, Doorbell) and node.Get_size() == self.size
        node.Free()
        # Below SERIALIZED only the progress thread may call MPI.
        self._any_thread_may_send = MPI.Query_thread() >= MPI.THREAD_SERIALIZED
        self._on_frame = on_frame
        # Requests run by the thread that hands them over (see run_here): the one
        # taken, with its taker's ident; (start time,) while the progress thread runs one.
        self._handler: tuple[int, Callable[[], None]] | None = None
        self._handling: tuple[float] | None = None
        self._last_handler_end = 0.0
        self._stand_in_wake = threading.Lock()
        self._stand_in_wake.acquire()
        self._mpi_lock = threading.Lock()
        self._lock_owner: int | None = None  # ident of the thread inside _progress_once
        self._outbox: collections.deque = collections.deque()
        self._sleepers: set[int] = set()  # idents of napping polling threads
        self._driver: int | None = None  # ident of a thread driving progress
        self._driver_key: Any = None  # handlers with this key run on the driver
        # Handlers with the driver's key that another thread delivered (it polled
        # just as the driver took over): the driver runs them. Guarded, with the
        # driver's arrival and departure, by _driver_lock, so none is left behind.
        self._driver_inbox: collections.deque = collections.deque()
        self._driver_lock = threading.Lock()
        # The bell is armed for the driver's absence (see _driver_leaves); guarded by
        # _driver_lock.
        self._absence_armed = False
        self._step_aside_s = STEP_ASIDE_ALL_RING_S if self._all_ring else BACKOFF_MAX_S
        self._busy = 0  # request handlers running: the progress thread must not spin
        self._busy_lock = threading.Lock()
        self._send_seq = [0] * self.size
        # (request list, objects kept alive until the sends complete)
        self._sends: list[tuple[list[MPI.Request], Any]] = []
        self._incoming: list[_Incoming] = []
        self._buffers = ReceiveBufferPool()
        self._status = MPI.Status()  # of the frame being received (under the MPI lock)
        # Complete frames (and deferred calls) waiting to be handed over, in order.
        self._ready: collections.deque = collections.deque()
        self._deliver_lock = threading.Lock()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._timer_seq = 0
        self._running = True
        self._last_activity = time.monotonic()
        self._thread = threading.Thread(target=self._progress_loop, name="distgrad-progress",
                                        daemon=True)
        self._stand_in = threading.Thread(target=self._stand_in_loop, daemon=True,
                                          name="distgrad-progress-stand-in")

    def start(self) -> None:
        """Start the progress thread (once the owner is ready for ``on_frame``)."""
        self._thread.start()
        if self._any_thread_may_send:
            self._stand_in.start()

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
        item = (dst, frame.dumps(tuple(metas)), buffers)
        # The wait for the lock is bounded: the holder may be running queued
        # callables (collectives, timers), and a hand-off is cheaper than a
        # stall behind them.
        if (self._any_thread_may_send and self._lock_owner != threading.get_ident()
                and self._mpi_lock.acquire(timeout=SEND_LOCK_WAIT_S)):
            # Post from this thread: waiting for the lock (held for one poll at
            # most) beats a hand-off to the progress thread. Queued frames go
            # first, to keep per-destination order.
            try:
                self._lock_owner = threading.get_ident()
                try:
                    self._post_sends()
                    self._post(item)
                finally:
                    self._lock_owner = None
            finally:
                self._mpi_lock.release()
            return
        # MPI below SERIALIZED, a re-entrant send from a completion callback
        # that runs under the lock, or the lock is busy: the progress loop (or
        # the next sender that gets the lock) posts it, in order.
        self._outbox.append(item)
        self._kick()

    def drive_until(self, done: Callable[[], bool], key: Any = None) -> bool:
        """Drive progress on this thread until ``done()``; False if another thread drives.

        Handlers handed over with ``key`` (not None) run here (see :meth:`run_here`):
        the work this thread waits for (a backward pass's gradients at its root).
        """
        me = threading.get_ident()
        if not self._any_thread_may_send or self._driver is not None:
            return False
        if not _in_default_modes():
            # Frames handed over here (requests run inline, tensors received, autograd
            # recorded) must not inherit the caller's torch.no_grad(), inference mode
            # or autocast: they belong to other threads and other ranks.
            with _default_modes():
                return self.drive_until(done, key)
        with self._driver_lock:
            if self._driver is not None:
                return False
            self._driver = me
            self._driver_key = key
            self._disarm_absence()
        backoff = None if self.spin else _Backoff(self._bell, self._locked_progress_once)
        inbox = self._driver_inbox
        try:
            while not done():
                progressed = self._locked_progress_once()
                while inbox:
                    self._run_handler(inbox.popleft())
                if progressed:  # done() may be true now: check before yielding
                    if backoff is not None:
                        backoff.reset()
                elif backoff is None:
                    os.sched_yield()
                elif backoff.sleep():
                    backoff.reset()
        finally:
            if backoff is not None:
                backoff.reset()
            with self._driver_lock:
                if self._driver == me:
                    self._driver = None
                self._driver_key = None
                left = list(inbox)
                inbox.clear()
            self._last_activity = time.monotonic()
            for handler in left:  # delivered for this wait after it ended: ours all the same
                self._run_handler(handler)
            self._driver_leaves()
        return True

    def _disarm_absence(self) -> None:
        """Someone polls again (call under ``_driver_lock``): undo _driver_leaves' arming.

        A driver that arrives disarms; so does the progress thread when it takes
        over, since it arms the bell itself when it naps.
        """
        if self._absence_armed:
            self._absence_armed = False
            self._bell.disarm()

    def _driver_leaves(self) -> None:
        """Nobody drives any more: hand polling back to the progress thread.

        It waits on the doorbell meanwhile (see ``_poll_until``). Waking it here,
        several times per RPC, would cost more than it saves: the bell is armed
        instead, so that peers on this node ring it for the next frame, and it is
        rung at once only if something needs polling now (a transfer in flight,
        queued work, or a frame posted before peers could see the bell armed).
        """
        with self._driver_lock:
            if self._driver is not None or self._absence_armed:
                return
            self._absence_armed = True
            self._bell.arm()
        if (self._sends or self._incoming or self._outbox or self._ready
                or self._frame_waiting()):
            self._bell.ring_self()

    def _frame_waiting(self) -> bool:
        """Whether a frame waits to be received (False while another thread polls)."""
        if not self._mpi_lock.acquire(blocking=False):
            return False
        try:  # twice: MPICH matches before it makes progress (see _poll_frames)
            return bool(self.ctrl.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
                        or self.ctrl.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG))
        finally:
            self._mpi_lock.release()

    def run_here(self, handler: Callable[[], None], key: Any = None) -> bool:
        """From ``on_frame``: run ``handler`` (a request) on this thread; False if this
        thread may not (use a pool then).

        The progress thread may; a driver may if it waits for handlers with this
        ``key`` (the library's own work, which leaves no thread state behind: the
        driver is a user's thread; and only the work it waits for, or a slow
        handler of another pass would hold up its wait and its timeout).
        The handler runs as soon as this delivery step ends; later frames are
        handed over, in order, by whoever polls meanwhile. A hand-off to a pool
        thread cost about 190 us per request on a 2-core VM (the thread's
        wake-up, then two threads trading the GIL); most handlers take tens of
        us. While the progress thread runs a handler for longer than
        ``STAND_IN_AFTER_S``, a stand-in polls in its place; while a driver runs
        one, the progress thread polls. So a handler may block, compute for long
        or wait for anything a later frame brings.
        """
        me = threading.get_ident()
        if key is not None and key == self._driver_key and me != self._driver:
            # Another thread polled just as the driver took over (or while it runs a
            # handler): what the driver waits for still runs on the driver.
            with self._driver_lock:
                if key == self._driver_key:
                    self._driver_inbox.append(handler)
                    return True
        if self._driver is None:
            allowed = me == self._thread.ident
        else:  # not the progress thread driving inside its own handler (a nested wait)
            allowed = me == self._driver and key is not None and key == self._driver_key
        if not allowed or not self._any_thread_may_send or self._handler is not None:
            return False
        self._handler = (me, handler)
        return True

    def busy(self, delta: int) -> None:
        """Count running request handlers (+1 when one starts, -1 when it ends)."""
        with self._busy_lock:
            self._busy += delta

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the progress thread (used for collectives)."""
        self._outbox.append(fn)
        self._kick()

    def defer(self, fn: Callable[[], None]) -> None:
        """From the progress thread: run ``fn`` after the MPI lock is released."""
        self._ready.append(fn)

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the progress thread after ``delay`` seconds (timeouts)."""
        self.call_soon(lambda: self._add_timer(time.monotonic() + delay, fn))

    def stop(self) -> None:
        """Stop the progress thread after it has flushed queued sends."""
        self._running = False
        self._kick()
        self._thread.join()
        if self._stand_in.is_alive():
            self._stand_in_wake.release()
            self._stand_in.join()

    def free(self) -> None:
        for comm in (self.ctrl, self.data, self.coll):
            comm.Free()
        self._bell.close()

    def _kick(self) -> None:
        if self._sleepers:
            self._bell.ring_self()

    # -- progress ---------------------------------------------------------------

    def _progress_loop(self, until: Callable[[], bool] | None = None) -> None:
        try:
            self._progress_until(until or self._stopped)
        except BaseException:
            # A dead progress thread would leave every rank waiting forever:
            # fail-stop instead, with the cause on stderr.
            traceback.print_exc()
            abort_mpi_job(f"lightning_distgrad: RPC progress thread failed on rank "
                          f"{self.rank}; aborting the MPI job.\n")

    def _stopped(self) -> bool:
        return not (self._running or self._outbox or self._sends)

    def _progress_until(self, finished: Callable[[], bool]) -> None:
        """The polling loop of the progress thread (and of its stand-ins)."""
        backoff = _Backoff(self._bell, self._locked_progress_once,
                           IDLE_CAPS_ALL_RING if self._all_ring else IDLE_CAPS)
        me = threading.get_ident()
        try:
            self._poll_until(finished, backoff, me)
        finally:
            backoff.reset()

    def _poll_until(self, finished: Callable[[], bool], backoff: _Backoff, me: int) -> None:
        while not finished():
            if self._driver is not None:
                # The driver posts the outbox, fires timers and answers the doorbell;
                # it rings when it leaves something for us (see _driver_leaves).
                backoff.reset()
                self._sleepers.add(me)
                if self._driver is not None:
                    self._bell.wait(self._step_aside_s)
                self._sleepers.discard(me)
                continue
            if self._absence_armed:
                with self._driver_lock:
                    self._disarm_absence()
            progressed = self._locked_progress_once()
            now = time.monotonic()
            if progressed:
                self._last_activity = now
                backoff.reset()
            elif self.spin and not self._busy and (
                    self._incoming or self._sends or now - self._last_activity < HOT_WINDOW_S):
                # Hot: MPICH moves big messages only inside MPI calls, so a
                # transfer in flight is polled without sleeps.
                os.sched_yield()
            else:
                # Idle, or request handlers running: they need the CPU and the
                # GIL more than we do (a 50 us poll slowed a 16 ms torch.add by
                # 30%), so sleep longer and longer until traffic comes.
                self._sleepers.add(me)
                if not self._outbox and backoff.sleep(now - self._last_activity,
                                                      self._until_next_timer(now)):
                    self._last_activity = time.monotonic()
                    backoff.reset()
                self._sleepers.discard(me)

    def _locked_progress_once(self) -> bool:
        with self._mpi_lock:
            self._lock_owner = threading.get_ident()
            try:
                progressed = self._progress_once()
            finally:
                self._lock_owner = None
        if self._ready:
            self._deliver_ready()
            taken = self._handler
            if taken is not None and taken[0] == threading.get_ident():
                self._handler = None
                self._run_handler(taken[1])
        return progressed

    def _run_handler(self, handler: Callable[[], None]) -> None:
        """Run a request taken by :meth:`run_here` while another thread can poll."""
        me = threading.get_ident()
        driving = self._driver == me
        if driving:
            key = self._driver_key  # kept: keyed frames delivered meanwhile wait for us
            self._driver = None  # the progress thread polls meanwhile, once rung
            self._driver_leaves()
        else:
            self._handling = (time.monotonic(),)  # a fresh tuple: this run's token
        try:
            handler()
        except Exception:  # the handler's own failure: not the poller's
            traceback.print_exc()
        finally:
            if not driving:
                self._handling = None
                self._last_handler_end = time.monotonic()
            else:
                with self._driver_lock:  # a nested wait in the handler drove and left
                    if self._driver is None:
                        self._driver, self._driver_key = me, key
                        self._disarm_absence()

    def _stand_in_loop(self) -> None:
        """Poll in the progress thread's place while it runs a long handler.

        Checks every ``STAND_IN_CHECK_S`` while handlers run here, and every
        ``STAND_IN_IDLE_CHECK_S`` after a quiet spell (no CPU to speak of).
        """
        while self._running:
            quiet = time.monotonic() - self._last_handler_end > STAND_IN_QUIET_S
            self._stand_in_wake.acquire(
                timeout=STAND_IN_IDLE_CHECK_S if quiet else STAND_IN_CHECK_S)
            handling = self._handling
            if handling is not None and time.monotonic() - handling[0] >= STAND_IN_AFTER_S:
                self._progress_loop(lambda h=handling: self._handling is not h or not self._running)

    def _deliver_ready(self) -> None:
        """Hand over complete frames, outside the MPI lock, in arrival order.

        Fix (deadlock): frames used to be handed over under the MPI lock; a
        completion callback waiting there for an engine lock stopped all
        progress while the lock's holder waited to send. If another thread is
        delivering, it takes these items too (it re-checks before leaving).
        """
        ready = self._ready
        while ready and self._handler is None and self._deliver_lock.acquire(blocking=False):
            try:
                # Stops after a frame whose request this (progress) thread took.
                while ready and self._handler is None:
                    item = ready.popleft()
                    if callable(item):
                        item()
                    else:
                        self._deliver(*item)
            finally:
                self._deliver_lock.release()

    def _progress_once(self) -> bool:
        progressed = self._post_sends()
        progressed |= self._poll_frames()
        progressed |= self._test_requests()
        self._fire_timers()
        return progressed

    def _post_sends(self) -> bool:
        """Post queued frames; True if any (queued callables are not traffic)."""
        outbox = self._outbox
        posted = False
        while outbox:
            item = outbox.popleft()
            if callable(item):
                item()
            else:
                self._post(item)
                posted = True
        return posted

    def _post(self, item: tuple) -> None:
        dst, raw, buffers = item
        seq = self._send_seq[dst]
        self._send_seq[dst] = seq + 1
        tag = seq % self._tag_mod
        requests = [self.ctrl.Isend([raw, MPI.BYTE], dst, tag)]
        for t in buffers:
            view = tensor_bytes_view(t)
            for start in range(0, view.size, CHUNK_BYTES):
                chunk = view[start:start + CHUNK_BYTES]
                requests.append(self.data.Isend([chunk, MPI.BYTE], dst, tag))
        self._sends.append((requests, item))
        if dst == self.rank:
            self._kick()  # a frame to ourselves, from another thread of ours
        else:
            self._bell.ring(dst)

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
                # after: a frame that arrived during a nap only shows at the next
                # call, which came one nap later (1.9 instead of 0.65 ms to notice
                # a frame with 1 ms naps).
                probed_again = True
                continue
            progressed = True
            source, tag = status.Get_source(), status.Get_tag()
            raw = bytearray(status.Get_count(MPI.BYTE))
            message.Recv([raw, MPI.BYTE])
            frame = Frame.loads(raw)
            tensors = []
            requests = []
            for meta in frame.metas:
                t = allocate_tensor(meta, self._buffers)
                tensors.append(t)
                if meta[3] is None:  # not inline: the bytes follow on ``data``
                    view = tensor_bytes_view(t)
                    for start in range(0, view.size, CHUNK_BYTES):
                        chunk = view[start:start + CHUNK_BYTES]
                        requests.append(self.data.Irecv([chunk, MPI.BYTE], source, tag))
            if requests:
                self._incoming.append(_Incoming(source, frame, tensors, requests))
            else:
                self._ready.append((source, frame, tensors))

    def _test_requests(self) -> bool:
        progressed = False
        if self._sends:
            pending = [s for s in self._sends if not MPI.Request.Testall(s[0])]
            progressed = len(pending) != len(self._sends)
            self._sends = pending
        if self._incoming:
            still = []
            for item in self._incoming:
                if MPI.Request.Testall(item.requests):
                    self._ready.append((item.source, item.frame, item.tensors))
                    progressed = True
                else:
                    still.append(item)
            self._incoming = still
        return progressed

    def _deliver(self, source: int, frame: Frame, tensors: list) -> None:
        if any(meta[4] != "cpu" for meta in frame.metas):
            tensors = [to_target_device(t, m) for t, m in zip(tensors, frame.metas, strict=True)]
        self._on_frame(source, frame, tensors)

    def _add_timer(self, deadline: float, fn: Callable[[], None]) -> None:
        self._timer_seq += 1
        heapq.heappush(self._timers, (deadline, self._timer_seq, fn))

    def _until_next_timer(self, now: float) -> float:
        return max(0.0, self._timers[0][0] - now) if self._timers else float("inf")

    def _fire_timers(self) -> None:
        timers = self._timers
        while timers and timers[0][0] <= time.monotonic():
            heapq.heappop(timers)[2]()

    # -- collectives on ``coll`` (driven by the progress thread) -----------------

    def allreduce_sum(self, values: list[int]) -> list[int]:
        """Sum ``values`` over all ranks; blocks the caller, never the progress thread."""
        send = np.array(values, dtype=np.int64)
        recv = np.zeros_like(send)
        done = threading.Event()

        def poll(request: MPI.Request) -> None:
            if request.Test():
                done.set()
            else:
                self._add_timer(time.monotonic() + BACKOFF_MAX_S / 2, lambda: poll(request))

        self.call_soon(lambda: poll(self.coll.Iallreduce(send, recv, MPI.SUM)))
        done.wait()
        return recv.tolist()
