"""CUDA tensors on the wire: CUDA IPC between ranks of a node, pinned host staging otherwise.

A CUDA tensor sent with a device map travels one of two ways:

* **IPC**, to a peer of this node that passed the probe at ``init_rpc`` (:func:`ipc_peers`):
  its meta carries torch's IPC export of its storage (:class:`Exporter`), and no bytes
  move through MPI. The receiver opens the export and copies it to the mapped device with a
  device-to-device copy, ordered after the sender's stream by the export's interprocess
  event.
* **Staged**, to any other peer: the sender copies the tensor into pinned host memory
  (waiting for that copy alone, :func:`to_pinned_host`), MPI moves the bytes into a pinned
  buffer, and the receiver copies them to the mapped device.

The receiver's copies run on a copy stream per device (:class:`DeviceCopies`), after the
work queued on the device's default stream, and the frame is handed over once they
finished on the GPU (polled with ``Event.query``, never waited for): a remote function, or
a caller's ``wait()``, sees complete tensors and may use them on any stream. They are
allocated on their device's default stream. The sender's
memory stays allocated until the receiver released its import (torch's IPC reference
counter). torch keeps bookkeeping for each export of a storage until the storage is freed,
so a storage is exported once: sent again, it travels as a fresh copy.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import Any

import torch
from mpi4py import MPI

from ..._compat import open_cuda_storage, share_cuda_storage
from .tensor_bytes import INLINE_LIMIT, describe_host_tensor, meta_with, plain_contiguous

#: Set to "0" (on every rank) to stage every CUDA tensor through host memory.
IPC_ENV = "LIGHTNING_DISTGRAD_CUDA_IPC"
#: First item of a meta's inline slot that holds an IPC export: ``(IPC, share, offset)``.
IPC = "cuda-ipc"
#: Types of the fields of torch's export (see ``_compat.share_cuda_storage``).
_SHARE_TYPES = (int, bytes, int, int, bytes, int, bytes, bool)


def ipc_peers(comm: MPI.Comm, cuda_ranks: frozenset[int]) -> frozenset[int]:
    """The ranks of ``comm`` that import this rank's CUDA tensors over CUDA IPC.

    Those of this node where both ranks are in ``cuda_ranks`` (they set or are named in a
    device map) and see a GPU, ``LIGHTNING_DISTGRAD_CUDA_IPC`` is not ``0``, and the peer
    read back the right value from a probe tensor exported here. A collective over ``comm``.
    """
    me = comm.Get_rank()
    wanted = me in cuda_ranks and os.environ.get(IPC_ENV, "1") != "0"
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        probe = export = None
        if wanted and torch.cuda.is_available():
            # Any failure here must still reach both collectives below: peers wait there.
            try:
                probe = torch.full((1,), me, dtype=torch.int64, device=torch.cuda.current_device())
                export = (IPC, share_cuda_storage(probe.untyped_storage()), 0)
            except RuntimeError:  # no usable GPU, or IPC not permitted here
                export = None
        exports = node.allgather((me, export))
        readable = set()
        if export is not None:
            for rank, theirs in exports:
                if rank != me and theirs is not None and _reads_back(theirs, rank):
                    readable.add(rank)
        # Every import was released before the probes are freed: this is a collective too.
        readers = node.allgather(readable)
        pairs = zip(exports, readers, strict=True)
        return frozenset(rank for (rank, _), read in pairs if me in read)
    finally:
        node.Free()


def _reads_back(export: tuple, value: int) -> bool:
    try:
        return int(import_tensor(export, torch.int64, (1,)).item()) == value
    except RuntimeError:  # another node's GPU, or IPC refused
        return False


def export_problem(inline: Any) -> str | None:
    """Why a received meta's inline slot is not a well-formed IPC export (None if it is)."""
    if type(inline) is not tuple or len(inline) != 3 or inline[0] != IPC:
        return "its inline slot is neither bytes nor an IPC export"
    _, share, offset = inline
    if type(share) is not tuple or len(share) != len(_SHARE_TYPES):
        return "its IPC export is not torch's 8-field export"
    if not all(type(v) is t for v, t in zip(share, _SHARE_TYPES, strict=True)):
        return "its IPC export has fields of the wrong types"
    if type(offset) is not int or offset < 0 or share[0] < 0:
        return "its IPC export names a negative device or offset"
    return None


