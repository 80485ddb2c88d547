"""Tensor bytes on the wire: how a tensor is described in a frame and where its bytes go.

A frame's tensor table holds one *meta* per tensor: ``(dtype code, shape, byte count,
inline, device)``. ``inline`` is the tensor's bytes when it is small (it rides inside the
frame), ``None`` when its bytes follow on the data communicator, :data:`PUSHED` when its
sender writes them into the receiver's buffer (see ``direct_writes``), or a CUDA IPC export
(see ``cuda``). ``device`` is where it lands on the receiver.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from .receive_buffers import ReceiveBufferPool

#: Tensors up to this size travel inside the frame (saves one MPI message).
INLINE_LIMIT = 64 * 1024


# dtypes travel as their index in this list (cheaper than pickling a reference);
# ``init_rpc`` checks that every rank has the same list.
DTYPES = tuple(sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))
DTYPE_CODES = {dtype: code for code, dtype in enumerate(DTYPES)}
ITEMSIZES = tuple(dtype.itemsize for dtype in DTYPES)
#: What ranks must agree on to read each other's frames (``init_rpc`` checks it).
DTYPE_TABLE = tuple(str(dtype) for dtype in DTYPES)


#: A meta's inline slot for a tensor whose sender writes its bytes into the receiver's
#: buffer (see ``direct_writes``); ``None`` there: they follow on the ``data`` communicator.
PUSHED = True

#: Tensor bytes go in chunks of at most 1 GiB: portable beyond MPI-4 large counts.
CHUNK_BYTES = 1 << 30


def chunks(view: np.ndarray) -> Iterator[np.ndarray]:
    """``view`` in pieces of at most :data:`CHUNK_BYTES` (one MPI message each)."""
    for start in range(0, view.size, CHUNK_BYTES):
        yield view[start : start + CHUNK_BYTES]


def tensor_bytes_view(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor (any dtype, no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def plain_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in contiguous memory with no lazy conjugate or negative bit (``t``
    itself when it is so already): the bytes that travel.

    Lazy conjugate/negative views (``z.conj()``) keep the un-negated bytes in memory: their
    raw bytes would be wrong (and ``view`` to uint8 raises for big ones).
    """
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t if t.is_contiguous() else t.contiguous()


def describe_host_tensor(
    t: torch.Tensor, device: str = "cpu", inline_limit: int = INLINE_LIMIT
) -> tuple[tuple, Any]:
    """Describe CPU tensor ``t`` for the wire, to land on ``device`` at the receiver.

    Returns (meta, CPU tensor to send as a buffer, or None when inline).

    Example::

        >>> meta, data = describe_host_tensor(torch.ones(2))
        >>> meta[1:3], data is None
        ((2,), 8, True)
    """
    t = plain_contiguous(t)
    nbytes = t.nbytes
    if nbytes <= inline_limit:
        # A bytearray unpickles as a fresh writable buffer: the receiver wraps it
        # without another copy (torch.frombuffer).
        inline = bytearray(ctypes.string_at(t.data_ptr(), nbytes)) if nbytes else b""
        return (DTYPE_CODES[t.dtype], tuple(t.shape), nbytes, inline, device), None
    return (DTYPE_CODES[t.dtype], tuple(t.shape), nbytes, None, device), t.detach()


def meta_with(t: torch.Tensor, inline: Any, device: str) -> tuple:
    """The meta of ``t`` with ``inline`` in its inline slot (an IPC export, see ``cuda``)."""
    return (DTYPE_CODES[t.dtype], tuple(t.shape), t.nbytes, inline, device)


def meta_dtype(meta: tuple) -> torch.dtype:
    return DTYPES[meta[0]]


def allocate_tensor(meta: tuple, pool: ReceiveBufferPool | None = None) -> torch.Tensor:
    """A CPU tensor for ``meta``: filled from the frame, or empty for MPI to fill."""
    code, shape, nbytes, inline, _ = meta
    dtype = DTYPES[code]
    if inline is not None and inline is not PUSHED:
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(inline, dtype=dtype)
        if len(shape) == 1:
            return flat
        return flat.view(*shape) if shape else flat.view(())  # view(*shape): half the cost
    if meta[4] != "cpu":  # copied to its GPU from here: pinned, so the copy is asynchronous
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    if pool is not None and nbytes >= pool.min_bytes:
        return torch.from_numpy(pool.take(nbytes)).view(dtype).view(shape)
    return torch.empty(shape, dtype=dtype)
