"""Remote events: what a call's callee records for the caller's torch profiler.

A call made while a torch profiler records its RPCs (see ``spans.recording_rpcs``)
travels as a PROFILED_REQUEST, with the profiler's ``record_shapes`` and
``profile_memory``. Its callee runs it under a profiler of its own with those settings
and sends what that recorded back in a REMOTE_EVENTS frame just before the response
(frames between two workers arrive in the order they were sent), and the caller's
profiler lists those events as torch's RPC profiling does: named ``<call's
key>#remote_op: <event>``, with ``node_id`` the worker that ran them, ``is_remote`` set,
and their input shapes and memory. This works for the legacy
``torch.autograd.profiler_legacy.profile`` that torch's RPC profiling supports (one per
thread) and, inside ``record_rpcs()``, for ``torch.profiler.profile`` and
``torch.autograd.profiler.profile`` (Kineto, which records one profile at a time).
Other calls send plain REQUESTs: the only cost to them is one check.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.autograd.profiler_legacy  # an attribute of torch.autograd once imported

from ..._compat import (
    kineto_records_this_thread,
    legacy_profile_start_ns,
    profiler_enabled,
    watch_torch_profilers,
    wrap_kineto_results_parser,
)
from .._transport import Kind
from .errors import set_error
from .one_way import register_one_way

log = logging.getLogger("lightning_distgrad.rpc")

#: torch's separator between a call's profiling key and the name of a remote event.
REMOTE_OP_STR = "#remote_op: "
#: Calls whose remote events wait for a Kineto profiler's results to be read (the oldest
#: are dropped beyond this: a profiler whose results are never read keeps none forever).
MAX_UNREAD_CALLS = 20_000
#: What a callee's profiler records besides times: ``(record_shapes, profile_memory)``.
NO_OPTIONS = (False, False)


def _options_of(profile: Any) -> tuple[bool, bool]:
    """What a torch profile records besides times, for its calls' callees."""
    return (
        bool(getattr(profile, "record_shapes", False)),
        bool(getattr(profile, "profile_memory", False)),
    )


class RemoteEvents(NamedTuple):
    """Body of a REMOTE_EVENTS frame: what the callee recorded of call ``call_id``.

    ``events``: ``(name, start_us, end_us, thread, node_id, input_shapes,
    cpu_memory_usage)`` tuples, times since the callee began the call; ``duration_us``:
    from then until the events were sent.
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
    for name, start, end, *rest in events:
        yield (f"{key}{REMOTE_OP_STR}{name}", shift + start, shift + end, *rest)


def in_profile_order(events: list) -> list:
    """``events`` (FunctionEvents) in the order torch's profiles list them: by start, an
    event before those it encloses."""
    return sorted(events, key=lambda e: [e.time_range.start, -e.time_range.end])


def _function_events(calls: list, base_ns: int, use_device: Any, legacy: bool) -> list:
    """FunctionEvents of ``calls`` (``(key, start_ns, end_ns, duration_us, events)``), in us
    since ``base_ns``, as a profile (``legacy``: a legacy one) lists remote events."""
    from torch.autograd.profiler_util import FunctionEvent

    return [
        FunctionEvent(
            id=-1,
            name=name,
            trace_name=name,
            thread=thread,
            start_us=start,
            end_us=end,
            node_id=node_id,
            is_remote=True,
            is_legacy=legacy,
            use_device=use_device,
            input_shapes=list(shapes),
            cpu_memory_usage=memory,
            stack=[],
        )
        for key, start_ns, end_ns, duration_us, events in calls
        for name, start, end, thread, node_id, shapes, memory in _placed(
            events, key, start_ns, end_ns, duration_us, base_ns
        )
    ]


class _Local(threading.local):
    # Class defaults: no AttributeError when unset.
    recorder: Recorder | None = None
    legacy: _LegacyCalls | None = None  # the legacy profile recording this thread


_local = _Local()


class Recorder:
    """Records a PROFILED_REQUEST on its callee (see :meth:`Serving._call_profiled`).

    Inside ``with recorder:`` torch's legacy profiler records this thread with the
    caller's ``options`` (Kineto allows one profiler per process; the legacy one is per
    thread), unless a profiler records it already. Calls the run makes deliver their
    remote events here (:meth:`add`), so that nested calls come back nested, as in torch,
    and travel with the same options; each such call is recorded here from its send to
    its events' arrival (an async function's calls end after the legacy profiler
    stopped, which then drops them).
    """

    def __init__(self, node_id: int, options: tuple[bool, bool] = NO_OPTIONS):
        self.node_id = node_id
        self.options = options
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
            record_shapes, profile_memory = self.options
            self._profile = torch.autograd.profiler_legacy.profile(
                record_shapes=record_shapes, profile_memory=profile_memory
            )
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
                (
                    e.name,
                    e.time_range.start,
                    e.time_range.end,
                    self.thread,
                    self.node_id,
                    list(e.input_shapes or ()),
                    int(e.cpu_memory_usage),
                )
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
            self.events.append((*call, self.thread, self.node_id, [], 0))
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


def recording_for_caller() -> bool:
    """Whether this thread records a call for the caller's profiler (see :class:`Recorder`)."""
    return _local.recorder is not None


