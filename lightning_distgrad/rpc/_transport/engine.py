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
the same node end the nap with the doorbell (see ``doorbell``). Where every peer
can ring it, and this process rings it for every send it posts meanwhile, the
naps of a quiet spell grow long: an idle agent wakes a few times a second.
Right after traffic a poller expects more, so it does not nap yet: where every
rank has a core it spins (``HOT_S``), and where ranks outnumber cores it yields
its core between polls (``YIELD_S``), to any rank that needs it.

Nothing a peer sends can stop progress: a frame that fails to decode or
validate goes to ``on_malformed``, an error raised while handling a frame is
logged, and tensor bytes that never arrive are abandoned at the transfer
deadline.

The sending side (``sending``) and the receiving side (``receiving``) keep
their own state, under the same lock. Big tensors to a peer on this node are
written by the sender into the receiver's buffer (see ``direct_writes``); the
polling thread makes those writes outside the lock.

The communicators are private duplicates of the user's (see ``communicators``).
"""

from __future__ import annotations

import collections
import enum
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable

import numpy as np
import torch
from mpi4py import MPI

from ..._backoff import NAP_MAX_S, wait_collective
from . import sparse
from .communicators import Communicators
from .direct_writes import PushSend
from .doorbell import ArmedBackoff, node_doorbell
from .fail_stop import abort_mpi_job
from .frames import Frame, FrameLimits, MalformedFrame
from .progress import Poller, ProgressRole, default_modes, in_default_modes
from .receiving import Receiver
from .sending import Sender
from .timers import Timers

log = logging.getLogger("lightning_distgrad.rpc")

# After traffic, poll without napping this long (only where every rank has a core).
HOT_S = 0.002
# Where ranks outnumber cores, a poller yields its core between polls this long after
# traffic (a waiter: after it began to wait) before it naps: longer than a small request's
# round trip there. A vCPU that halts in a nap is slow to come back (a 15 us nap took 87 us on a
# 2-core VM, and the Python after it ran about twice as slow), while a yield hands the core
# to any rank that can run and costs nothing when none can.
YIELD_S = 0.0005
# A yield that returns later than this ran another thread meanwhile: every core is in
# demand, so a waiter naps from then on (it is rung when its answer comes) rather than
# take turns on a core with the rank that must answer it.
GAVE_CORE_AWAY_S = 2e-5
# A transfer in flight keeps the poller hot this long after the last completion
# (MPICH moves big messages only inside MPI calls); past it, naps resume.
TRANSFER_HOT_S = 1.0
# A quiet spell: this long without traffic. Naps grow past NAP_MAX_S only after one.
QUIET_S = 0.1
# An idle poller's longest nap, after a quiet spell, where a peer cannot ring its doorbell
# (on another node): such a peer's frames wait for the next poll.
QUIET_NAP_S = 0.004
# Its longest nap where every peer rings it (all on this node) and no transfer needs MPI
# to progress: frames, this process's own sends and calls, and timers all cut it short.
RUNG_QUIET_NAP_S = 0.05
# While a waiter polls, the progress thread sleeps this long between checks (it is rung
# when it has something to do; a wake-up takes the GIL from the waiter).
STEPPED_ASIDE_NAP_S = 0.02


class State(enum.Enum):
    RUNNING = "running"
    STOPPING = "stopping"  # flushing queued sends, then the progress thread exits
    STOPPED = "stopped"


class Transport:
    """Moves frames and tensors between ranks of ``comm``.

    ``on_frame(source, frame, tensors)`` runs for every complete incoming
    message, in arrival order, on the polling thread, outside the lock.
    ``on_malformed(source, error)`` runs for a frame that could not be read
    (``error.frame`` is its header when that decoded). ``transfer_timeout``
    bounds how long tensor bytes may take to arrive after their frame. ``cuda_ranks``
    (the same on every rank): the ranks that send or receive CUDA tensors, which probe
    CUDA IPC with each other (see ``cuda``).
    """

    def __init__(
        self,
        comm: MPI.Comm,
        on_frame: Callable[[int, Frame, list], None],
        on_malformed: Callable[[int, MalformedFrame], None],
        *,
        limits: FrameLimits,
        transfer_timeout: float,
        cuda_ranks: frozenset[int] = frozenset(),
    ):
        if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            raise RuntimeError(
                "lightning_distgrad needs MPI initialised with MPI_THREAD_SERIALIZED or "
                f"higher (got level {MPI.Query_thread()}); do not lower "
                "mpi4py.rc.thread_level (its default, 'multiple', works)"
            )
        self.comms = comms = Communicators(comm)
        self.rank = comm.Get_rank()
        self._bell, oversubscribed = node_doorbell(comm, self.rank)
        # Spinning only pays where every rank of the node has a core of its own.
        self.spin = not oversubscribed
        self._rung_by_every_peer = self._bell.node_peers == comm.Get_size() - 1
        self._on_frame = on_frame
        self._on_malformed = on_malformed
        self._receiver = Receiver(
            comms.ctrl, comms.data, comms.push, limits, transfer_timeout, comms.tag_mod
        )
        self._sender = Sender(
            comms.ctrl, comms.data, comms.push, transfer_timeout, comms.tag_mod, cuda_ranks
        )
        # Everything below is guarded by _lock.
        self._lock = threading.Lock()
        self._state = State.RUNNING
        self._poller = Poller.PROGRESS_THREAD
        # The progress thread sleeps while a waiter polls: when the waiter leaves, the
        # bell is armed so that peers ring it for the next frame (see _hand_back).
        self._armed_for_hand_back = False
        # The progress thread takes (or is about to take) a RUNG_QUIET_NAP_S nap: a send
        # posted meanwhile rings it, for MPI to progress the send (see send_raw).
        self._napping_long = False
        self._handlers_running = 0
        self._ready: collections.deque = collections.deque()  # frames and deferred calls
        self._delivering = 0  # items taken from _ready whose run has not returned
        self._deliverer: int | None = None  # ident of the thread handling _ready's items
        # Calls queued without the lock (call_soon); a deque's append is atomic.
        self._soon: collections.deque = collections.deque()
        self._timers = Timers()
        self._last_traffic = time.monotonic()
        self._stop_deadline = float("inf")
        self._role = ProgressRole(self._lock, self._poll_loop, self._on_handoff, self._failed)

    def start(self) -> None:
        """Start the progress thread (once the owner is ready for ``on_frame``)."""
        self._role.start()

    # -- called from any thread -------------------------------------------------

    def send(
        self, dst: int, frame: Frame, tensors: list[torch.Tensor], devices: list[str] | None = None
    ) -> None:
        """Send ``frame`` (whose ``metas`` get filled here) and its tensors to ``dst``.

        ``devices`` gives each tensor's device on the receiver; None: every tensor is a CPU
        tensor and lands on the CPU. Sparse tensors travel as their dense components (see
        ``sparse``).
        """
        if any(t.layout is not torch.strided for t in tensors):
            tensors, devices, entries = sparse.flatten(tensors, devices)
            frame = frame._replace(sparse=entries)
        raw, buffers, pushed = self._sender.split(dst, frame, tensors, devices, self._receiver.owns)
        self.send_raw(dst, raw, buffers, frame.kind.name, pushed)

    def send_raw(
        self,
        dst: int,
        raw: bytes,
        buffers: list[torch.Tensor] = (),
        kind: str = "raw",
        pushed: list[torch.Tensor] = (),
    ) -> None:
        """Post encoded frame bytes, then each buffer's bytes, to ``dst`` (in order);
        ``pushed`` tensors are written into the receiver's buffers once it says where."""
        with self._lock:
            self._sender.post(dst, raw, buffers, kind, pushed)
            wake_own_poller = dst == self.rank or self._napping_long
        if wake_own_poller:
            self._bell.ring_self()
        if dst != self.rank:
            self._bell.ring(dst)

    def drive_until(self, done: Callable[[], bool]) -> bool:
        """Poll on this thread until ``done()``; False at once if another thread waits
        here already (then wait for the result some other way)."""
        with self._lock:
            if self._poller is Poller.WAITER or self._state is not State.RUNNING:
                return False
            self._poller = Poller.WAITER
            self._napping_long = False
            self._disarm_hand_back()
        if not in_default_modes():
            # Frames handled here (requests, received tensors, recorded autograd) belong
            # to other threads and ranks: not to this caller's no_grad or autocast.
            with default_modes():
                self._drive(done)
        else:
            self._drive(done)
        return True

    def frames_sent(self) -> int:
        with self._lock:
            return self._sender.frames_sent

    def frame_counts(self) -> tuple[int, int, bool]:
        """(frames sent, frames received in their pair's sequence (see ``receiving``),
        whether a received frame is not yet handed over or its handler has not returned)."""
        with self._lock:
            receiving = bool(self._receiver.incoming or self._ready or self._delivering)
            return self._sender.frames_sent, self._receiver.in_sequence, receiving

    def traffic(self) -> list[dict[str, int]]:
        """Per peer rank: frames and bytes sent to it and received from it so far, whether
        big tensors to it are written into its buffers (see ``direct_writes``), and whether CUDA
        tensors to it travel over CUDA IPC (else staged through host memory, see ``cuda``)."""
        with self._lock:
            return [
                {
                    "messages_sent": s[0],
                    "bytes_sent": s[1],
                    "messages_received": r[0],
                    "bytes_received": r[1],
                    "writes_directly": rank in self._sender.push_pids,
                    "cuda_ipc": rank in self._sender.ipc_peers,
                }
                for rank, (s, r) in enumerate(
                    zip(self._sender.sent_to, self._receiver.received_from, strict=True)
                )
            ]

    def is_progress_thread(self, ident: int) -> bool:
        """Whether thread ``ident`` holds the progress role (see ``progress``)."""
        return ident == self._role.holder

    def progress_handoffs(self) -> int:
        """How often the progress role moved to another thread (see ``progress``)."""
        return self._role.handoffs

    def begin_inline(self) -> bool:
        """True if this thread may run the handler it delivers right here: it is the progress
        thread, polling, not in such a run already. Then :meth:`end_inline` must follow; if
        the run is to wait for anything, :meth:`step_out` first."""
        return self._poller is Poller.PROGRESS_THREAD and self._role.begin_inline()

    def end_inline(self) -> bool:
        """The run begun by :meth:`begin_inline` ended; False if it lost the progress role
        meanwhile (it waited, or ran so long that the standby took over)."""
        return self._role.end_inline()

    def step_out(self) -> bool:
        """Before a run begun by :meth:`begin_inline` waits: another thread polls from now
        on, and this one finishes the run as a worker. False if this thread is in no such
        run."""
        return self._role.step_out()

    def handlers_running(self) -> int:
        with self._lock:
            return self._handlers_running

    def busy(self, delta: int) -> None:
        """Count running request handlers: the poller naps rather than spins meanwhile."""
        with self._lock:
            self._handlers_running += delta

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the polling thread, outside the lock, after ``delay`` s."""
        with self._lock:
            earliest = self._timers.add(time.monotonic() + delay, fn)
            # A napping progress thread must wake for a timer earlier than its nap's end;
            # a waiter that polls fires timers itself.
            ring = earliest and self._poller is Poller.PROGRESS_THREAD
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

    def allreduce_sum(
        self, values: list[int], timeout: float | None = None, waiting: Callable | None = None
    ) -> list[int] | None:
        """Sum ``values`` over all ranks; None if that took longer than ``timeout`` s.

        Blocks the caller, never the poller. A timed-out collective stays posted
        (MPI cannot cancel one): use ``coll`` for nothing else afterwards. ``waiting()``
        runs between tests while it waits.
        """
        send = np.array(values, dtype=np.int64)
        recv = np.zeros_like(send)
        with self._lock:
            request = self.comms.coll.Iallreduce(send, recv, MPI.SUM)
        return recv.tolist() if self._wait_collective(request, timeout, waiting) else None

    def barrier(self, timeout: float | None = None, waiting: Callable | None = None) -> bool:
        """Wait until every rank entered this barrier (an ``Ibarrier`` on ``coll``); False
        if that took longer than ``timeout`` s (see :meth:`allreduce_sum`)."""
        with self._lock:
            request = self.comms.coll.Ibarrier()
        return self._wait_collective(request, timeout, waiting)

    def _wait_collective(
        self, request: MPI.Request, timeout: float | None, waiting: Callable | None
    ) -> bool:
        def finished() -> bool:
            with self._lock:
                if request.Test():
                    return True
            if waiting is not None:
                waiting()
            return False

        return wait_collective(finished, timeout)

    def stop(self, flush_timeout: float = 5.0) -> None:
        """Stop the progress thread once queued sends completed (or ``flush_timeout``
        passed: a peer that stopped receiving cannot hold this rank forever)."""
        with self._lock:
            self._state = State.STOPPING
            self._stop_deadline = time.monotonic() + flush_timeout
        self._bell.ring_self()
        self._role.join()

    def free(self, drained: bool = True) -> None:
        """Release the communicators (see ``Communicators.free``) and the doorbell."""
        self.comms.free(drained)
        self._bell.close()

    # -- polling ----------------------------------------------------------------

    def _failed(self, error: BaseException) -> None:
        # Only a fault of MPI or of this module gets here (frames' own errors are
        # caught): a dead poller would leave every rank waiting, so fail-stop.
        traceback.print_exception(error)
        abort_mpi_job(
            f"lightning_distgrad: RPC progress thread failed on rank "
            f"{self.rank}; aborting the MPI job.\n"
        )

    def _on_handoff(self) -> None:
        """Under the lock: the progress role moved, and the delivery turn with it."""
        self._deliverer = None

    def _poll_loop(self) -> None:
        """The progress thread's loop: until the transport stops, or this thread no longer
        holds the progress role."""
        me = threading.get_ident()
        backoff = ArmedBackoff(self._bell, self._poll_and_run)
        while True:
            with self._lock:
                if self._role.holder != me:
                    break
                if self._state is State.STOPPING and (
                    not self._sender.sends or time.monotonic() > self._stop_deadline
                ):
                    self._state = State.STOPPED
                    self._role.mark_stopped()
                    break
                self._napping_long = False
                stepped_aside = self._poller is Poller.WAITER
                if not stepped_aside:
                    self._disarm_hand_back()
            if stepped_aside:
                # The waiter polls, fires timers and answers rings; it arms our bell
                # and rings it when it leaves (see _hand_back).
                backoff.reset()
                self._bell.wait(STEPPED_ASIDE_NAP_S)
                continue
            self._poll_step(backoff)
        backoff.reset()

    def _drive(self, done: Callable[[], bool]) -> None:
        backoff = None if self.spin else ArmedBackoff(self._bell, self._poll_and_run)
        naps_from = time.monotonic() + YIELD_S
        try:
            while not done():
                progressed = self._poll_and_run()
                if progressed:  # done() may be true now: check before yielding
                    if backoff is not None:
                        backoff.reset()
                        naps_from = time.monotonic() + YIELD_S
                elif backoff is None:
                    os.sched_yield()
                elif (now := time.monotonic()) < naps_from:
                    os.sched_yield()
                    if time.monotonic() - now > GAVE_CORE_AWAY_S:
                        naps_from = now
                else:
                    with self._lock:
                        limit = self._timers.until_next(time.monotonic())
                    if backoff.sleep(limit, NAP_MAX_S):
                        backoff.reset()
        finally:
            if backoff is not None:
                backoff.reset()
            self._hand_back()

    def _hand_back(self) -> None:
        """The waiter leaves: the progress thread polls again. Its bell is armed so that
        peers ring it, and rung now only if work is waiting (waking it for nothing, once
        per call, costs more than it saves)."""
        with self._lock:
            self._poller = Poller.PROGRESS_THREAD
            if not self._armed_for_hand_back:
                self._armed_for_hand_back = True
                self._bell.arm()
            pending = bool(
                self._sender.sends
                or self._receiver.incoming
                or self._ready
                or self._soon
                or self._timers.due(time.monotonic())
                or self._receiver.frame_waiting()
            )
        if pending:
            self._bell.ring_self()

    def _disarm_hand_back(self) -> None:
        """Under the lock: someone polls again, so peers need not ring for it."""
        if self._armed_for_hand_back:
            self._armed_for_hand_back = False
            self._bell.disarm()

    def _poll_step(self, backoff: ArmedBackoff) -> None:
        """One step of the progress thread: poll, then spin or nap if nothing came."""
        if self._poll_and_run():
            backoff.reset()
            return
        now = time.monotonic()
        with self._lock:
            idle_for = now - self._last_traffic
            in_flight = self._sender.sends or self._receiver.incoming
            if self._handlers_running:
                hot = False
            elif self.spin:
                hot = idle_for < HOT_S or bool(in_flight and idle_for < TRANSFER_HOT_S)
            else:
                hot = idle_for < YIELD_S
            quiet = not hot and idle_for > QUIET_S
            self._napping_long = (
                quiet
                and not in_flight
                and self._rung_by_every_peer
                and self._poller is Poller.PROGRESS_THREAD
            )
            if self._napping_long:
                cap = RUNG_QUIET_NAP_S
            else:
                cap = QUIET_NAP_S if quiet else NAP_MAX_S
            limit = self._timers.until_next(now)
        if hot:
            os.sched_yield()
        elif backoff.sleep(limit, cap):
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
            try:
                fn = soon.popleft()
            except IndexError:  # another poller took the last one
                break
            self._run(fn)
        with self._lock:
            progressed = self._receiver.poll(self._ready)
            progressed = self._sender.poll() | progressed
            now = time.monotonic()
            if progressed:
                self._last_traffic = now
            self._ready.extend(self._timers.take_due(now))
            writes = self._sender.take_writes()
            answered = self._receiver.answered
            if answered:
                self._receiver.answered = []
            turn = None
            if self._ready and self._deliverer in (None, me):
                outer = self._deliverer is None
                self._deliverer = me
                turn = self._role.handoffs
        for peer in answered:
            self._bell.ring(peer)  # it waits for our clear-to-send
        if writes:
            self._write(writes)
        while turn is not None:
            with self._lock:
                # The progress role moved away from a run of this thread: the turn went
                # with it, and the remaining items to the new holder.
                if self._role.handoffs != turn:
                    break
                if not self._ready:
                    if outer:
                        self._deliverer = None
                    break
                item = self._ready.popleft()
                self._delivering += 1
            try:
                self._run_item(item)
            finally:
                with self._lock:
                    self._delivering -= 1
        return progressed

    def _write(self, pushes: list[PushSend]) -> None:
        """Write cleared pushes into their receivers' buffers, then send their DONEs."""
        for push in pushes:
            outcome = push.write()
            with self._lock:
                push.finish(outcome)
            self._bell.ring(push.dst)
        with self._lock:
            self._last_traffic = time.monotonic()

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
            log.error(
                "lightning_distgrad: a message handler failed on rank %d:\n%s",
                self.rank,
                traceback.format_exc(),
            )

    def _deliver(self, source: int, frame: Frame, tensors: list) -> None:
        if frame.sparse:
            try:
                tensors = sparse.unflatten(tensors, frame.sparse)
            except (RuntimeError, ValueError) as e:
                reason = f"a sparse tensor breaks its layout's invariants: {e}"
                error = MalformedFrame(reason, frame)
                error.source = source
                self._on_malformed(source, error)
                return
        self._on_frame(source, frame, tensors)
