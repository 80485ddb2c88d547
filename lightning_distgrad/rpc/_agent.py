"""The RPC agent: requests, responses, timeouts and graceful shutdown.

Three frame kinds travel between agents:

* REQUEST: ``(func, args, kwargs)``; the callee always answers with one
  RESPONSE (a result or a remote error). The progress thread runs it itself
  when it can (a stand-in polls meanwhile if it runs long, see
  ``Transport.run_here``), else the worker pool does. A torch operator on small
  tensors (QUICK_REQUEST) runs right where the frame is handed over, on any
  thread: it cannot issue RPCs or block;
* RESPONSE: ``(ok, value)`` for one call id (no payload when the value is one
  plain tensor: the frame's only tensor); decoded by the thread driving
  progress (internal futures complete there, user-visible ones on a pool);
* CONTROL: bookkeeping applied on arrival, in order, by the thread driving
  progress (RRef fork deletes): never runs user code and never blocks;
* NOTIFY: ``(func, args)``, plainly pickled, and the frame's tensors: runs
  ``func(*args, tensors)`` like a REQUEST, but nobody waits for it and no
  RESPONSE goes back (distributed autograd's gradient messages, which report
  completion their own way).

Every REQUEST, CONTROL and NOTIFY frame is counted when sent and when processed; a
graceful shutdown ends when the global counts match twice in a row with no
call pending anywhere (a four-counter termination detection), so no request
or response is lost.
"""

from __future__ import annotations

import copy
import functools
import heapq
import itertools
import pickle
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from . import _devices, _hooks
from ._transport import Transport
from ._wire import Frame, decode_payload, encode_payload

REQUEST, RESPONSE, CONTROL, QUICK_REQUEST, NOTIFY = 0, 1, 2, 3, 4
#: Operators whose tensors are all at most this big run as QUICK_REQUESTs.
QUICK_LIMIT_BYTES = 64 * 1024
# How often the progress thread looks for expired calls.
_TIMEOUT_CHECK_S = 0.01


class WorkerInfo:
    """The name and id (rank) of one worker, as in ``torch.distributed.rpc``."""

    __slots__ = ("name", "id")

    def __init__(self, name: str, id: int):  # noqa: A002 - torch's signature
        self.name = name
        self.id = id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WorkerInfo) and (self.name, self.id) == (other.name, other.id)

    def __hash__(self) -> int:
        return hash((self.name, self.id))

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"

    def __reduce__(self):
        return (WorkerInfo, (self.name, self.id))


def timeout_error(timeout: float, dst: WorkerInfo | None = None) -> RuntimeError:
    """torch's timeout error (ported code matches its leading text), naming ``dst`` if given.

    Example::
        >>> str(timeout_error(1e-6, WorkerInfo("worker1", 1)))[:45]
        'RPC ran for more than set timeout (0.001 ms) '
        >>> str(timeout_error(0.5, WorkerInfo("worker1", 1))).endswith("(call to worker1, rank 1)")
        True
    """
    ms = timeout * 1000
    # A sub-millisecond timeout must not read as 0 ms, which would mean "no timeout".
    shown = f"{ms:.3f}".rstrip("0").rstrip(".") if ms >= 1 else f"{ms:.3g}"
    where = f" (call to {dst.name}, rank {dst.id})" if dst is not None else ""
    return RuntimeError(
        f"RPC ran for more than set timeout ({shown} ms) and will now be marked with an error"
        + where
    )


def is_async_function(func: Any) -> bool:
    return getattr(func, "_wrapped_async_rpc_function", None) is not None


# ---------------------------------------------------------------------------
# Remote errors keep their type and say where they happened.


def _remote_error(exc: BaseException, where: WorkerInfo) -> tuple[type, str]:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return type(exc), f"On {where}:\n{exc!r}\n{text}"


def _rebuild_error(exc_type: type, msg: str) -> BaseException:
    try:
        return exc_type(msg)
    except Exception as e:  # types whose constructor does not take one string
        return RuntimeError(
            f"Failed to create original exception type. Error msg was {e!r}. "
            f"Original exception on remote side was {msg}"
        )


