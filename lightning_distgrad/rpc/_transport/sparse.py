"""Sparse tensors on the wire: each travels as its dense components.

The transport moves dense buffers only. A sparse COO tensor travels as its
indices and values, a compressed one (CSR, CSC, BSR, BSC) as its compressed
indices, plain indices and values. The frame's ``sparse`` field says where each
sparse tensor stood in the message's tensor list and how to rebuild it: one
``(position, layout name, size, coalesced)`` entry per sparse tensor, in
position order (``coalesced`` is ``None`` for compressed layouts). Everything
above the transport (RPC payloads, distributed autograd) sees sparse tensors
whole, so a sparse tensor that requires grad is recorded like a dense one and
sparse gradients travel back like dense ones.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..._compat import coo_parts

__all__ = ["flatten", "unflatten", "problem", "tensor_nbytes"]

_COO = "coo"
_COMPRESSED = {
    torch.sparse_csr: "csr",
    torch.sparse_csc: "csc",
    torch.sparse_bsr: "bsr",
    torch.sparse_bsc: "bsc",
}
#: Layouts the transport carries besides ``torch.strided``.
LAYOUTS = frozenset((torch.sparse_coo, *_COMPRESSED))
_COMPRESSED_BUILDERS = {
    "csr": torch.sparse_csr_tensor,
    "csc": torch.sparse_csc_tensor,
    "bsr": torch.sparse_bsr_tensor,
    "bsc": torch.sparse_bsc_tensor,
}
_INDEX_DTYPES = (torch.int32, torch.int64)


def components(t: torch.Tensor) -> tuple[str, tuple[torch.Tensor, ...], bool | None]:
    """(layout name, dense components, coalesced flag) of a sparse tensor."""
    t = t.detach()
    if t.layout is torch.sparse_coo:
        return _COO, coo_parts(t), t.is_coalesced()
    name = _COMPRESSED.get(t.layout)
    if name is None:
        raise TypeError(f"tensors of layout {t.layout} cannot be sent over RPC")
    if name in ("csr", "bsr"):
        return name, (t.crow_indices(), t.col_indices(), t.values()), None
    return name, (t.ccol_indices(), t.row_indices(), t.values()), None


def tensor_nbytes(t: torch.Tensor) -> int:
    """The bytes ``t`` puts on the wire (a sparse tensor: those of its components)."""
    if t.layout is torch.strided:
        return t.nbytes
    return sum(c.nbytes for c in components(t)[1])


def flatten(
    tensors: list[torch.Tensor], devices: list[str] | None
) -> tuple[list[torch.Tensor], list[str] | None, tuple]:
    """(dense tensors, their devices, sparse entries) that stand for ``tensors``.

    Each sparse tensor is replaced by its components, which land on its device.

    Example::

        >>> s = torch.eye(2).to_sparse()
        >>> flat, _, entries = flatten([torch.ones(1), s], None)
        >>> len(flat), entries
        (3, ((1, 'coo', (2, 2), True),))
    """
    flat: list[torch.Tensor] = []
    flat_devices: list[str] | None = None if devices is None else []
    entries = []
    for i, t in enumerate(tensors):
        if t.layout is torch.strided:
            parts: tuple = (t,)
        else:
            name, parts, coalesced = components(t)
            entries.append((i, name, tuple(t.shape), coalesced))
        flat.extend(parts)
        if flat_devices is not None:
            flat_devices.extend([devices[i]] * len(parts))
    return flat, flat_devices, tuple(entries)


def _count(name: str) -> int:
    return 2 if name == _COO else 3


def unflatten(flat: list[torch.Tensor], entries: tuple) -> list[torch.Tensor]:
    """Inverse of :func:`flatten`: rebuild each sparse tensor from its components.

    Raises ``RuntimeError`` (or ``ValueError``) if the components break the
    layout's invariants (an index out of range, unsorted compressed indices).

    Example::

        >>> s = torch.eye(2).to_sparse()
        >>> flat, _, entries = flatten([s], None)
        >>> torch.equal(unflatten(flat, entries)[0].to_dense(), torch.eye(2))
        True
    """
    out: list[torch.Tensor] = []
    taken = 0
    for position, name, size, coalesced in entries:
        gap = position - len(out)
        out.extend(flat[taken : taken + gap])
        taken += gap
        n = _count(name)
        parts = flat[taken : taken + n]
        taken += n
        # Invariants are checked (bounds of every index): a broken sparse tensor
        # would fault in whatever operator touches it next, far from its sender.
        if name == _COO:
            t = torch.sparse_coo_tensor(*parts, size, is_coalesced=coalesced, check_invariants=True)
        else:
            t = _COMPRESSED_BUILDERS[name](*parts, size, check_invariants=True)
        out.append(t)
    out.extend(flat[taken:])
    return out


def problem(entries: Any, metas: list[tuple[torch.dtype, tuple]]) -> str | None:
    """What is wrong with a received frame's sparse ``entries`` given its tensors'
    (dtype, shape), or None. Checks the structure only; :func:`unflatten` checks the
    index values once the bytes arrived."""
    if type(entries) is not tuple:
        return "its sparse tensor table is not a tuple"
    taken = 0
    previous = -1
    for entry in entries:
        if type(entry) is not tuple or len(entry) != 4:
            return "a sparse entry is not a (position, layout, size, coalesced) tuple"
        position, name, size, coalesced = entry
        if type(position) is not int or position <= previous:
            return f"sparse entry position {position!r} is not an int above {previous}"
        if name != _COO and name not in _COMPRESSED_BUILDERS:
            return f"unknown sparse layout {name!r}"
        if type(size) is not tuple or not all(type(d) is int and d >= 0 for d in size):
            return f"sparse size {size!r} is not a tuple of non-negative ints"
        if coalesced not in (True, False, None):
            return f"sparse coalesced flag {coalesced!r} is not a bool"
        start = taken + position - previous - 1
        taken = start + _count(name)
        if taken > len(metas):
            return f"sparse tensor {position} needs more tensors than the frame carries"
        parts = metas[start:taken]
        found = _coo_problem(parts, size) if name == _COO else _compressed_problem(parts)
        if found is not None:
            return f"sparse tensor {position} ({name}): {found}"
        previous = position
    return None


def _coo_problem(parts: list[tuple[torch.dtype, tuple]], size: tuple) -> str | None:
    (index_dtype, index_shape), (_, value_shape) = parts
    if index_dtype is not torch.int64 or len(index_shape) != 2:
        return f"indices must be a 2-D int64 tensor, got {index_dtype} of shape {index_shape}"
    sparse_dim, nnz = index_shape
    if len(value_shape) < 1 or value_shape[0] != nnz:
        return f"values of shape {value_shape} do not match {nnz} indices"
    if tuple(size[sparse_dim:]) != tuple(value_shape[1:]) or len(size) < sparse_dim:
        return f"size {size} does not match indices {index_shape} and values {value_shape}"
    if math.prod(size[:sparse_dim]) == 0 and nnz:
        return f"{nnz} indices into an empty size {size}"
    return None


def _compressed_problem(parts: list[tuple[torch.dtype, tuple]]) -> str | None:
    (compressed_dtype, _), (plain_dtype, _), _ = parts
    if compressed_dtype not in _INDEX_DTYPES or plain_dtype is not compressed_dtype:
        return (
            "index tensors must share an int32 or int64 dtype, got "
            f"{compressed_dtype} and {plain_dtype}"
        )
    return None
