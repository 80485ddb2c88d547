"""The callee side of a call: run a request's function and send its one response.

A REQUEST (or PROFILED_REQUEST) runs in the autograd context its frame names,
with grad mode on; a QUICK_REQUEST operator runs with no context at all. Every
request gets exactly one RESPONSE: its result, or the error it raised, or why
its result could not be sent. An ``@rpc.async_function`` answers when the future
it returned completes.

Where a request runs: an operator right where its frame is delivered; a REQUEST there too
when the progress thread delivers it and its function is one that runs short without
waiting (see ``inlining``), else on the worker pool, as are PROFILED_REQUESTs.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..._compat import CFuture, find_builtin
from .._transport import Frame, Kind, Transport
from . import autograd_hooks, server_profiler
from .errors import (
    async_wrong_type_error,
    is_async_function,
    not_importable,
    print_user_error,
    remote_error,
)
from .inlining import InlineRun, Inlining
from .payload import UnpicklingContext, decode_payload, encode_payload
from .remote_events import Recorder, recording_for_caller, split_profiled_request_body
from .spans import profiling_key, recording_rpcs, run_recorded
from .worker_info import WorkerInfo

log = logging.getLogger("lightning_distgrad.rpc")


def _decode(payload: bytes, tensors: list, context: UnpicklingContext | None) -> tuple:
    """A request's ``(function, args, kwargs)``; the errors of unpickling them are the callee's
    (``not_importable``), those of the function its caller's."""
    try:
        return decode_payload(payload, tensors, context)
    except (ImportError, AttributeError) as e:
        raise not_importable(e) from e


def _call_function(func: Callable, args: tuple, kwargs: dict, caller: WorkerInfo, me: WorkerInfo):
    """``func(*args, **kwargs)`` for a request of ``caller``'s on worker ``me``; under an
    active torch profiler recorded as ``rpc_serve#<function>(<caller> -> <me>)``."""
    name = functools.partial(_serve_span, func, caller, me)
    try:
        return run_recorded(name, func, *args, **kwargs)
    except Exception as e:
        if not _is_operator(func):  # torch's callee prints Python functions' errors only
            print_user_error(e, me)
        elif isinstance(e, TypeError):  # arguments no schema takes: torch's error for them
            raise RuntimeError(
                f"Overloaded torch operator invoked from Python failed to match any schema: {e}"
            ) from e
        raise


def _decode_and_call(
    payload: bytes,
    tensors: list,
    caller: WorkerInfo,
    me: WorkerInfo,
    confirmed: Callable[[list], None] | None = None,
) -> tuple[Callable, Any]:
    """Decode a request and run its function; returns (function, result). ``confirmed``:
    waits until the owners confirmed the RRefs that users handed on in the request, before
    the run (None for a QUICK_REQUEST, an operator run by the thread that delivers frames,
    which must not wait for one)."""
    context = UnpicklingContext() if confirmed is not None else None
    func, args, kwargs = _decode(payload, tensors, context)
    if context is not None and context.confirmations:
        confirmed(context.confirmations)
    return func, _call_function(func, args, kwargs, caller, me)


def _is_operator(func: Any) -> bool:
    try:
        return find_builtin(func) is not None
    except Exception:
        return False


def _serve_span(func: Callable, caller: WorkerInfo, me: WorkerInfo) -> tuple[str, None] | None:
    if not recording_rpcs():
        return None
    if server_profiler.serving_profiled() or recording_for_caller():
        # What torch's profiles list of a served request is what it ran, and only that.
        return None
    return profiling_key("serve", func, f"{caller.name} -> {me.name}"), None