def _raise_copy(exc: BaseException):
    """Unwrap function of :func:`set_error` futures: raise a fresh copy of ``exc``."""
    try:
        fresh = copy.copy(exc)
    except Exception:  # a type that cannot be rebuilt from its args
        fresh = RuntimeError(f"{type(exc).__name__}: {exc}")
    fresh.__cause__, fresh.__context__ = exc.__cause__, exc.__context__
    raise fresh.with_traceback(exc.__traceback__)


def set_error(future: torch.futures.Future, exc: BaseException) -> None:
    """Complete ``future`` with ``exc``; every ``wait()`` raises a fresh copy of it.

    Fix (leak): ``torch.futures.Future.set_exception`` raises the stored object
    itself from ``wait()``, so its traceback comes to reference the waiting
    frames, and they reference the future: a cycle through C++ that Python's
    gc cannot see. Every failed RPC then leaked the caller's frames and their
    locals for good: tensors, and RRefs, whose owners were never told, so the
    owner never freed the value. torch's own RPC futures raise a new exception
    per ``wait()``; so do these. ``exc``'s traceback must not reference ``future``.
    """
    future._set_unwrap_func(_raise_copy)
    future.set_result(exc)


_NOT_IMPORTABLE_HINT = (
    "Default RPC pickler does not serialize function code. Ensure that UDFs are defined on "
    "both caller and callee modules: remote functions, and the classes of their arguments, "
    "must be importable under the same module path on every rank. Define them at module level "
    "in a module that every rank imports, not under `if rank == 0:` or "
    "`if __name__ == '__main__':`."
)


def _not_importable(exc: ImportError | AttributeError) -> BaseException:
    """``exc`` (raised while unpickling a request) with the hint, keeping its type if possible."""
    try:
        return type(exc)(f"{exc}. {_NOT_IMPORTABLE_HINT}")
    except Exception:  # a subclass whose constructor takes other arguments
        return RuntimeError(f"{type(exc).__name__}: {exc}. {_NOT_IMPORTABLE_HINT}")


def _decode_and_call(payload: bytes, tensors: list) -> tuple[Callable, Any]:
    """Run a request's function; returns (function, result)."""
    # Only the unpickling is wrapped: the function's own errors reach the caller as raised.
    try:
        func, args, kwargs = decode_payload(payload, tensors)
    except (ImportError, AttributeError) as e:
        raise _not_importable(e) from e
    return func, func(*args, **kwargs)


def _notified(payload: bytes, tensors: list) -> None:
    """Run a NOTIFY's function (see :meth:`Agent.notify`)."""
    func, args = pickle.loads(payload)
    func(*args, tensors)


#: ``Future.done`` without torch's Python wrapper around it (0.14 instead of 0.33 us): a
#: waiting thread checks it after every poll, 5-15 times per round trip.
_future_done = torch._C.Future.done


class _UserFuture(torch.futures.Future):
    """The future of ``rpc_async``: ``wait()`` drives MPI progress on the waiting thread,
    as ``rpc_sync`` does, and completes the future with the response it received.

    Otherwise the response would go from the progress thread to the callback
    thread to the waiting thread: two thread wake-ups per call. The future is
    completed after the thread stopped driving: its callbacks then run there,
    and one that waits for an RPC of its own can drive in turn.
    """

    def __init__(self, transport: Transport):
        super().__init__()
        self._transport = transport
        self.waiter: int | None = None  # ident of a thread driving progress in wait()
        self.completion: Callable[[], None] | None = None  # set by the waiter's delivery

    def _answered(self) -> bool:
        return self.completion is not None or _future_done(self)

    def wait(self) -> Any:
        if not self.done():
            self.waiter = threading.get_ident()
            self._transport.drive_until(self._answered)
            completion, self.completion = self.completion, None
            if completion is not None:
                completion()
        return super().wait()


