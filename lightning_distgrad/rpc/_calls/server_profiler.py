"""Server-side process-global profiling: ``rpc._server_process_global_profile``.

As in torch, a profiling range entered on a worker (usually through an RRef to a
``_server_process_global_profile`` that a caller created there) records every request
that the worker serves while the range is open, on whichever thread serves it: each
request runs under the legacy profiler of its thread, with the settings of the innermost
open range, and its records go to every range open when it started. Ranges nest.

The only cost to a request while no range is open is one check.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.profiler_legacy  # an attribute of torch.autograd once imported

from ..._compat import (
    disable_legacy_profiler,
    enable_legacy_profiler,
    parse_legacy_records,
    profiler_enabled,
)
from .remote_events import in_profile_order

__all__ = [
    "_disable_server_process_global_profiler",
    "_enable_server_process_global_profiler",
    "_server_process_global_profile",
]


class _Range:
    """One open profiling range: its torch ``ProfilerConfig`` and the records of the
    requests served while it was open (one ``list[list[ProfilerEvent]]`` each)."""

    def __init__(self, config: Any):
        self.config = config
        self.results: list[list] = []
        self._lock = threading.Lock()

    def push(self, records: list) -> None:
        with self._lock:
            self.results.append(records)

    def take(self) -> list[list]:
        with self._lock:
            results, self.results = self.results, []
        return results


#: The open ranges, innermost last. Replaced, never changed in place: a request reads it
#: without a lock.
ranges: tuple[_Range, ...] = ()
_ranges_lock = threading.Lock()
_local = threading.local()


def _enable_server_process_global_profiler(new_config: Any) -> None:
    """Open a profiling range with ``new_config`` (a ``torch.autograd.ProfilerConfig``)."""
    global ranges
    with _ranges_lock:
        ranges = (*ranges, _Range(new_config))


def _disable_server_process_global_profiler() -> list[list]:
    """Close the innermost range; returns the records of the requests it saw."""
    global ranges
    with _ranges_lock:
        if not ranges:
            raise RuntimeError("Profiler is not enabled: no server-side profiling range is open.")
        closed, ranges = ranges[-1], ranges[:-1]
    return closed.take()


def forget_open_ranges() -> None:
    """Drop the ranges an earlier RPC session left open (at ``init_rpc``): their profiles
    were never closed, and their requests are gone with that session."""
    global ranges
    with _ranges_lock:
        ranges = ()


def serving_profiled() -> bool:
    """Whether this thread serves a request that the open ranges record."""
    return getattr(_local, "serving", False)


def run_profiled(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, the run of one request, recorded for the ranges open now."""
    open_ranges = ranges
    if not open_ranges or profiler_enabled():
        return fn(*args)  # a thread records under one legacy profiler at a time
    enable_legacy_profiler(open_ranges[-1].config)
    _local.serving = True
    try:
        return fn(*args)
    finally:
        _local.serving = False
        records = disable_legacy_profiler()
        for profiling_range in open_ranges:
            profiling_range.push(records)


class _server_process_global_profile(torch.autograd.profiler_legacy.profile):  # noqa: N801
    """``torch.autograd.profiler_legacy.profile`` for every request this worker serves,
    on any thread, while it is entered (torch's ``rpc._server_process_global_profile``).

    On exit, ``function_events`` lists them all and ``process_global_function_events``
    holds one list of events per request.

    Example::
        >>> # xdoctest: +SKIP
        >>> profile = rpc.remote("worker1", rpc._server_process_global_profile)
        >>> profile.rpc_sync().__enter__()
        >>> rpc.rpc_sync("worker1", torch.add, (torch.ones(2), 1))
        >>> profile.rpc_sync().__exit__(None, None, None)
        >>> print(profile.rpc_sync().key_averages())  # aten::add, as worker1 ran it
    """

    def __enter__(self) -> _server_process_global_profile | None:
        if not self.enabled:
            return None
        if self.entered:
            raise RuntimeError("autograd profiler traces are not reentrant")
        self.entered = True
        _enable_server_process_global_profiler(self.config())
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> bool:
        if not self.enabled:
            return False
        per_request = []
        for records in _disable_server_process_global_profiler():
            per_request.append(in_profile_order(parse_legacy_records(records)))
        self.function_events = torch.autograd.profiler_util.EventList(
            list(itertools.chain.from_iterable(per_request)),
            use_device="cuda" if self.use_cuda else None,
            profile_memory=self.profile_memory,
        )
        self.function_events._build_tree()
        self.process_global_function_events = per_request
        return False
