"""Receive buffers: page-aligned, huge-page backed when big, pooled for reuse.

A fresh big buffer costs page faults on first touch, as much as moving its
bytes; a pooled one costs nothing. Big buffers sit on transparent huge pages:
a single copy into or out of them (MPICH's CMA pull, or a pushing sender, see
``direct_writes``) walks 512 times fewer pages.
"""

from __future__ import annotations

import collections
import contextlib
import math
import mmap
import os
import sys
import time

import numpy as np
import torch

__all__ = ["ReceiveBufferPool"]

#: Receive buffers at least this big are pooled (see :class:`ReceiveBufferPool`).
POOL_MIN_BYTES = 1 << 20


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX
        return 0


#: At most this many bytes of pooled receive buffers, in use or free: a quarter of the
#: machine's memory (a 4 GiB message is pooled on a 16 GiB machine), at least 512 MiB.
POOL_MAX_BYTES = max(512 << 20, _physical_memory() // 4)
#: A pooled buffer that no tensor used for this long is freed: longer than a round trip
#: of the biggest pooled message takes (seconds), as allocators' page caches keep memory.
POOL_IDLE_S = 10.0
#: Pooled receive buffers start on a page boundary: MPICH's single-copy (CMA)
#: path fills misaligned buffers several times slower.
BUFFER_ALIGN = 4096
#: Receive buffers this big are backed by transparent huge pages (rounded up to whole
#: ones: a buffer of 1 MiB takes a 2 MiB page).
HUGE_MIN_BYTES = 1 << 20
HUGE_PAGE_BYTES = 2 << 20


class ReceiveBufferPool:
    """Reuses big receive buffers once no tensor uses them any more.

    A buffer is a numpy array that every tensor made from it keeps alive, so it
    is free again exactly when its reference count drops back to the pool's own
    reference. At most ``max_bytes`` are pooled (free buffers of other sizes make
    room for a new one); a buffer free for ``idle_s`` is released by
    :meth:`trim`. Not thread-safe: the transport calls it under its MPI lock,
    except :meth:`owns`.

    Example::
        >>> pool = ReceiveBufferPool(min_bytes=1 << 20, max_bytes=8 << 20)
        >>> a = pool.take(2 << 20)
        >>> first = a.ctypes.data
        >>> b = pool.take(2 << 20)  # ``a`` is in use: another buffer
        >>> del a
        >>> pool.take(2 << 20).ctypes.data == first
        True
    """

    def __init__(
        self,
        min_bytes: int = POOL_MIN_BYTES,
        max_bytes: int = POOL_MAX_BYTES,
        idle_s: float = POOL_IDLE_S,
    ):
        self.min_bytes = min_bytes
        self.max_bytes = max_bytes
        self.idle_s = idle_s
        self.pooled_bytes = 0
        #: When :meth:`trim` has something to do at the earliest (inf: the pool is empty).
        self.next_trim = math.inf
        # (start, end) address of every pooled buffer, replaced whole on each change: any
        # thread may read it without the lock (see :meth:`owns`).
        self._ranges: tuple[tuple[int, int], ...] = ()
        # Per size: [buffer, when it was last seen in use].
        self._by_size: dict[int, list[list]] = collections.defaultdict(list)

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of ``nbytes`` that no tensor uses: a free pooled one, else a new one."""
        now = time.monotonic()
        for entry in self._by_size.get(nbytes, ()):
            if _unused(entry):
                entry[1] = now
                return entry[0]
        buf = _aligned_empty(nbytes)
        if self.pooled_bytes + nbytes > self.max_bytes:
            self._release(now, idle_s=0.0)  # the sizes in use now take precedence
        if self.pooled_bytes + nbytes <= self.max_bytes:
            self._by_size[nbytes].append([buf, now])
            self.pooled_bytes += nbytes
            self.next_trim = min(self.next_trim, now + self.idle_s)
            start = buf.ctypes.data
            self._ranges += ((start, start + nbytes),)
        return buf

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s bytes lie in a pooled buffer (safe from any thread)."""
        ptr = t.data_ptr()
        return any(start <= ptr < end for start, end in self._ranges)

    def trim(self, now: float) -> None:
        """Free the buffers no tensor used for ``idle_s`` (call now and then)."""
        self._release(now, self.idle_s)
        self.next_trim = now + self.idle_s / 2 if self.pooled_bytes else math.inf

    def _release(self, now: float, idle_s: float) -> None:
        for nbytes, entries in list(self._by_size.items()):
            kept = []
            for entry in entries:
                if not _unused(entry):
                    entry[1] = now
                    kept.append(entry)
                elif now - entry[1] < idle_s:
                    kept.append(entry)
                else:
                    self.pooled_bytes -= nbytes
            if kept:
                self._by_size[nbytes] = kept
            else:
                del self._by_size[nbytes]
        self._ranges = tuple(
            (e[0].ctypes.data, e[0].ctypes.data + n) for n, es in self._by_size.items() for e in es
        )


def _unused(entry: list) -> bool:
    # References to the buffer: the pool's entry and getrefcount's argument.
    return sys.getrefcount(entry[0]) == 2


def _aligned_empty(nbytes: int, align: int = BUFFER_ALIGN) -> np.ndarray:
    """An uninitialised uint8 array whose data starts at a multiple of ``align``; from
    HUGE_MIN_BYTES on, a mapping of its own that asks for transparent huge pages."""
    if nbytes >= HUGE_MIN_BYTES and align <= mmap.PAGESIZE:
        size = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with contextlib.suppress(AttributeError, OSError):  # no THP: 4 KiB pages
            mapping.madvise(mmap.MADV_HUGEPAGE)
        # Unmapped once the last view is gone.
        return np.frombuffer(mapping, dtype=np.uint8, count=nbytes)
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + nbytes]