class _UnreadKinetoEvents:
    """Remote events of calls made under a Kineto profiler, until its results are read.

    A Kineto profile records the whole process and one runs at a time; a call belongs
    to the profile whose recording window (``perf_counter_ns``) holds its start.
    ``options``: those of the Kineto profile started last.
    """

    def __init__(self) -> None:
        self._calls: collections.deque = collections.deque(maxlen=MAX_UNREAD_CALLS)
        self._lock = threading.Lock()
        self.options = NO_OPTIONS

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
        with self._lock:
            calls = [c[1:] for c in self._calls if first <= c[0] <= last]
            self._calls = collections.deque(
                (c for c in self._calls if c[0] > last), maxlen=MAX_UNREAD_CALLS
            )
        return _function_events(calls, base_ns, use_device, legacy=False)


_unread = _UnreadKinetoEvents()


def _add_unread_remote_events(profile: Any, result: Any, events: list) -> list:
    """``events`` of a Kineto ``profile`` with the remote events of its calls added."""
    first = getattr(profile, "profiling_start_time_ns", None)
    last = getattr(profile, "profiling_end_time_ns", None)
    remote = _unread.take(first, last, result.trace_start_ns(), profile.use_device)
    return in_profile_order(events + remote) if remote else events


class _LegacyCalls:
    """Remote events of the calls made under the legacy profile that records this
    thread (a legacy profile records the thread that started it, until that thread
    stops it)."""

    def __init__(self, options: tuple[bool, bool]):
        self.options = options
        self._calls: list[tuple] = []
        self._lock = threading.Lock()

    def add(self, key: str, start_ns: int, end_ns: int, duration_us: float, events: tuple) -> None:
        with self._lock:
            self._calls.append((key, start_ns, end_ns, duration_us, events))

    def take(self, base_ns: int) -> list:
        with self._lock:
            calls, self._calls = self._calls, []
        return _function_events(calls, base_ns, None, legacy=True)


def _on_profiler_start(profile: Any, legacy: bool) -> None:
    """A torch profile started recording on this thread: note what its calls' callees
    record (and, for a legacy one, where its remote events go)."""
    if legacy:
        _local.legacy = _LegacyCalls(_options_of(profile))
    else:
        _unread.options = _options_of(profile)


def _add_legacy_remote_events(records: list, events: list) -> list:
    """``events`` parsed from the ``records`` of the legacy profile that this thread
    stops, with the remote events of its calls added."""
    calls, _local.legacy = _local.legacy, None
    if calls is None:
        return events
    start_ns = legacy_profile_start_ns(records)  # legacy events count from there, in us
    remote = calls.take(start_ns) if start_ns is not None else []
    return in_profile_order(events + remote) if remote else events


def watch_profilers() -> None:
    """Follow the torch profiles that start from now on (at ``init_rpc``; again is free)."""
    watch_torch_profilers(_on_profiler_start, _add_legacy_remote_events)


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


def expect_remote_events(
    dst: int, call_id: int, key: str, future: torch.futures.Future
) -> tuple[bool, bool] | None:
    """For a call about to be sent under the profiling name ``key``: if its callee should
    record it (a profiler records this thread), what the callee's profiler records
    (``(record_shapes, profile_memory)``), and its events are awaited; else None."""
    if not _collect_remote_events or not profiler_enabled():
        return None
    sink = _local.recorder
    if sink is None:
        if kineto_records_this_thread():
            wrap_kineto_results_parser(_add_unread_remote_events)
            sink = _unread
        else:
            sink = _local.legacy
            if sink is None:
                return None  # a legacy profiler that did not start through its class
    entry = (sink, key, time.time_ns())
    where = (dst, call_id)
    _expected[where] = entry

    def forget(_: torch.futures.Future) -> None:
        # A call that ends without its events (it timed out, or its request could not be
        # read on the callee) stops waiting for them.
        if _expected.get(where) is entry:
            _expected.pop(where, None)

    future.add_done_callback(forget)
    return sink.options


def _is_options(options: Any) -> bool:
    return type(options) is tuple and len(options) == 2 and all(type(o) is bool for o in options)


def profiled_request_body(options: tuple[bool, bool], body: Any) -> tuple:
    """The body of a PROFILED_REQUEST: the callee's profiler ``options``, then the body
    that the call would carry as a REQUEST."""
    return (options, body)


def split_profiled_request_body(body: Any) -> tuple[tuple[bool, bool], Any]:
    """``(options, request body)`` of a PROFILED_REQUEST; ValueError if malformed."""
    if type(body) is not tuple or len(body) != 2 or not _is_options(body[0]):
        raise ValueError("malformed PROFILED_REQUEST: its body holds no profiler options")
    return body


def _well_formed(body: RemoteEvents) -> bool:
    """Whether a REMOTE_EVENTS body holds what :class:`Recorder` sends (a profile must
    never fail to read because of a frame)."""
    number = (int, float)
    return (
        type(body.duration_us) in number
        and type(body.events) is tuple
        and all(
            type(e) is tuple
            and len(e) == 7
            and type(e[0]) is str
            and type(e[1]) in number
            and type(e[2]) in number
            and type(e[3]) is int
            and type(e[4]) is int
            and type(e[5]) in (list, tuple)
            and type(e[6]) is int
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