class Serving:
    """Runs the requests that reach one worker and answers each exactly once.

    Owned by the agent, which hands it requests on the thread that should run them.
    ``devices(tensors, dst, reply=True)`` gives a reply's tensor devices on ``dst``;
    ``send_one_way`` carries a profiled call's events back; ``count_processed`` counts
    a request as handled, once its response is sent (see ``graceful_shutdown``); ``wait(future)``
    waits for a future of the agent, at most the RPC timeout.
    """

    def __init__(
        self,
        infos: list[WorkerInfo],
        me: WorkerInfo,
        transport: Transport,
        devices: Callable[..., list[str] | None],
        send_one_way: Callable[[int, Kind, tuple], None],
        count_processed: Callable[[], None],
        wait: Callable[[torch.futures.Future], bool],
    ):
        self.infos = infos
        self.info = me
        self.transport = transport
        self._devices = devices
        self._send_one_way = send_one_way
        self._count_processed = count_processed
        self._wait = wait
        self._inlining = Inlining()
        # REQUESTs run where they were delivered, and on the pool (see rpc._get_debug_info).
        self.runs = {"inline": 0, "pool": 0}

    def _confirmed(self, confirmations: list) -> None:
        """Wait (at most the RPC timeout) until the owners confirmed the user RRefs a
        request carried: torch runs a request only then."""
        # The polling thread must not wait: it delivers the confirmations.
        if not self.transport.is_progress_thread(threading.get_ident()):
            for future in confirmations:
                self._wait(future)

    def _call(self, source: int, frame: Frame, tensors: list) -> tuple[int | None, Callable, Any]:
        """Run the function of a REQUEST; returns (context id, function, result)."""
        hooks = autograd_hooks.get()
        ctx_id = hooks.context_of(frame.body)
        tensors = hooks.incoming(frame.body, source, tensors, frame.call_id)
        # Grad mode is thread-local: a request runs with it on, as on a fresh
        # server thread, whichever thread handed its frame over.
        return (
            ctx_id,
            *hooks.call_in(
                ctx_id,
                autograd_hooks.with_grad,
                _decode_and_call,
                frame.payload,
                tensors,
                self.infos[source],
                self.info,
                None if frame.kind is Kind.QUICK_REQUEST else self._confirmed,
            ),
        )

    def _call_profiled(
        self, source: int, frame: Frame, tensors: list
    ) -> tuple[int | None, Callable, Any]:
        """:meth:`_call` for a PROFILED_REQUEST: run under a :class:`Recorder`, whose events
        go back in a REMOTE_EVENTS frame before the response (frames between two workers
        arrive in the order they were sent, so the caller has them when its call returns)."""
        options, body = split_profiled_request_body(frame.body)
        frame = frame._replace(body=body)
        recorder = Recorder(self.info.id, options)
        send = functools.partial(self._send_remote_events, source, frame.call_id, recorder)
        try:
            with recorder:
                ctx_id, func, result = self._call(source, frame, tensors)
        except BaseException:
            send()
            raise
        if is_async_function(func) and isinstance(result, CFuture):
            return ctx_id, func, Recorder.after(result, send)
        send()
        return ctx_id, func, result

    def _send_remote_events(self, dst: int, call_id: int, recorder: Recorder) -> None:
        try:
            self._send_one_way(dst, Kind.REMOTE_EVENTS, recorder.body(call_id))
        except Exception:  # the call still gets its response; its caller lists no events
            log.exception("lightning_distgrad: %s could not send remote events", self.info)

    def run_request(
        self, source: int, frame: Frame, tensors: list, *, profiled: bool = False
    ) -> None:
        """Run a REQUEST and answer it; ``profiled``: a PROFILED_REQUEST, whose callee
        records it (see :meth:`_call_profiled`)."""
        call = self._call_profiled if profiled else self._call
        try:
            # A caller's profiler takes precedence: a thread records under one at a time.
            if server_profiler.ranges and not profiled:
                ctx_id, func, result = server_profiler.run_profiled(call, source, frame, tensors)
            else:
                ctx_id, func, result = call(source, frame, tensors)
        except BaseException as e:
            self.reply_error(source, frame.call_id, e)
            return
        self._answer(source, frame.call_id, func, (True, result), ctx_id)

    def take_request(
        self, source: int, frame: Frame, tensors: list, submit: Callable[[Callable], None]
    ) -> None:
        """A REQUEST, on the thread that delivered it: run right here when the transport
        allows it (``Transport.begin_inline``) and its function may run inline (see
        ``inlining``), else on the pool (``submit``). Decoding is part of the inline run;
        the answer is sent once the run's outcome is recorded, so a next request of the
        same function finds it."""
        if server_profiler.ranges or not self.transport.begin_inline():
            self.runs["pool"] += 1
            submit(functools.partial(self.run_request, source, frame, tensors))
            return
        func, ctx_id, outcome, run = None, None, None, InlineRun()
        try:
            hooks = autograd_hooks.get()
            ctx_id = hooks.context_of(frame.body)
            tensors = hooks.incoming(frame.body, source, tensors, frame.call_id)
            context = UnpicklingContext()
            func, args, kwargs = hooks.call_in(
                ctx_id, autograd_hooks.with_grad, _decode, frame.payload, tensors, context
            )
            call = (source, ctx_id, func, args, kwargs)
            if context.confirmations or is_async_function(func) or not self._inlining.allows(func):
                self.runs["pool"] += 1
                run = functools.partial(self._run_decoded, frame.call_id, context.confirmations)
                submit(functools.partial(run, *call))
                func = None  # not run here
            else:
                self.runs["inline"] += 1
                outcome = self._call_decoded(*call)
        except BaseException as e:  # decoding failed
            outcome = (False, e)
        finally:
            kept = self.transport.end_inline()
            if not torch.is_grad_enabled():  # the run turned it off: later frames need it on
                torch.set_grad_enabled(True)
            if func is not None:
                self._inlining.ran(func, kept and run.short())
        if outcome is not None:
            self._answer(source, frame.call_id, func, outcome, ctx_id)

    def _call_decoded(
        self, source: int, ctx_id: int | None, func: Callable, args: tuple, kwargs: dict
    ) -> tuple[bool, Any]:
        """``(True, result)`` of a decoded REQUEST's function, or ``(False, error)``."""
        try:
            hooks = autograd_hooks.get()
            result = hooks.call_in(
                ctx_id,
                autograd_hooks.with_grad,
                _call_function,
                func,
                args,
                kwargs,
                self.infos[source],
                self.info,
            )
        except BaseException as e:
            return False, e
        return True, result

    def _run_decoded(
        self,
        call_id: int,
        confirmations: list,
        source: int,
        ctx_id: int | None,
        func: Callable,
        args: tuple,
        kwargs: dict,
    ) -> None:
        """On the pool: run a decoded REQUEST once its RRefs are confirmed; answer it."""
        try:
            if confirmations:
                self._confirmed(confirmations)
        except BaseException as e:
            self.reply_error(source, call_id, e)
            return
        outcome = self._call_decoded(source, ctx_id, func, args, kwargs)
        self._answer(source, call_id, func, outcome, ctx_id)

    def _answer(
        self, source: int, call_id: int, func: Callable | None, outcome: tuple, ctx_id
    ) -> None:
        """Answer a request with its ``(ok, value)`` outcome: an async function's value is
        a future, answered once it completes."""
        ok, result = outcome
        if not ok:
            self.reply_error(source, call_id, result)
        elif not is_async_function(func):
            self._reply(source, call_id, True, result, ctx_id)
        # CFuture: ``then()`` and ``collect_all()`` return the C base class, which async
        # functions commonly return.
        elif isinstance(result, CFuture):
            result.add_done_callback(lambda f: self._reply_future(source, call_id, f, ctx_id))
        else:
            self.reply_error(source, call_id, async_wrong_type_error(result))

    def run_operator(self, source: int, frame: Frame, tensors: list) -> None:
        """A torch operator with no autograd context: :meth:`run_request` minus the
        hooks (nothing to record, no context to switch: an operator makes no RPCs)."""
        try:
            args = (_decode_and_call, frame.payload, tensors, self.infos[source], self.info)
            if server_profiler.ranges:
                _, result = server_profiler.run_profiled(autograd_hooks.with_grad, *args)
            else:
                _, result = autograd_hooks.with_grad(*args)
        except BaseException as e:
            self.reply_error(source, frame.call_id, e)
            return
        self._reply(source, frame.call_id, True, result)

    def _reply_future(self, dst: int, call_id: int, future: torch.futures.Future, ctx_id) -> None:
        try:
            value = future.wait()
        except BaseException as e:
            self.reply_error(dst, call_id, e)
        else:
            self._reply(dst, call_id, True, value, ctx_id)

    def _reply(self, dst: int, call_id: int, ok: bool, value: Any, ctx_id=None) -> None:
        try:
            if (
                ok
                and type(value) is torch.Tensor
                and value.layout == torch.strided
                and value.is_contiguous()
            ):
                # The usual result, one plain contiguous tensor, needs no pickle: its
                # frame has no payload (a view's strides travel in the payload).
                payload, tensors, pctx = None, [value], None
            else:
                payload, tensors, pctx = encode_payload((ok, value), dst)
            # Inside the try: a refused result tensor becomes an error response, so
            # every request gets exactly one response.
            devices = self._devices(tensors, dst, reply=True)
            # A response is recorded in its request's context only, never in
            # whatever context the replying thread happens to be in.
            recorded = ok and ctx_id is not None
            meta = (
                autograd_hooks.get().outgoing(dst, tensors, False, ctx_id, call_id=call_id)
                if recorded
                else None
            )
        except BaseException as e:
            if not ok:
                raise
            self.reply_error(dst, call_id, e)
            return
        forks = ()
        if pctx is not None:
            pctx.commit()
            forks = tuple(pctx.arrival_forks)
        self.transport.send(
            dst, Frame(Kind.RESPONSE, call_id, payload, (), meta, forks), tensors, devices
        )
        self._count_processed()

    def reply_error(self, dst: int, call_id: int, exc: BaseException) -> None:
        """Answer call ``call_id`` from ``dst`` with ``exc``, raised on the caller as a
        remote error naming this worker."""
        exc_type, msg = remote_error(exc, self.info)
        try:
            self._reply(dst, call_id, False, (exc_type, msg))
        except Exception:  # an unpicklable exception type: keep the text
            self._reply(dst, call_id, False, (RuntimeError, msg))