def import_tensor(export: tuple, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """The tensor an IPC export describes (the sender's memory, mapped here). Its creation
    makes the current stream wait for the sender's event."""
    _, share, offset = export
    storage = open_cuda_storage(*share)
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    device = torch.device("cuda", share[0])
    return torch.empty(0, dtype=dtype, device=device).set_(
        storage, offset, shape, tuple(reversed(strides))
    )


class Exporter:
    """IPC exports of CUDA tensors, each storage exported at most once (safe from any
    thread)."""

    def __init__(self):
        self._exported: weakref.WeakSet = weakref.WeakSet()
        self._lock = threading.Lock()

    def export(self, t: torch.Tensor) -> tuple:
        """``(IPC, torch's export, storage offset)`` of contiguous ``t`` (no lazy conjugate
        or negative bit, see ``tensor_bytes.plain_contiguous``), ready for the work queued so far
        on ``t``'s device's current stream (the export's event)."""
        storage = t.untyped_storage()
        with self._lock:
            again = storage in self._exported
            if not again:
                self._exported.add(storage)
        if again:
            t = t.clone()
            storage = t.untyped_storage()
        with torch.cuda.device(t.device):
            return (IPC, share_cuda_storage(storage), t.storage_offset())


def describe_cuda_tensor(t: torch.Tensor, device: str, exporter: Exporter | None) -> tuple:
    """Describe CUDA tensor ``t`` for the wire, to land on ``device`` at the receiver: as its
    IPC export when ``exporter`` is given (the receiver imports this rank's exports) and ``t``
    lands on a GPU, else staged through host memory. Returns (meta, host tensor to send as a
    buffer, or None), as ``tensor_bytes.describe_host_tensor``."""
    if exporter is not None and device != "cpu" and t.is_cuda and t.numel():
        return meta_with(t, exporter.export(plain_contiguous(t.detach())), device), None
    host = to_pinned_host(t) if t.nbytes > INLINE_LIMIT else t.cpu()
    return describe_host_tensor(host, device)


def to_pinned_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of CUDA tensor ``t`` in pinned host memory, complete on return: this waits for
    the copy (after the work queued on ``t``'s device's current stream), not for the whole
    device."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(t.device))
    done.synchronize()
    return host


class Copy:
    """A copy queued on a copy stream: finished once ``event`` completed; ``source`` (what
    it reads) and ``target`` (what it writes) are released then."""

    __slots__ = ("event", "source", "target", "release_on")

    def __init__(self, event, source: torch.Tensor, target: torch.Tensor, release_on=None):
        self.event = event
        self.source = source
        self.target = target
        # For an IPC import: a stream with no work. Releasing an import synchronises the
        # current stream; with this one current, that returns at once.
        self.release_on = release_on

    def release(self) -> None:
        self.target = None
        if self.release_on is None:
            self.source = None
            return
        with torch.cuda.stream(self.release_on):
            self.source = None

    def __del__(self) -> None:
        # Dropped unfinished (its frame failed, or the agent stopped): the memory it writes
        # must not be handed out again while it still does.
        if self.target is not None:
            with contextlib.suppress(Exception):
                self.event.synchronize()


class DeviceCopies:
    """Copies of received tensors onto their mapped GPUs, on a copy stream per device; used
    under the transport's lock."""

    def __init__(self):
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._idle_streams: dict[torch.device, torch.cuda.Stream] = {}

    def import_ipc(self, export: tuple, dtype: torch.dtype, shape: tuple, device: str) -> tuple:
        """(tensor on ``device``, its :class:`Copy`) for an IPC export."""
        source = torch.device("cuda", export[1][0])
        out, stream = self._target(dtype, shape, device)
        with torch.cuda.stream(_stream(self._copy_streams, source)), torch.cuda.stream(stream):
            shared = import_tensor(export, dtype, shape)
            out.copy_(shared, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return out, Copy(done, shared, out, _stream(self._idle_streams, source))

    def upload(self, host: torch.Tensor, device: str) -> tuple:
        """(tensor on ``device``, its :class:`Copy`) for received host bytes."""
        out, stream = self._target(host.dtype, tuple(host.shape), device)
        with torch.cuda.stream(stream):
            out.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return out, Copy(done, host, out)

    def _target(self, dtype: torch.dtype, shape: tuple, device: str) -> tuple:
        """An empty tensor on ``device``'s default stream, and that device's copy stream,
        ready to write it."""
        target = torch.device(device)
        if target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        default = torch.cuda.default_stream(target)
        with torch.cuda.stream(default):
            out = torch.empty(shape, dtype=dtype, device=target)
        stream = _stream(self._copy_streams, target)
        # The allocator hands out memory that work queued on the default stream may still
        # use (it orders reuse by that stream alone): the copy waits for that work. The
        # memory, in turn, stays referenced until the copy ended (see ``Copy``): no
        # ``record_stream``, whose bookkeeping fails a block freed at interpreter exit.
        stream.wait_stream(default)
        return out, stream


def _stream(streams: dict, device: torch.device) -> torch.cuda.Stream:
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device)
    return stream


def finished(copies: list[Copy]) -> bool:
    return all(c.event.query() for c in copies)
