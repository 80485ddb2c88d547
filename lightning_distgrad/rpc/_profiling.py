"""What the RPC layer records for profilers: torch profiler spans, remote events, a message log.

Spans use torch's RPC profiling names (``rpc_sync#aten::add(worker0 -> worker1)``).

Remote events: a call made while a torch profiler records its thread travels as a
PROFILED_REQUEST. Its callee runs it under a profiler of its own and sends what that
recorded back in a REMOTE_EVENTS frame just before the response (frames between two
workers arrive in the order they were sent), and the caller's profiler lists those
events as torch's RPC profiling does: named ``<call's key>#remote_op: <event>``, with
``node_id`` the worker that ran them and ``is_remote`` set. Calls made without a
profiler on their thread send plain REQUESTs: the only cost to them is one check.

The message log, on only while ``lightning_distgrad.profiler`` records a merged
timeline, notes every frame sent and received (time, peer, per-pair sequence, bytes),
so that a merged timeline can draw each message from its send to its receipt.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from .._compat import (
    end_span_on_future,
    find_builtin,
    kineto_records_this_thread,
    profiler_enabled,
    wrap_kineto_results_parser,
)
from ._errors import set_error
from ._one_way import register_one_way
from ._wire import Kind

log = logging.getLogger("lightning_distgrad.rpc")

#: torch's separator between a call's profiling key and the name of a remote event.
REMOTE_OP_STR = "#remote_op: "
#: Calls whose remote events wait for a Kineto profiler's results to be read (the oldest
#: are dropped beyond this: a profiler whose results are never read keeps none forever).
MAX_UNREAD_CALLS = 20_000


# -- Span names -------------------------------------------------------------------------


def profiling_key(mode: str, func: Callable, route: str) -> str:
    """torch's RPC profiling name: ``rpc_<mode>#<operator or qualname>(<route>)``, where
    ``route`` is ``"<caller> -> <callee>"``."""
    try:
        name = find_builtin(func)
    except Exception:
        name = None
    name = name or getattr(func, "__qualname__", None) or repr(func)
    return f"rpc_{mode}#{name}({route})"


# -- Remote events ---------------------------------------------------------------------


class RemoteEvents(NamedTuple):
    """Body of a REMOTE_EVENTS frame: what the callee recorded of call ``call_id``.

    ``events``: ``(name, start_us, end_us, thread, node_id)`` tuples, times since the
    callee began the call; ``duration_us``: from then until the events were sent.
    """

    call_id: int
    duration_us: float
    events: tuple


def _placed(
    events: tuple, key: str, start_ns: int, end_ns: int, duration_us: float, base_ns: int
) -> Iterator[tuple]:
    """A call's remote events on the caller's clock, in us since ``base_ns``.

    The caller saw the call from ``start_ns`` to ``end_ns``; the callee's run lies in
    that interval with the send and the response taking equal shares of the rest.
    """
    shift = (start_ns - base_ns) / 1000 + max(0.0, (end_ns - start_ns) / 1000 - duration_us) / 2
    for name, start, end, thread, node_id in events:
        yield f"{key}{REMOTE_OP_STR}{name}", shift + start, shift + end, thread, node_id


class _Local(threading.local):
    recorder: Recorder | None = None  # a class default: no AttributeError when unset


_local = _Local()


class Recorder:
    """Records a PROFILED_REQUEST on its callee (see :meth:`Serving._call_profiled`).

    Inside ``with recorder:`` torch's legacy profiler records this thread (Kineto allows
    one profiler per process; the legacy one is per thread), unless a profiler records
    it already. Calls the run makes deliver their remote events here (:meth:`add`), so
    that nested calls come back nested, as in torch; each such call is recorded here
    from its send to its events' arrival (an async function's calls end after the
    legacy profiler stopped, which then drops them).
    """

    def __init__(self, node_id: int):
        self.node_id = node_id
        self.events: list[tuple] = []
        self._calls: set[str] = set()  # keys of the calls recorded by add()
        self._lock = threading.Lock()
        self._profile = None
        self._outer: Recorder | None = None
        self.start_ns = 0
        self.thread = threading.get_native_id()

    def __enter__(self) -> Recorder:
        self._outer, _local.recorder = _local.recorder, self
        self.thread = threading.get_native_id()
        if not profiler_enabled():
            self._profile = torch.autograd.profiler_legacy.profile()
            self._profile.__enter__()
        self.start_ns = time.time_ns()
        return self

    def __exit__(self, *exc: Any) -> None:
        _local.recorder = self._outer
        if self._profile is None:
            return
        try:
            self._profile.__exit__(None, None, None)
            # The legacy profiler records this thread only: its events get this thread's
            # id, as the calls recorded by add() do.
            own = [
                (e.name, e.time_range.start, e.time_range.end, self.thread, self.node_id)
                for e in self._profile.function_events
                if e.name not in self._calls
            ]
        except Exception:  # the call's result stands; its caller lists fewer events
            log.exception("lightning_distgrad: reading a callee's profile failed")
            return
        with self._lock:
            self.events.extend(own)

    def add(self, key: str, start_ns: int, end_ns: int, duration_us: float, events: tuple) -> None:
        """A call made while recording, and its remote events."""
        call = (key, (start_ns - self.start_ns) / 1000, (end_ns - self.start_ns) / 1000)
        placed = list(_placed(events, key, start_ns, end_ns, duration_us, self.start_ns))
        with self._lock:
            self._calls.add(key)
            self.events.append((*call, self.thread, self.node_id))
            self.events.extend(placed)

    def body(self, call_id: int) -> RemoteEvents:
        with self._lock:
            events = tuple(self.events)
        return RemoteEvents(call_id, (time.time_ns() - self.start_ns) / 1000, events)

    @staticmethod
    def after(result: torch.futures.Future, send: Callable[[], None]) -> torch.futures.Future:
        """A future completed like ``result``, once ``send()`` ran (an async function's
        nested calls deliver their events before its result is ready)."""
        done = torch.futures.Future()

        def forward(f: torch.futures.Future) -> None:
            send()
            try:
                done.set_result(f.wait())
            except BaseException as e:
                set_error(done, e)

        result.add_done_callback(forward)
        return done


class _UnreadKinetoEvents:
    """Remote events of calls made under a Kineto profiler, until its results are read.

    A Kineto profile records the whole process and one runs at a time; a call belongs
    to the profile whose recording window (``perf_counter_ns``) holds its start.
    """

    def __init__(self) -> None:
        self._calls: collections.deque = collections.deque(maxlen=MAX_UNREAD_CALLS)
        self._lock = threading.Lock()

    def add(self, key: str, start_ns: int, end_ns: int, duration_us: float, events: tuple) -> None:
        # When the call started, on the clock of the profiles' recording windows.
        started = time.perf_counter_ns() - (time.time_ns() - start_ns)
        call = (started, key, start_ns, end_ns, duration_us, events)
        with self._lock:
            self._calls.append(call)

    def take(self, first: int | None, last: int | None, base_ns: int, use_device: Any) -> list:
        """FunctionEvents of the calls made from ``first`` to ``last`` (``perf_counter_ns``),
        in us since ``base_ns``; those calls and older ones are forgotten."""
        if first is None or last is None:
            return []
        from torch.autograd.profiler_util import FunctionEvent

        with self._lock:
            calls = [c for c in self._calls if first <= c[0] <= last]
            self._calls = collections.deque(
                (c for c in self._calls if c[0] > last), maxlen=MAX_UNREAD_CALLS
            )
        return [
            FunctionEvent(
                id=-1,
                name=name,
                thread=thread,
                start_us=start,
                end_us=end,
                node_id=node_id,
                is_remote=True,
                use_device=use_device,
                input_shapes=[],
                stack=[],
            )
            for _, key, start_ns, end_ns, duration_us, events in calls
            for name, start, end, thread, node_id in _placed(
                events, key, start_ns, end_ns, duration_us, base_ns
            )
        ]


_unread = _UnreadKinetoEvents()


def _add_unread_remote_events(profile: Any, result: Any, events: list) -> list:
    """``events`` of a Kineto ``profile`` with the remote events of its calls added."""
    first = getattr(profile, "profiling_start_time_ns", None)
    last = getattr(profile, "profiling_end_time_ns", None)
    remote = _unread.take(first, last, result.trace_start_ns(), profile.use_device)
    if not remote:
        return events
    return sorted(events + remote, key=lambda e: [e.time_range.start, -e.time_range.end])


#: Profiled calls waiting for their remote events: (callee, call id) -> (sink, key, start).
_expected: dict[tuple[int, int], tuple] = {}
_collect_remote_events = True


def collect_remote_events(on: bool) -> bool:
    """Whether calls made under a profiler go as PROFILED_REQUESTs from now on; returns
    the previous setting. A merged timeline turns it off: the callee's lane shows its own
    record of every call, and recording it twice would only slow the callee down."""
    global _collect_remote_events
    previous, _collect_remote_events = _collect_remote_events, on
    return previous


def expect_remote_events(dst: int, call_id: int, key: str, future: torch.futures.Future) -> bool:
    """For a call about to be sent under the profiling name ``key``: whether its callee
    should record it (a profiler records this thread); if so, its events are awaited."""
    if not _collect_remote_events or not profiler_enabled():
        return False
    sink = _local.recorder
    if sink is None:
        if not kineto_records_this_thread():
            return False  # a legacy profiler of the user's own: torch offers no way in
        wrap_kineto_results_parser(_add_unread_remote_events)
        sink = _unread
    entry = (sink, key, time.time_ns())
    where = (dst, call_id)
    _expected[where] = entry

    def forget(_: torch.futures.Future) -> None:
        # A call that ends without its events (it timed out, or its request could not be
        # read on the callee) stops waiting for them.
        if _expected.get(where) is entry:
            _expected.pop(where, None)

    future.add_done_callback(forget)
    return True


def _well_formed(body: RemoteEvents) -> bool:
    """Whether a REMOTE_EVENTS body holds what :class:`Recorder` sends (a profile must
    never fail to read because of a frame)."""
    number = (int, float)
    return (
        type(body.duration_us) in number
        and type(body.events) is tuple
        and all(
            type(e) is tuple
            and len(e) == 5
            and type(e[0]) is str
            and type(e[1]) in number
            and type(e[2]) in number
            and type(e[3]) is int
            and type(e[4]) is int
            for e in body.events
        )
    )


def _on_remote_events(source: int, body: RemoteEvents, tensors: list) -> None:
    """A REMOTE_EVENTS frame, applied on arrival (before its call's response)."""
    entry = _expected.pop((source, body.call_id), None) if type(body.call_id) is int else None
    if entry is None:
        return  # the call is over (timed out): nobody lists its events
    if not _well_formed(body):
        log.error("lightning_distgrad: dropped malformed remote events from rank %d", source)
        return
    sink, key, start_ns = entry
    sink.add(key, start_ns, time.time_ns(), body.duration_us, body.events)


register_one_way(Kind.REMOTE_EVENTS, RemoteEvents, _on_remote_events)


# -- The message log of a merged timeline ---------------------------------------------


class MessageLog:
    """Frames and spans recorded while a merged timeline records (on every thread:
    ``torch.profiler`` records only on the thread that started it).

    Entries: ``("send" | "recv", time_ns, kind, peer rank, tag, bytes)`` per frame, where
    ``(sender, receiver, tag)`` names one frame in both logs; ``("span", start_ns,
    end_ns, name, thread id, args)`` per span (``args``: a dict or None). Appending to
    a list is atomic, so threads log without a lock.
    """

    def __init__(self):
        self.entries: list[tuple] = []

    def sent(self, kind: str, dst: int, tag: int, nbytes: int) -> None:
        self.entries.append(("send", time.time_ns(), kind, dst, tag, nbytes))

    def received(self, kind: str, src: int, tag: int, nbytes: int) -> None:
        self.entries.append(("recv", time.time_ns(), kind, src, tag, nbytes))

    def span(
        self, start_ns: int, name: str, args: dict | None = None, tid: int | None = None
    ) -> None:
        """A span from ``start_ns`` until now, on thread ``tid`` (default: this one)."""
        tid = threading.get_native_id() if tid is None else tid
        self.entries.append(("span", start_ns, time.time_ns(), name, tid, args))


_log: MessageLog | None = None


def active_log() -> MessageLog | None:
    """The log of the merged timeline being recorded, or None."""
    return _log


def set_log(log: MessageLog | None) -> None:
    global _log
    _log = log


def recording() -> bool:
    """Whether spans are recorded (a torch profiler on this thread, or a merged timeline)."""
    return _log is not None or profiler_enabled()


@contextlib.contextmanager
def span(name: str, args: dict | None = None) -> Iterator[None]:
    """Record ``name`` for the torch profiler of this thread and the merged timeline
    (which also shows ``args``). Check :func:`recording` first: this costs even when
    nothing records."""
    log, start = _log, time.time_ns()
    if profiler_enabled():
        text = None if args is None else json.dumps(args)
        with torch.autograd.profiler.record_function(name, text):
            yield
    else:
        yield
    if log is not None:
        log.span(start, name, args)


def run_recorded(
    name: str | Callable[[], tuple[str, dict | None]], fn: Callable[..., Any], /, *args, **kwargs
) -> Any:
    """``fn(*args, **kwargs)``, recorded as the span ``name`` while spans are recorded
    (see :func:`recording`); otherwise at the cost of that one check. A name that costs
    to build comes as a function returning ``(name, args)`` (see :func:`span`)."""
    if not recording():
        return fn(*args, **kwargs)
    label, extra = name() if callable(name) else (name, None)
    with span(label, extra):
        return fn(*args, **kwargs)


def span_until(name: str, future: torch.futures.Future) -> torch.futures.Future:
    """Record ``name`` from now until ``future`` completes, on this thread (whichever
    thread completes the future); returns the future to use."""
    log, start = _log, time.time_ns()
    if log is not None:
        tid = threading.get_native_id()
        future.add_done_callback(lambda _: log.span(start, name, None, tid))
    if not profiler_enabled():
        return future
    record = torch.autograd.profiler.record_function(name)
    record.__enter__()
    return end_span_on_future(record, future)