class _Pending:
    __slots__ = ("future", "dst", "user_visible", "ctx_id", "deadline", "timeout")

    def __init__(self, future, dst, user_visible, ctx_id, timeout):
        self.future = future
        self.dst = dst
        self.user_visible = user_visible
        self.ctx_id = ctx_id  # the caller's autograd context: its callbacks run in it
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout if timeout > 0 else None


class Agent:
    """One per process while RPC is initialised; owns the transport and the pools."""

    def __init__(self, comm, infos: list[WorkerInfo], rank: int, timeout: float,
                 num_worker_threads: int, on_arrival: Callable[[int, Frame], None],
                 on_control: Callable[[int, Any], None]):
        self.infos = infos
        self.info = infos[rank]
        self.by_name = {w.name: w for w in infos}
        self.timeout = timeout
        # device_maps[src][dst]: src's map for tensors it sends to dst (set by init_rpc).
        self.device_maps: list[list[dict]] = [[{} for _ in infos] for _ in infos]
        self._on_arrival = on_arrival
        self._on_control = on_control
        self._ids = itertools.count()
        self._pending: dict[int, _Pending] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._deadline_lock = threading.Lock()
        self._timeout_check_armed = False
        self._sent = 0  # REQUEST, CONTROL and NOTIFY frames sent
        self._processed = 0  # REQUESTs answered, CONTROLs applied, NOTIFYs run
        self._count_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(num_worker_threads, thread_name_prefix="distgrad-worker")
        # User-visible futures complete here, so `then` callbacks never run on
        # the progress thread and never wait behind busy request handlers. More
        # than one thread: a callback may wait for another future of ours, whose
        # completion must not queue behind it.
        self._callbacks = ThreadPoolExecutor(num_worker_threads,
                                             thread_name_prefix="distgrad-callbacks")
        self.transport = Transport(comm, self._on_frame)
        # Not started here: see :meth:`start`.

    def start(self) -> None:
        """Start receiving. Call once this agent is the current one.

        Fix (race): the progress thread used to start in ``__init__``, before
        ``init_rpc`` made the agent current; a request from a faster peer could
        run in that window and fail with "RPC has not been initialized" (a
        ``remote()`` then never created its value, and ``to_here()`` hung).
        """
        self.transport.start()

    # -- sending ----------------------------------------------------------------

    def call(self, dst: WorkerInfo, func: Callable, args: tuple, kwargs: dict,
             timeout: float, *, user_visible: bool, force_autograd: bool,
             arrival_forks: list | None = None, operator: bool = False) -> torch.futures.Future:
        """Send a request; returns the future of its response.

        ``operator``: ``func`` is a torch operator (no RPCs, no blocking).
        """
        payload, tensors, pctx = self._encode((func, args, kwargs), dst, func)
        # Fix (hang): everything that may reject the call runs before the call
        # is registered and counted. A tensor refused here (no device map) used
        # to leave a pending call that was never sent: graceful shutdown then
        # waited for it forever.
        devices = self._devices(tensors, dst.id)
        meta = _hooks.get().outgoing(dst.id, tensors, force_autograd)
        pctx.commit()
        future = _UserFuture(self.transport) if user_visible else torch.futures.Future()
        call_id = next(self._ids)
        ctx_id = _hooks.get().current_context() if user_visible else None
        pending = _Pending(future, dst, user_visible, ctx_id, timeout)
        self._pending[call_id] = pending
        if pending.deadline is not None:
            self._watch_deadline(pending.deadline, call_id)
        self._count_sent()
        forks = tuple(pctx.arrival_forks)
        if arrival_forks:
            forks += tuple(arrival_forks)
        quick = operator and all(t.nbytes <= QUICK_LIMIT_BYTES for t in tensors)
        self.transport.send(dst.id, Frame(QUICK_REQUEST if quick else REQUEST, call_id, payload,
                                          (), meta, forks), tensors, devices)
        return future

    def notify(self, dst_id: int, func: Callable, args: tuple,
               tensors: list[torch.Tensor] = (), key: Any = None) -> None:
        """Run ``func(*args, tensors)`` on ``dst_id``; nothing answers.

        For the library's own functions only. ``args`` are plain values (no
        tensors, no RRefs), pickled as they are; ``tensors`` travel as the
        frame's tensor table (a gradient message encodes in 1.5 instead of 7.8
        us warm this way). One sent with a ``key`` runs on the thread of
        ``dst_id`` that waits with that key (:meth:`wait_done`), a user's
        thread, so it must leave no thread state behind. Never recorded by
        distributed autograd. An error in ``func`` can only be printed on
        ``dst_id``: ``func`` must report its outcome itself.
        """
        payload = pickle.dumps((func, args), pickle.HIGHEST_PROTOCOL)
        tensors = list(tensors)
        devices = self._devices(tensors, dst_id)
        self._count_sent()
        self.transport.send(dst_id, Frame(NOTIFY, -1, payload, (), key), tensors, devices)

    def send_control(self, dst_id: int, body: Any) -> None:
        """Fire-and-forget bookkeeping applied in order on ``dst_id``'s progress thread."""
        self._count_sent()
        self.transport.send(dst_id, Frame(CONTROL, -1, b"", (), body), [])

    def _encode(self, obj: Any, dst: WorkerInfo, func: Any):
        try:
            return encode_payload(obj, dst.id)
        except Exception as e:
            if isinstance(e, RuntimeError) and "rref" in str(e).lower():
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
        device_map = (_devices.invert(self.device_maps[dst_id][me]) if reply
                      else self.device_maps[me][dst_id])
        return _devices.target_devices(tensors, device_map, self.info.name,
                                       self.infos[dst_id].name)

    def _count_sent(self) -> None:
        with self._count_lock:
            self._sent += 1

    def _count_processed(self) -> None:
        with self._count_lock:
            self._processed += 1

    # -- timeouts ---------------------------------------------------------------

    def _watch_deadline(self, deadline: float, call_id: int) -> None:
        with self._deadline_lock:
            heapq.heappush(self._deadlines, (deadline, call_id))
            if self._timeout_check_armed:
                return
            self._timeout_check_armed = True
        self.transport.call_later(_TIMEOUT_CHECK_S, self._expire_calls)

    def _expire_calls(self) -> None:
        now = time.monotonic()
        expired = []
        with self._deadline_lock:
            while self._deadlines and self._deadlines[0][0] <= now:
                expired.append(heapq.heappop(self._deadlines)[1])
            # Answered calls need no watching. Fix (leak): the list was only cleared
            # when no call was pending at a check, which never happens while a thread
            # keeps calling: it grew by one entry per call for a whole timeout
            # (60 s at 20,000 calls/s: 1.2 million entries).
            pending = self._pending
            if len(self._deadlines) > 2 * len(pending) + 64:
                self._deadlines = [d for d in self._deadlines if d[1] in pending]
                heapq.heapify(self._deadlines)
            rearm = self._timeout_check_armed = bool(self._deadlines)
        for call_id in expired:
            pending = self._pending.pop(call_id, None)
            if pending is not None:  # completed outside the MPI lock, like responses
                self.transport.defer(
                    lambda p=pending: self._complete(p, False, timeout_error(p.timeout, p.dst)))
        if rearm:
            self.transport.call_later(_TIMEOUT_CHECK_S, self._expire_calls)

    # -- receiving (progress thread) ------------------------------------------------

    def _on_frame(self, source: int, frame: Frame, tensors: list) -> None:
        if frame.forks:
            self._on_arrival(source, frame)
        if frame.kind == RESPONSE:
            self._on_response(source, frame, tensors)
        elif frame.kind == REQUEST or frame.kind == NOTIFY:
            self.transport.busy(+1)
            serve = lambda: self._serve(source, frame, tensors)  # noqa: E731
            if not self.transport.run_here(serve, frame.autograd if frame.kind == NOTIFY
                                           else None):
                self._pool.submit(serve)
        elif frame.kind == QUICK_REQUEST:
            if frame.autograd is None:
                self._run_operator(source, frame, tensors)
            else:
                self._run_request(source, frame, tensors)
        else:
            try:
                self._on_control(source, frame.autograd)
            finally:
                self._count_processed()

    def _on_response(self, source: int, frame: Frame, tensors: list) -> None:
        pending = self._pending.pop(frame.call_id, None)
        if pending is None:
            return  # the call timed out; its late answer is dropped
        try:
            if frame.autograd is not None:
                tensors = _hooks.get().incoming(frame.autograd, source, tensors)
            if frame.payload is None:  # the result is the frame's one tensor
                ok, value = True, tensors[0]
            else:
                ok, value = decode_payload(frame.payload, tensors)
                if not ok:
                    value = _rebuild_error(*value)
        except Exception as e:
            # No traceback: it references this frame, which holds the future.
            ok, value = False, e.with_traceback(None)
        self._complete(pending, ok, value)

    def _complete(self, pending: _Pending, ok: bool, value: Any) -> None:
        future = pending.future
        setter = future.set_result if ok else lambda exc: set_error(future, exc)
        if not pending.user_visible:
            setter(value)
            return
        # ``then`` callbacks run in the caller's autograd context, as if on its thread:
        # an RPC they make (an async UDF's continuation) stays recorded. They run on
        # a callback thread, unless the thread waiting in ``wait()`` got the response.
        complete = functools.partial(_hooks.get().call_in, pending.ctx_id, setter, value)
        if future.waiter == threading.get_ident():
            future.completion = complete  # applied once that thread stopped driving
        else:
            self._callbacks.submit(complete)

    # -- serving (worker pool) ------------------------------------------------------

    def _serve(self, source: int, frame: Frame, tensors: list) -> None:
        try:
            if frame.kind == NOTIFY:
                self._run_notification(frame, tensors)
            else:
                self._run_request(source, frame, tensors)
        finally:
            self.transport.busy(-1)

    @staticmethod
    def _call(source: int, frame: Frame, tensors: list) -> tuple[int | None, Callable, Any]:
        """Run the function of a REQUEST; returns (context id, function, result)."""
        hooks = _hooks.get()
        ctx_id = hooks.context_of(frame.autograd)
        tensors = hooks.incoming(frame.autograd, source, tensors)
        # Grad mode is thread-local: a request runs with it on, as on a fresh
        # server thread, whichever thread handed its frame over (a caller's
        # thread inside torch.no_grad(), say) and whatever an earlier function
        # on this pool thread left behind.
        return (ctx_id, *hooks.call_in(ctx_id, _hooks.with_grad, _decode_and_call,
                                       frame.payload, tensors))

    def _run_notification(self, frame: Frame, tensors: list) -> None:
        # Never recorded, and outside any context (it may run on a user's thread).
        try:
            _hooks.get().call_in(None, _hooks.with_grad, _notified, frame.payload, tensors)
        except BaseException:
            traceback.print_exc()  # nobody waits for an answer: say it here
        finally:
            self._count_processed()

    def _run_request(self, source: int, frame: Frame, tensors: list) -> None:
        try:
            ctx_id, func, result = self._call(source, frame, tensors)
        except BaseException as e:
            self._reply_error(source, frame.call_id, e)
            return
        if not is_async_function(func):
            self._reply(source, frame.call_id, True, result, ctx_id)
        # torch._C.Future, not torch.futures.Future: ``then()`` and ``collect_all()``
        # return the C base class, which async functions commonly return.
        elif isinstance(result, torch._C.Future):
            result.add_done_callback(lambda f: self._reply_future(source, frame.call_id, f, ctx_id))
        else:
            self._reply_error(source, frame.call_id, TypeError(
                "Functions decorated with @rpc.async_function must return a "
                f"torch.futures.Future object, but got {type(result)}"))

    def _run_operator(self, source: int, frame: Frame, tensors: list) -> None:
        """A torch operator with no autograd context: :meth:`_run_request` minus the
        hooks (nothing to record, no context to switch: an operator makes no RPCs)."""
        try:
            _, result = _hooks.with_grad(_decode_and_call, frame.payload, tensors)
        except BaseException as e:
            self._reply_error(source, frame.call_id, e)
            return
        self._reply(source, frame.call_id, True, result)

    def _reply_future(self, dst: int, call_id: int, future: torch.futures.Future, ctx_id) -> None:
        try:
            value = future.wait()
        except BaseException as e:
            self._reply_error(dst, call_id, e)
        else:
            self._reply(dst, call_id, True, value, ctx_id)

    def _reply(self, dst: int, call_id: int, ok: bool, value: Any, ctx_id=None) -> None:
        try:
            if ok and type(value) is torch.Tensor and value.layout == torch.strided:
                # The usual result, one plain tensor, needs no pickle: its frame has
                # no payload (a pickler each way cost 3.5 us of a 55 us round trip).
                payload, tensors, pctx = None, [value], None
            else:
                payload, tensors, pctx = encode_payload((ok, value), dst)
            # Fix (hang): inside the try, so a refused result tensor becomes an
            # error response instead of no response at all.
            devices = self._devices(tensors, dst, reply=True)
            # A response is recorded in its request's context only, never in
            # whatever context the replying thread happens to be in.
            recorded = ok and ctx_id is not None
            meta = _hooks.get().outgoing(dst, tensors, False, ctx_id) if recorded else None
        except BaseException as e:
            if not ok:
                raise
            self._reply_error(dst, call_id, e)
            return
        forks = ()
        if pctx is not None:
            pctx.commit()
            forks = tuple(pctx.arrival_forks)
        self.transport.send(dst, Frame(RESPONSE, call_id, payload, (), meta, forks),
                            tensors, devices)
        self._count_processed()

    def _reply_error(self, dst: int, call_id: int, exc: BaseException) -> None:
        exc_type, msg = _remote_error(exc, self.info)
        try:
            self._reply(dst, call_id, False, (exc_type, msg))
        except Exception:  # an unpicklable exception type: keep the text
            self._reply(dst, call_id, False, (RuntimeError, msg))

    # -- shutdown -------------------------------------------------------------------

    def wait(self, future: torch.futures.Future) -> Any:
        """Wait for ``future``, driving MPI progress on this thread meanwhile."""
        if not future.done():
            self.transport.drive_until(functools.partial(_future_done, future))
        return future.wait()

    def wait_done(self, future: torch.futures.Future, timeout: float, key: Any = None) -> bool:
        """Wait at most ``timeout`` s (<= 0: no limit) for ``future``; True if it is done.

        NOTIFYs sent with ``key`` (not None) that arrive meanwhile run on this thread.
        """
        if future.done():
            return True
        if timeout > 0:
            deadline = time.monotonic() + timeout
            done = lambda: future.done() or time.monotonic() >= deadline  # noqa: E731
        else:
            done = future.done
        if not self.transport.drive_until(done, key):  # another thread drives
            finished = threading.Event()
            future.add_done_callback(lambda _: finished.set())
            finished.wait(timeout if timeout > 0 else None)
        return future.done()

    def num_pending(self) -> int:
        return len(self._pending)

    def wait_all_workers(self) -> None:
        """Return once every rank called this (this rank keeps serving meanwhile)."""
        self.transport.allreduce_sum([0])

    def wait_quiescent(self, timeout: float = 0) -> None:
        """Return once no rank has work left: every request answered everywhere."""
        deadline = time.monotonic() + timeout if timeout > 0 else None
        previous = None
        while True:
            while self._pending:
                if deadline is not None and time.monotonic() > deadline:
                    raise RuntimeError(
                        f"shutdown timed out after {timeout} s on {self.info} with "
                        f"{len(self._pending)} RPCs still pending")
                time.sleep(0.0005)
            with self._count_lock:
                counts = [self._sent, self._processed]
            totals = self.transport.allreduce_sum(counts)
            if totals[0] == totals[1] and totals == previous:
                return
            previous = totals

    def stop(self) -> None:
        """Stop threads and free communicators (after :meth:`wait_quiescent`)."""
        self._pool.shutdown(wait=True)
        self._callbacks.shutdown(wait=True)
        self.transport.stop()
        self.transport.free()
        for pending in list(self._pending.values()):
            set_error(pending.future, RuntimeError("RPC agent shut down before a response"))
        self._pending.clear()
