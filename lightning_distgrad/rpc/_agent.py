"""The RPC agent: calls and their responses, the routing of arriving frames to
the threads that handle them, one-way messages, timeouts.

Frames are routed by their :class:`~._wire.Kind`:

* REQUEST: ``(func, args, kwargs)``; the callee always answers with one
  RESPONSE (a result or a remote error). It runs on the worker pool; the
  agent's :class:`~._serving.Serving` runs and answers it.
* QUICK_REQUEST: a torch operator on small tensors; it cannot issue RPCs or
  block, so it runs right where its frame is handed over.
* RESPONSE: ``(ok, value)`` for one call id (no payload when the value is one
  plain tensor: the frame's only tensor); internal futures complete on the
  polling thread, user-visible ones on a callback thread.
* one-way kinds (:func:`register_one_way`): a typed body and tensors; nobody
  answers. Bookkeeping ones are applied on arrival, in order; served ones run
  like requests, on the thread that waits for them where there is one.

Every frame is counted when sent, when handed to the agent and when its handling
ended; a graceful shutdown ends after a round of FLUSH markers in which no rank
sent or handled anything and every rank is idle, so no request or response is
lost (see ``_shutdown``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from . import _devices, _hooks
from ._abort import abort_mpi_job
from ._calls import Deadlines, Pending, UserFuture, Waiter, future_done
from ._errors import rebuild_error, set_error, timeout_error
from ._one_way import HANDLERS
from ._peer_watch import PeerWatch, node_peers
from ._profiling import span_until
from ._remote_events import expect_remote_events, profiled_request_body
from ._serving import Serving
from ._sparse import tensor_nbytes
from ._transport import Transport
from ._wire import (
    CALL_KINDS,
    Frame,
    FrameLimits,
    Kind,
    MalformedFrame,
    NotSendable,
    decode_payload,
    encode_payload,
)
from ._worker_info import WorkerInfo

log = logging.getLogger("lightning_distgrad.rpc")

#: Operators whose tensors are all at most this big run as QUICK_REQUESTs.
QUICK_LIMIT_BYTES = 64 * 1024


class Agent:
    """One per process while RPC is initialised; owns the transport and the pools."""

    def __init__(
        self,
        comm,
        infos: list[WorkerInfo],
        rank: int,
        timeout: float,
        num_worker_threads: int,
        on_arrival: Callable[[int, Frame], None],
        limits: FrameLimits,
        cuda_ranks: frozenset[int] = frozenset(),
    ):
        self.comm = comm  # what the agent runs over: its ranks are the worker ids
        self.infos = infos
        self.info = infos[rank]
        self.by_name = {w.name: w for w in infos}
        self.timeout = timeout
        # device_maps[src][dst]: src's map for tensors it sends to dst (set by init_rpc).
        self.device_maps: list[list[dict]] = [[{} for _ in infos] for _ in infos]
        self._on_arrival = on_arrival
        self._ids = itertools.count()
        self._pending: dict[int, Pending] = {}
        # Termination detection (see ``_shutdown``): frames handed to this agent, frames
        # whose handling ended, FLUSH frames sent (not activity), and per rank the last
        # FLUSH round heard from it.
        self._arrived = 0
        self._processed = 0
        self._flushes_sent = 0
        self._flushed = [0] * len(infos)
        self._flushed_changed = threading.Condition()
        # Peers of this node that ended while they may have finished shutting down.
        self._peers_may_end = False
        self._ended: list[int] = []
        self._queued = 0  # requests waiting for a worker thread
        self._count_lock = threading.Lock()
        # Threads that wait for served one-way frames, by waiter key (see waiting_for).
        self._waiters: dict[Any, Waiter] = {}
        # Ranks that called graceful shutdown (JOIN frames received).
        self._joined: set[int] = set()
        self._joined_changed = threading.Condition()
        self._pool = ThreadPoolExecutor(num_worker_threads, thread_name_prefix="distgrad-worker")
        # User-visible futures complete here, so `then` callbacks never run on the
        # polling thread. More than one thread: a callback may wait for another
        # future of ours, whose completion must not queue behind it.
        self._callbacks = ThreadPoolExecutor(
            num_worker_threads, thread_name_prefix="distgrad-callbacks"
        )
        transfer_timeout = timeout if timeout > 0 else 600.0
        self.transport = Transport(
            comm,
            self._on_frame,
            self._on_unreadable,
            limits=limits,
            transfer_timeout=transfer_timeout,
            cuda_ranks=cuda_ranks,
        )
        self._peer_watch = PeerWatch(node_peers(comm), self._on_peer_lost)
        self._deadlines = Deadlines(self.transport, self._pending, self._expire_call)
        self.serving = Serving(
            infos,
            self.info,
            self.transport,
            devices=self._devices,
            send_one_way=self.send_one_way,
            count_processed=self._count_processed,
        )
        # Not started here: see :meth:`start`.

    def start(self) -> None:
        """Start receiving. Call once this agent is the current one: requests from
        faster peers may arrive at once, and they need it."""
        self.transport.start()
        self._peer_watch.start()

    def _on_peer_lost(self, rank: int) -> None:
        """A rank of this node ended: the job cannot go on without it. While a graceful
        shutdown's round that may be its last runs, the rank may have finished it: that
        round's outcome decides (see :meth:`peers_may_end`)."""
        with self._count_lock:
            if self._peers_may_end:
                self._ended.append(rank)
                return
        self._abort_lost(rank)

    def peers_may_end(self, may: bool) -> None:
        """True: peers that end from now on may have finished shutting down (this worker
        is in a drain round that may be the last). False: the round was not the last, so
        none may have; one that ended meanwhile aborts the job now."""
        with self._count_lock:
            self._peers_may_end = may
            ended, self._ended = self._ended, []
        if ended and not may:
            self._abort_lost(ended[0])

    def _abort_lost(self, rank: int) -> None:
        abort_mpi_job(
            f"lightning_distgrad: {self.infos[rank].name} (rank {rank}) ended without "
            f"shutting down RPC (killed, crashed or exited); {self.info.name} aborts the "
            "MPI job so that no rank waits for it.\n"
        )

    # -- sending ----------------------------------------------------------------

    def call(
        self,
        dst: WorkerInfo,
        func: Callable,
        args: tuple,
        kwargs: dict,
        timeout: float,
        *,
        user_visible: bool,
        force_autograd: bool,
        arrival_forks: list | None = None,
        operator: bool = False,
        profiled: str | None = None,
    ) -> torch.futures.Future:
        """Send a request; returns the future of its response.

        ``operator``: ``func`` is a torch operator (no RPCs, no blocking). ``profiled``:
        the call's profiling name while spans are recorded: the call is recorded under it
        until its response (see :meth:`_send_profiled`).
        """
        payload, tensors, pctx = self._encode((func, args, kwargs), dst, func)
        # Everything that may reject the call runs before the call is registered and
        # counted: a call registered but never sent would hold up graceful shutdown.
        devices = self._devices(tensors, dst.id)
        meta = _hooks.get().outgoing(dst.id, tensors, force_autograd)
        pctx.commit()
        future = UserFuture(self.transport) if user_visible else torch.futures.Future()
        call_id = next(self._ids)
        ctx_id = _hooks.get().current_context() if user_visible else None
        pending = Pending(future, dst, user_visible, ctx_id, timeout)
        self._pending[call_id] = pending
        if pending.deadline is not None:
            self._deadlines.watch(pending.deadline, call_id)
        forks = tuple(pctx.arrival_forks)
        if arrival_forks:
            forks += tuple(arrival_forks)
        quick = operator and all(tensor_nbytes(t) <= QUICK_LIMIT_BYTES for t in tensors)
        kind = Kind.QUICK_REQUEST if quick else Kind.REQUEST
        frame = Frame(kind, call_id, payload, (), meta, forks)
        if profiled is not None:
            return self._send_profiled(dst.id, frame, tensors, devices, future, profiled)
        self.transport.send(dst.id, frame, tensors, devices)
        return future

    def _send_profiled(
        self,
        dst_id: int,
        frame: Frame,
        tensors: list,
        devices: list[str] | None,
        future: torch.futures.Future,
        name: str,
    ) -> torch.futures.Future:
        """Send a call recorded under ``name``; returns the future to give its caller.

        When a profiler records this thread, the callee records the call too (a
        PROFILED_REQUEST) and the caller's profiler lists what it recorded.
        """
        # The span starts before the send, as torch's does: the callee's events, placed
        # between the send and the response, lie inside it.
        recorded = span_until(name, future)
        options = expect_remote_events(dst_id, frame.call_id, name, future)
        if options is not None:
            body = profiled_request_body(options, frame.body)
            frame = frame._replace(kind=Kind.PROFILED_REQUEST, body=body)
        self.transport.send(dst_id, frame, tensors, devices)
        return recorded

    def send_one_way(
        self,
        dst_id: int,
        kind: Kind,
        body: tuple,
        tensors: list[torch.Tensor] = (),
        devices: list[str] | None = None,
    ) -> None:
        """Send a one-way frame of a registered ``kind`` (see :func:`register_one_way`).

        For the library's own messages: ``body`` holds plain values (no tensors, no
        RRefs); ``tensors`` travel as the frame's tensor table, to ``devices`` on
        ``dst_id`` (default: by this worker's device map). Never recorded by distributed
        autograd.
        """
        tensors = list(tensors)
        if devices is None:
            devices = self._devices(tensors, dst_id)
        self.transport.send(dst_id, Frame(kind, -1, None, (), tuple(body)), tensors, devices)

    def _encode(self, obj: Any, dst: WorkerInfo, func: Any):
        try:
            return encode_payload(obj, dst.id)
        except Exception as e:
            if isinstance(e, NotSendable) or (
                isinstance(e, RuntimeError) and "rref" in str(e).lower()
            ):
                raise
            raise TypeError(
                f"Could not pickle the RPC to {dst.name} ({getattr(func, '__qualname__', func)}): "
                f"{e}. Arguments and results of RPCs must be picklable, and functions must be "
                "defined at module level (lambdas and local functions cannot be sent)."
            ) from e

    def _devices(self, tensors: list, dst_id: int, reply: bool = False) -> list[str] | None:
        """Each tensor's device on ``dst_id`` (None: all on the CPU); a reply maps its
        tensors with the inverse of the caller's device map."""
        if all(t.is_cpu for t in tensors):
            return None
        me = self.info.id
        device_map = (
            _devices.invert(self.device_maps[dst_id][me]) if reply else self.device_maps[me][dst_id]
        )
        return _devices.target_devices(tensors, device_map, self.info.name, self.infos[dst_id].name)

    def gradient_devices(self, tensors: list, dst_id: int) -> list[str] | None:
        """Each gradient's device on ``dst_id``, which sent the tensors they belong to (see
        ``_devices.gradient_devices``)."""
        me = self.info.id
        back = _devices.invert(self.device_maps[dst_id][me])
        return _devices.gradient_devices(tensors, back, self.device_maps[me][dst_id])

    def _count_processed(self) -> None:
        with self._count_lock:
            self._processed += 1

    def activity(self) -> int:
        """Frames sent (FLUSH markers aside) plus frames whose handling ended: unchanged
        over a shutdown round only if this worker did nothing in it (see ``_shutdown``)."""
        sent = self.transport.frames_sent()
        with self._count_lock:
            return sent - self._flushes_sent + self._processed

    def idle(self) -> bool:
        """No call of this worker waits for its response and every frame handed to it,
        even a malformed one, has been handled (a handler ends after what it sent)."""
        with self._count_lock:
            handling = self._arrived != self._processed
        return not (handling or self._pending or self.transport.has_queued())

    def _expire_call(self, call_id: int) -> None:
        pending = self._pending.pop(call_id, None)
        if pending is not None:
            self._complete(pending, False, timeout_error(pending.timeout, pending.dst))

    # -- receiving (the polling thread) ---------------------------------------------

    def _on_frame(self, source: int, frame: Frame, tensors: list) -> None:
        if frame.kind is Kind.FLUSH:
            self._on_flush(source, frame, tensors)
            return
        with self._count_lock:
            self._arrived += 1
        if frame.forks:
            self._on_arrival(source, frame)
        kind = frame.kind
        if kind is Kind.RESPONSE:
            self._on_response(source, frame, tensors)
        elif kind is Kind.REQUEST:
            self._submit(lambda: self.serving.run_request(source, frame, tensors))
        elif kind is Kind.JOIN:
            with self._joined_changed:
                self._joined.add(source)
                self._joined_changed.notify_all()
            self._count_processed()
        elif kind is Kind.QUICK_REQUEST:
            if frame.body is None:
                self.serving.run_operator(source, frame, tensors)
            else:
                self.serving.run_request(source, frame, tensors)
        elif kind is Kind.PROFILED_REQUEST:
            self._submit(lambda: self.serving.run_request(source, frame, tensors, profiled=True))
        else:
            self._on_one_way(source, frame, tensors)

    def _on_one_way(self, source: int, frame: Frame, tensors: list) -> None:
        spec = HANDLERS.get(frame.kind)
        try:
            if spec is None:
                raise MalformedFrame(f"no handler for frame kind {frame.kind.name}")
            try:
                body = spec.body_type._make(frame.body)
            except TypeError as e:
                raise MalformedFrame(f"bad {frame.kind.name} body: {e}") from None
        except MalformedFrame as e:
            e.source = source
            self._on_malformed(source, e)
            return
        if not spec.serve:
            try:
                spec.handler(source, body, tensors)
            finally:
                self._count_processed()
            return
        run = functools.partial(self._serve_one_way, spec.handler, source, body, tensors)
        me = threading.get_ident()
        waiter = self._waiters.get(spec.waiter_key(body)) if spec.waiter_key is not None else None
        if waiter is None:
            if self.transport.is_progress_thread(me):
                run()
            else:
                self._submit(run)
        elif waiter.ident == me:
            run()
        else:
            waiter.hand_over(run)  # it runs while that thread waits (or as it stops)

    def _serve_one_way(self, handler: Callable, source: int, body: Any, tensors: list) -> None:
        # Outside any context and with grad on: it may run on a user's thread.
        try:
            _hooks.get().call_in(None, _hooks.with_grad, handler, source, body, tensors)
        finally:
            self._count_processed()

    def _submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the worker pool (it may block or run long)."""
        self.transport.busy(+1)
        with self._count_lock:
            self._queued += 1

        def run() -> None:
            with self._count_lock:
                self._queued -= 1
            try:
                fn()
            except Exception:
                log.exception("lightning_distgrad: a request handler failed on %s", self.info)
            finally:
                self.transport.busy(-1)

        self._pool.submit(run)

    def _on_unreadable(self, source: int, error: MalformedFrame) -> None:
        """A frame the transport could not read, handed over in its place in the order."""
        with self._count_lock:
            self._arrived += 1
        self._on_malformed(source, error)

    def _on_malformed(self, source: int, error: MalformedFrame) -> None:
        """A frame this worker cannot read: answer its call when it has one, else log."""
        frame = error.frame
        sender = self.infos[source].name if 0 <= source < len(self.infos) else "?"
        if frame is not None and frame.kind in CALL_KINDS and frame.call_id >= 0:
            self.serving.reply_error(
                source,
                frame.call_id,
                RuntimeError(
                    f"{self.info.name} could not read this request from {sender}: {error}"
                ),
            )
            return  # counted by the reply
        try:
            pending = (
                self._pending.pop(frame.call_id, None)
                if frame is not None and frame.kind is Kind.RESPONSE
                else None
            )
            if pending is not None:
                self._complete(
                    pending,
                    False,
                    RuntimeError(f"the response from {sender} could not be read: {error}"),
                )
            else:
                log.error(
                    "lightning_distgrad: %s dropped a malformed frame from rank %d (%s): %s",
                    self.info.name,
                    source,
                    sender,
                    error,
                )
        finally:
            self._count_processed()

    def _on_response(self, source: int, frame: Frame, tensors: list) -> None:
        try:
            self._take_response(source, frame, tensors)
        finally:
            self._count_processed()

    def _take_response(self, source: int, frame: Frame, tensors: list) -> None:
        pending = self._pending.pop(frame.call_id, None)
        if pending is None:
            return  # the call timed out; its late answer is dropped
        try:
            if frame.body is not None:
                tensors = _hooks.get().incoming(frame.body, source, tensors)
            if frame.payload is None:  # the result is the frame's one tensor
                if len(tensors) != 1:
                    raise RuntimeError(
                        f"a tensor response from rank {source} carried {len(tensors)} tensors"
                    )
                ok, value = True, tensors[0]
            else:
                ok, value = decode_payload(frame.payload, tensors)
                if not ok:
                    value = rebuild_error(*value)
        except Exception as e:
            # No traceback: it references this frame, which holds the future.
            ok, value = False, e.with_traceback(None)
        self._complete(pending, ok, value)

    def _complete(self, pending: Pending, ok: bool, value: Any) -> None:
        future = pending.future
        setter = future.set_result if ok else functools.partial(set_error, future)
        if not pending.user_visible:
            setter(value)
            return
        # ``then`` callbacks run in the caller's autograd context, as if on its thread:
        # an RPC they make (an async UDF's continuation) stays recorded. They run on
        # a callback thread, unless the thread waiting in ``wait()`` got the response.
        complete = functools.partial(_hooks.get().call_in, pending.ctx_id, setter, value)
        if future.waiter == threading.get_ident():
            future.completion = complete  # applied once that thread stopped polling
        else:
            self._callbacks.submit(complete)

    # -- waiting --------------------------------------------------------------------

    def wait(self, future: torch.futures.Future) -> Any:
        """Wait for ``future``, polling MPI on this thread meanwhile."""
        if not future.done():
            self.transport.drive_until(functools.partial(future_done, future))
        return future.wait()

    @contextlib.contextmanager
    def waiting_for(self, key: Any) -> Iterator[None]:
        """Served one-way frames whose waiter key is ``key`` run on this thread from now
        on: while it waits in :meth:`wait_done`, and those that come before or between
        its waits are kept for it. Enter it before sending what they answer."""
        waiter = self._waiters[key] = Waiter(threading.get_ident())
        try:
            yield
        finally:
            self._waiters.pop(key, None)
            waiter.run_handed_over()  # handed over before it stopped: its work all the same

    def wait_done(self, future: torch.futures.Future, timeout: float, key: Any = None) -> bool:
        """Wait at most ``timeout`` s (<= 0: no limit) for ``future``; True if it is done.

        Served one-way frames for ``key`` (see :meth:`waiting_for`) run on this thread
        meanwhile: they are the work it waits for.
        """
        if key is not None and key not in self._waiters:
            with self.waiting_for(key):
                return self.wait_done(future, timeout, key)
        waiter = self._waiters.get(key) if key is not None else None
        if waiter is None or waiter.ident != threading.get_ident():
            waiter = Waiter(threading.get_ident())  # nothing is handed to this one
        deadline = time.monotonic() + timeout if timeout > 0 else float("inf")

        def done() -> bool:
            waiter.run_handed_over()
            return future.done() or time.monotonic() >= deadline

        if not future.done() and not self.transport.drive_until(done):  # another polls
            future.add_done_callback(lambda _: waiter.wake())
            while not done():
                waiter.sleep(deadline - time.monotonic())
        return future.done()

    def num_pending(self) -> int:
        return len(self._pending)

    def debug_info(self) -> dict[str, Any]:
        """Pending calls, request handlers, and per-peer traffic (see ``rpc._get_debug_info``)."""
        peers = {
            info.name: counts
            for info, counts in zip(self.infos, self.transport.traffic(), strict=True)
        }
        return {
            "num_pending_requests": len(self._pending),
            "num_handlers_running": self.transport.handlers_running() - self._queued,
            "handler_queue_depth": self._queued,
            "peers": peers,
        }

    # -- shutdown -------------------------------------------------------------------

    def join(self) -> None:
        """Tell every other worker that this one called graceful shutdown."""
        for info in self.infos:
            if info.id != self.info.id:
                self.transport.send(info.id, Frame(Kind.JOIN, -1, None), [])

    def flush(self, round_: int) -> None:
        """Send FLUSH(``round_``) to every worker, this one included, after everything
        this worker sent them before."""
        with self._count_lock:
            self._flushes_sent += len(self.infos)
        for info in self.infos:
            self.transport.send(info.id, Frame(Kind.FLUSH, -1, None, (), (round_,)), [])

    def not_flushed(self, round_: int, wait: float = 0.0) -> list[int]:
        """The ranks whose FLUSH(``round_``) has not arrived yet, after waiting up to
        ``wait`` s for that list to change."""
        ranks = range(len(self.infos))
        return _still_missing(
            self._flushed_changed, ranks, lambda r: self._flushed[r] < round_, wait
        )

    def _on_flush(self, source: int, frame: Frame, tensors: list) -> None:
        """Each worker's FLUSH rounds arrive in order, one after the other; any other
        FLUSH frame was not sent by an agent, and is dropped as malformed."""
        expected = self._flushed[source] + 1
        body = frame.body
        is_next = type(body) is tuple and len(body) == 1 and type(body[0]) is int
        if not is_next or body[0] != expected or tensors or frame.forks or frame.payload:
            error = MalformedFrame(f"a FLUSH frame other than round {expected}", frame)
            error.source = source
            self._on_unreadable(source, error)
            return
        with self._flushed_changed:
            self._flushed[source] = expected
            self._flushed_changed.notify_all()

    def not_joined(self, wait: float = 0.0) -> list[int]:
        """The other ranks that have not joined yet, after waiting up to ``wait`` s for
        that list to change."""
        others = [i.id for i in self.infos if i.id != self.info.id]
        return _still_missing(self._joined_changed, others, lambda r: r not in self._joined, wait)

    def stop(self, wait: bool = True, flush_timeout: float = 5.0, drained: bool = False) -> None:
        """Stop threads and free communicators; ``wait``: for running handlers too;
        ``drained``: every rank's frames were all handled (a graceful shutdown), so
        nothing can still arrive on the communicators (see ``Transport.free``)."""
        self._peer_watch.close()  # peers may end from now on
        self._pool.shutdown(wait=wait, cancel_futures=True)
        self._callbacks.shutdown(wait=wait, cancel_futures=True)
        self.transport.stop(flush_timeout)
        self.transport.free(drained)
        for pending in list(self._pending.values()):
            set_error(pending.future, RuntimeError("RPC agent shut down before a response"))
        self._pending.clear()


def _still_missing(
    changed: threading.Condition, ranks: Iterable[int], missing: Callable[[int], bool], wait: float
) -> list[int]:
    """The ``ranks`` still ``missing``, after waiting up to ``wait`` s for ``changed``
    (notified, under its lock, whenever what ``missing`` reads changes)."""
    with changed:
        left = [r for r in ranks if missing(r)]
        if left and wait > 0:
            changed.wait(wait)
            left = [r for r in left if missing(r)]
        return left
