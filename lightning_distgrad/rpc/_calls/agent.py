"""The RPC agent: calls and their responses, the routing of arriving frames to
the threads that handle them, one-way messages, timeouts.

Frames are routed by their ``Kind`` (see ``_transport.frames``):

* REQUEST: ``(func, args, kwargs)``; the callee always answers with one
  RESPONSE (a result or a remote error). The agent's :class:`~.serving.Serving`
  runs and answers it: on the progress thread that delivers it when its function
  runs short without waiting, else on the worker pool.
* QUICK_REQUEST: a torch operator on small tensors; it cannot issue RPCs or
  block, so it runs right where its frame is handed over.
* RESPONSE: ``(ok, value)`` for one call id (no payload when the value is one
  plain tensor: the frame's only tensor); internal futures complete on the
  polling thread, user-visible ones on a callback thread.
* one-way kinds (``one_way.register_one_way``): a typed body and tensors; nobody
  answers. Bookkeeping ones are applied on arrival, in order; served ones run
  like requests, on the thread that waits for them where there is one.

Every frame is counted when sent, when received, when handed to the agent and when its
handling ended; a graceful shutdown ends once the job's totals show every frame sent
handled and every rank idle, so no request or response is lost (see
``graceful_shutdown``). Threads wait for the agent's futures by
driving its progress themselves (see ``waiting``).
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .._transport import (
    CALL_KINDS,
    Frame,
    FrameLimits,
    Kind,
    MalformedFrame,
    PeerWatch,
    Transport,
    node_peers,
    tensor_nbytes,
)
from . import autograd_hooks, devices
from .errors import rebuild_error, set_error, timeout_error
from .graceful_shutdown import Termination
from .one_way import HANDLERS
from .payload import NotSendable, decode_payload, encode_payload
from .pending import Deadlines, Pending
from .remote_events import expect_remote_events, profiled_request_body
from .serving import Serving
from .spans import span_until
from .waiting import UserFuture, Waiting
from .worker_info import WorkerInfo

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
        # device_maps[src, dst]: src's map for tensors it sends to dst, for the pairs with
        # this worker on one side that have one (set by init_rpc): no n x n table.
        self.device_maps: dict[tuple[int, int], dict] = {}
        self._on_arrival = on_arrival
        self._ids = itertools.count()
        self._pending: dict[int, Pending] = {}
        self._queued = 0  # requests waiting for a worker thread
        self._queued_lock = threading.Lock()
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
        self.waiting = Waiting(self.transport)
        self.termination = Termination(infos, rank, self.transport, self._pending)
        self._peer_watch = PeerWatch(node_peers(comm), self.termination.on_peer_lost)
        self._deadlines = Deadlines(self.transport, self._pending, self._expire_call)
        self.serving = Serving(
            infos,
            self.info,
            self.transport,
            devices=self._devices,
            send_one_way=self.send_one_way,
            count_processed=self.termination.processed,
            wait=lambda future: self.waiting.wait(future, self.timeout),
        )
        # Not started here: see :meth:`start`.

    def start(self) -> None:
        """Start receiving. Call once this agent is the current one: requests from
        faster peers may arrive at once, and they need it."""
        self.transport.start()
        self._peer_watch.start()

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
        meta = autograd_hooks.get().outgoing(dst.id, tensors, force_autograd, operator=operator)
        pctx.commit()
        future = UserFuture(self.waiting) if user_visible else torch.futures.Future()
        call_id = next(self._ids)
        ctx_id = autograd_hooks.get().current_context() if user_visible else None
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
            devices.invert(self._device_map(dst_id, me)) if reply else self._device_map(me, dst_id)
        )
        return devices.target_devices(tensors, device_map, self.info.name, self.infos[dst_id].name)

    def gradient_devices(self, tensors: list, dst_id: int) -> list[str] | None:
        """Each gradient's device on ``dst_id``, which sent the tensors they belong to (see
        ``devices.gradient_devices``)."""
        me = self.info.id
        back = devices.invert(self._device_map(dst_id, me))
        return devices.gradient_devices(tensors, back, self._device_map(me, dst_id))

    def _device_map(self, src: int, dst: int) -> dict:
        return self.device_maps.get((src, dst), {})

    def _expire_call(self, call_id: int) -> None:
        pending = self._pending.pop(call_id, None)
        if pending is not None:
            self._complete(pending, False, timeout_error(pending.timeout, pending.dst))

    # -- receiving (the polling thread) ---------------------------------------------

    def _on_frame(self, source: int, frame: Frame, tensors: list) -> None:
        self.termination.arrived()
        if frame.forks:
            self._on_arrival(source, frame)
        kind = frame.kind
        if kind is Kind.RESPONSE:
            self._on_response(source, frame, tensors)
        elif kind is Kind.REQUEST:
            self.serving.take_request(source, frame, tensors, self._submit)
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
                self.termination.processed()
            return
        run = functools.partial(self._serve_one_way, spec.handler, source, body, tensors)
        me = threading.get_ident()
        key = spec.waiter_key(body) if spec.waiter_key is not None else None
        waiter = self.waiting.waiter(key) if key is not None else None
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
            hooks = autograd_hooks.get()
            hooks.call_in(None, autograd_hooks.with_grad, handler, source, body, tensors)
        finally:
            self.termination.processed()

    def _submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the worker pool (it may block or run long)."""
        self.transport.busy(+1)
        with self._queued_lock:
            self._queued += 1

        def run() -> None:
            with self._queued_lock:
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
        self.termination.arrived()
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
            self.termination.processed()

    def _on_response(self, source: int, frame: Frame, tensors: list) -> None:
        try:
            self._take_response(source, frame, tensors)
        finally:
            self.termination.processed()

    def _take_response(self, source: int, frame: Frame, tensors: list) -> None:
        pending = self._pending.pop(frame.call_id, None)
        if pending is None:
            return  # the call timed out; its late answer is dropped
        try:
            if frame.body is not None:
                tensors = autograd_hooks.get().incoming(frame.body, source, tensors)
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
        complete = functools.partial(autograd_hooks.get().call_in, pending.ctx_id, setter, value)
        if future.waiter == threading.get_ident():
            future.completion = complete  # applied once that thread stopped polling
        else:
            self._callbacks.submit(complete)

    def num_pending(self) -> int:
        return len(self._pending)

    def debug_info(self) -> dict[str, Any]:
        """Pending calls, request handlers, where requests ran, and per-peer traffic (see
        ``rpc._get_debug_info``)."""
        peers = {
            info.name: counts
            for info, counts in zip(self.infos, self.transport.traffic(), strict=True)
        }
        return {
            "num_pending_requests": len(self._pending),
            "num_handlers_running": self.transport.handlers_running() - self._queued,
            "handler_queue_depth": self._queued,
            "requests_run_inline": self.serving.runs["inline"],
            "requests_run_on_pool": self.serving.runs["pool"],
            "progress_handoffs": self.transport.progress_handoffs(),
            "peers": peers,
        }

    # -- shutdown -------------------------------------------------------------------

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
