"""What the RPC layer records for profilers: torch profiler spans, also in a merged timeline.

Spans use torch's RPC profiling names (``rpc_sync#aten::add(worker0 -> worker1)``); what
a call's callee records for the caller's profiler is in ``remote_events``. While a merged
timeline records, spans also go to its message log (``_transport.message_log``).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..._compat import (
    end_span_on_future,
    find_builtin,
    kineto_records_this_thread,
    profiler_enabled,
)
from .._transport import active_log

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


def recording() -> bool:
    """Whether spans are recorded (a torch profiler on this thread, or a merged timeline)."""
    return active_log() is not None or profiler_enabled()


_rpc_scopes = 0  # open record_rpcs() scopes in this process
_rpc_scopes_lock = threading.Lock()


@contextlib.contextmanager
def record_rpcs() -> Iterator[None]:
    """Inside, ``torch.profiler.profile`` and ``torch.autograd.profiler.profile`` record
    RPCs too, with what their callees ran; outside, as in PyTorch, only the legacy
    ``torch.autograd.profiler_legacy.profile`` does. For the whole process while any such
    scope is open, on every thread. ``DistAutogradStrategy`` opens one for its runs, so
    Lightning's ``PyTorchProfiler`` lists RPCs.

    Example::
        Run with ``mpiexec -n 2 python -m mpi4py example.py``:

        >>> # xdoctest: +SKIP
        >>> from lightning_distgrad.profiler import record_rpcs
        >>> with record_rpcs(), torch.profiler.profile() as prof:
        ...     rpc.rpc_sync("worker1", torch.add, (torch.ones(2), 1))
        >>> print(prof.key_averages().table())  # rpc_sync#aten::add(worker0 -> worker1)...
    """
    global _rpc_scopes
    with _rpc_scopes_lock:
        _rpc_scopes += 1
    try:
        yield
    finally:
        with _rpc_scopes_lock:
            _rpc_scopes -= 1


def recording_rpcs() -> bool:
    """Whether RPCs are recorded: in a merged timeline; by the legacy profiler, as torch
    records them; by a Kineto profiler only inside :func:`record_rpcs`, since torch's
    RPC profiling leaves Kineto's profiles without RPC events."""
    if active_log() is not None:
        return True
    return profiler_enabled() and (_rpc_scopes > 0 or not kineto_records_this_thread())


@contextlib.contextmanager
def span(name: str, args: dict | None = None) -> Iterator[None]:
    """Record ``name`` for the torch profiler of this thread and the merged timeline
    (which also shows ``args``). Check :func:`recording` first: this costs even when
    nothing records."""
    log, start = active_log(), time.time_ns()
    if profiler_enabled():
        text = None if args is None else json.dumps(args)
        with torch.autograd.profiler.record_function(name, text):
            yield
    else:
        yield
    if log is not None:
        log.span(start, name, args)


def run_recorded(
    name: str | Callable[[], tuple[str, dict | None] | None],
    fn: Callable[..., Any],
    /,
    *args,
    **kwargs,
) -> Any:
    """``fn(*args, **kwargs)``, recorded as the span ``name`` while spans are recorded
    (see :func:`recording`); otherwise at the cost of that one check. A name that costs
    to build comes as a function returning ``(name, args)`` (see :func:`span`), or None
    for no span."""
    if not recording():
        return fn(*args, **kwargs)
    named = name() if callable(name) else (name, None)
    if named is None:
        return fn(*args, **kwargs)
    label, extra = named
    with span(label, extra):
        return fn(*args, **kwargs)


def span_until(name: str, future: torch.futures.Future) -> torch.futures.Future:
    """Record ``name`` from now until ``future`` completes, on this thread (whichever
    thread completes the future); returns the future to use."""
    log, start = active_log(), time.time_ns()
    if log is not None:
        tid = threading.get_native_id()
        future.add_done_callback(lambda _: log.span(start, name, None, tid))
    if not profiler_enabled():
        return future
    record = torch.autograd.profiler.record_function(name)
    record.__enter__()
    return end_span_on_future(record, future)
