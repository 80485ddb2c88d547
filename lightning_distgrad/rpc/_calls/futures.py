"""``torch.futures.collect_all`` and ``wait_all`` that end at a failed RPC, as torch's do.

torch documents that ``wait_all`` "will exit early and report the error" when one of its
futures fails. torch's RPC futures fail inside C++, where its ``collect_all`` sees it. A
failed RPC future of this package holds its error as a Python-level result (see
``errors.set_error``: each ``wait()`` raises a fresh copy of the remote error, with its
type), which torch's ``collect_all`` takes for a value: it would wait for every other
future. :func:`install` wraps both functions on import of ``lightning_distgrad.rpc``;
for lists without a future of this package they call torch's own, unchanged.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

import torch

from . import dispatch
from .errors import set_error
from .waiting import UserFuture

__all__ = ["collect_all", "install", "wait_all"]

_torch_collect_all = torch.futures.collect_all
_torch_wait_all = torch.futures.wait_all


class _Collector:
    """Completes ``result`` with ``futures`` once all are done, or with the first error."""

    def __init__(self, futures: list, result: torch.futures.Future):
        self._futures = futures
        self._result = result
        self._left = len(futures)
        self._finished = False
        self._lock = threading.Lock()

    def on_done(self, future: torch.futures.Future) -> None:
        try:
            future.wait()  # done: returns at once, or raises the future's error
        except Exception as e:
            with self._lock:
                if self._finished:
                    return
                self._finished = True
            # Without its traceback, which references this collector and so the result.
            set_error(self._result, e.with_traceback(None))
            return
        with self._lock:
            self._left -= 1
            if self._left or self._finished:
                return
            self._finished = True
        self._result.set_result(self._futures)


def _has_rpc_future(futures: list) -> bool:
    return any(isinstance(f, UserFuture) for f in futures)


@functools.wraps(_torch_collect_all)
def collect_all(futures: Sequence[torch.futures.Future]) -> torch.futures.Future:
    futures = list(futures)
    if not _has_rpc_future(futures):
        return _torch_collect_all(futures)
    result: torch.futures.Future = torch.futures.Future()
    if not futures:
        result.set_result([])
        return result
    collector = _Collector(futures, result)
    for future in futures:
        future.add_done_callback(collector.on_done)
    return result


@functools.wraps(_torch_wait_all)
def wait_all(futures: Sequence[torch.futures.Future]) -> list:
    futures = list(futures)
    if not _has_rpc_future(futures):
        return _torch_wait_all(futures)
    # dispatch.wait: this thread polls MPI meanwhile, as rpc_sync does.
    return [future.wait() for future in dispatch.wait(collect_all(futures))]


def install() -> None:
    """Make ``torch.futures.collect_all``/``wait_all`` these (idempotent).

    Example::

        >>> import torch
        >>> install()
        >>> torch.futures.wait_all is wait_all
        True
    """
    torch.futures.collect_all = collect_all
    torch.futures.wait_all = wait_all
