"""The message log of a merged timeline: every frame sent and received, and spans.

On only while ``lightning_distgrad.profiler`` records a merged timeline (:func:`set_log`): then
the transport notes every frame sent and received (time, peer, per-pair sequence, bytes), so
that a merged timeline can draw each message from its send to its receipt.
"""

from __future__ import annotations

import threading
import time


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
