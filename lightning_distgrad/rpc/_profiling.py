"""What the RPC layer records for profilers: torch profiler spans and a message log.

Spans use torch's RPC profiling names (``rpc_sync#aten::add(worker0 -> worker1)``).
The message log, on only while ``lightning_distgrad.profiler.profile`` records,
notes every frame sent and received (time, peer, per-pair sequence, bytes), so
that a merged timeline can draw each message from its send to its receipt.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import torch

#: Whether a torch profiler records on this process (a C call: cheap on every RPC).
from .._compat import profiler_enabled


def profiling_key(mode: str, func: Callable, route: str) -> str:
    """torch's RPC profiling name: ``rpc_<mode>#<operator or qualname>(<route>)``, where
    ``route`` is ``"<caller> -> <callee>"``."""
    try:
        name = torch.jit._builtins._find_builtin(func)
    except Exception:
        name = None
    name = name or getattr(func, "__qualname__", None) or repr(func)
    return f"rpc_{mode}#{name}({route})"


class MessageLog:
    """Frames and spans recorded while a merged timeline records (on every thread:
    ``torch.profiler`` records only on the thread that started it).

    Entries: ``("send" | "recv", time_ns, kind, peer rank, tag, bytes)`` per frame, where
    ``(sender, receiver, tag)`` names one frame in both logs; ``("span", start_ns,
    end_ns, name, thread id)`` per span. Appending to a list is atomic, so threads log
    without a lock.
    """

    def __init__(self):
        self.entries: list[tuple] = []

    def sent(self, kind: str, dst: int, tag: int, nbytes: int) -> None:
        self.entries.append(("send", time.time_ns(), kind, dst, tag, nbytes))

    def received(self, kind: str, src: int, tag: int, nbytes: int) -> None:
        self.entries.append(("recv", time.time_ns(), kind, src, tag, nbytes))

    def span(self, start_ns: int, name: str) -> None:
        self.entries.append(("span", start_ns, time.time_ns(), name, threading.get_native_id()))


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
def span(name: str) -> Iterator[None]:
    """Record ``name`` for the torch profiler of this thread and the merged timeline.
    Check :func:`recording` first: this costs even when nothing records."""
    log, start = _log, time.time_ns()
    if profiler_enabled():
        with torch.autograd.profiler.record_function(name):
            yield
    else:
        yield
    if log is not None:
        log.span(start, name)


def span_until(name: str, future: torch.futures.Future) -> torch.futures.Future:
    """Record ``name`` from now until ``future`` completes; returns the future to use."""
    log, start = _log, time.time_ns()
    if log is not None:
        future.add_done_callback(lambda _: log.span(start, name))
    if not profiler_enabled():
        return future
    record = torch.autograd.profiler.record_function(name)
    record.__enter__()
    return record._call_end_callbacks_on_future(future)
