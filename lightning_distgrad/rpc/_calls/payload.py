"""Payload pickling: a call's Python objects with tensors as a tensor table.

Tensors are never pickled: the payload pickler swaps each dense tensor for its index in a
tensor table (``persistent_id``), like ``torch.distributed.rpc.internal``; the transport
carries the table's bytes (see ``_transport.tensor_bytes``).
"""

from __future__ import annotations

import io
import pickle
import threading
import types
from typing import Any

import torch

from ..._compat import CFuture
from .._transport import SPARSE_LAYOUTS

_PROTOCOL = pickle.HIGHEST_PROTOCOL


class _PicklingLocal(threading.local):
    # Class defaults: no AttributeError when unset.
    ctx: PicklingContext | None = None
    unpickling: UnpicklingContext | None = None


_local = _PicklingLocal()

# Builtin functions that are plain references (bound to no object, or to a module
# or a class: torch operators) are pickled once per process and travel as those
# bytes, a persistent id; the receiver unpickles each such reference once.
_function_bytes: dict[Any, bytes] = {}
_functions: dict[bytes, Any] = {}


def _function_id(func: types.BuiltinFunctionType) -> bytes | None:
    raw = _function_bytes.get(func)
    if raw is None:
        owner = func.__self__
        if owner is not None and not isinstance(owner, (types.ModuleType, type)):
            return None  # a bound method (``[].append``): pickled with its object
        raw = _function_bytes[func] = pickle.dumps(func, _PROTOCOL)
    return raw


def _function(raw: bytes) -> Any:
    func = _functions.get(raw)
    if func is None:
        func = _functions[raw] = pickle.loads(raw)
    return func


class PicklingContext:
    """Thread-local facts about the message being pickled, for RRef reducers."""

    __slots__ = ("dst_id", "arrival_forks", "on_send")

    def __init__(self, dst_id: int):
        self.dst_id = dst_id
        # (rref_id, fork_id) pairs the destination (their owner) must register
        # on arrival, in order, before any later delete from this sender.
        self.arrival_forks: list[tuple] = []
        # Side effects (fork registrations) to run, in order, once the message
        # is certain to be sent: see :meth:`commit`.
        self.on_send: list = []

    def commit(self) -> None:
        """Run the deferred side effects; call right before the message is sent."""
        for action in self.on_send:
            action()
        self.on_send = []


class NotSendable(RuntimeError):
    """An object that RPCs refuse to send, as torch's do (a Future), with torch's text."""


def current_pickling_context() -> PicklingContext | None:
    """The message being pickled on this thread, or None outside RPC pickling."""
    return _local.ctx


def encode_payload(obj: Any, dst_id: int) -> tuple[bytes, list[torch.Tensor], PicklingContext]:
    """Pickle ``obj`` for ``dst_id``; returns (bytes, tensor table, pickling context)."""
    buf = io.BytesIO()
    tensors: list[torch.Tensor] = []
    # A tensor that occurs twice travels once and arrives as one tensor, as
    # pickle does for any object (a gradient's two inputs of ``a + b`` are one).
    pids: dict[int, Any] = {}

    def persistent_id(o: Any) -> Any:
        # Dense and sparse tensors and Parameters go to the table (so autograd
        # can record them; the transport carries sparse ones as their dense
        # components); other subclasses reduce to their plain ``.data`` tensor,
        # which then lands here, as do tensors of other layouts to what pickle
        # makes of them. Torch operators travel as their pickled reference (see
        # _function_id).
        kind = type(o)
        if kind is not torch.Tensor and kind is not torch.nn.Parameter:
            if kind is types.BuiltinFunctionType:
                return _function_id(o)
            if isinstance(o, CFuture):
                raise NotSendable(
                    "Can not pickle torch.futures.Future: an RPC cannot send a Future; "
                    "send its value once it is done (fut.wait())"
                )
            return None
        if o.layout is not torch.strided and o.layout not in SPARSE_LAYOUTS:
            return None
        pid = pids.get(id(o))
        if pid is None:
            # A kept view travels as the stretch of storage it spans, rebuilt with its strides
            # (only strided tensors have strides: sparse ones raise on is_contiguous).
            strided = (
                kind is torch.Tensor
                and o.layout is torch.strided
                and not o.is_contiguous()
                and _keeps_strides(o)
            )
            tensors.append(_storage_span(o) if strided else o)
            index = len(tensors) - 1
            if strided:
                pid = ("view", index, tuple(o.shape), o.stride())
            elif kind is torch.Tensor:
                pid = index
            else:
                pid = ("param", index, o.requires_grad)
            pids[id(o)] = pid
        return pid

    pickler = pickle.Pickler(buf, _PROTOCOL)
    pickler.persistent_id = persistent_id
    previous = _local.ctx
    ctx = _local.ctx = PicklingContext(dst_id)
    try:
        pickler.dump(obj)
    finally:
        _local.ctx = previous
    return buf.getvalue(), tensors, ctx


#: As torch's RPC: a view keeps its strides unless the storage it spans is this big and at
#: least twice its own size; such a view travels as a contiguous copy instead.
_RECOPY_MIN_BYTES = 8 * 1024


def _span_elements(t: torch.Tensor) -> int:
    """How many consecutive storage elements the non-empty strided tensor ``t`` covers."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))


def _keeps_strides(t: torch.Tensor) -> bool:
    """Whether the non-contiguous tensor ``t`` arrives with its strides, as torch's RPC
    sends it: a view whose storage span is small or mostly its own elements."""
    if t.numel() == 0:
        return False
    span = _span_elements(t)
    return span * t.element_size() < _RECOPY_MIN_BYTES or span < 2 * t.numel()


def _storage_span(t: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous view of the storage that ``t`` covers (no copy; differentiable)."""
    return t.as_strided((_span_elements(t),), (1,), t.storage_offset())


class UnpicklingContext:
    """What unpickling a received payload on this thread gathered for the code that runs
    it: the confirmations from their owners that the user RRefs it carried wait for (see
    ``rpc._rrefs``), which a request waits for before it runs, as torch's."""

    __slots__ = ("confirmations",)

    def __init__(self):
        self.confirmations: list[torch.futures.Future] = []


def current_unpickling_context() -> UnpicklingContext | None:
    """The context of the payload being unpickled on this thread, or None."""
    return _local.unpickling


def decode_payload(
    data: bytes, tensors: list[torch.Tensor], context: UnpicklingContext | None = None
) -> Any:
    """Inverse of :func:`encode_payload`, given the received tensor table; ``context``
    gathers what unpickling learns (see :class:`UnpicklingContext`)."""
    params: dict[int, torch.Tensor] = {}

    def persistent_load(pid: Any) -> Any:
        if type(pid) is int:
            return tensors[pid]
        if type(pid) is bytes:
            return _function(pid)
        if pid[0] == "view":
            _, index, shape, strides = pid
            span = tensors[index]
            return span.as_strided(shape, strides, span.storage_offset())
        _, index, requires_grad = pid
        if index not in params:
            t = tensors[index]
            # Recorded by distributed autograd: keep the history (a Parameter can't have one).
            params[index] = t if t.grad_fn is not None else torch.nn.Parameter(t, requires_grad)
        return params[index]

    unpickler = pickle.Unpickler(io.BytesIO(data))
    unpickler.persistent_load = persistent_load
    if context is None:
        return unpickler.load()
    previous, _local.unpickling = _local.unpickling, context
    try:
        return unpickler.load()
    finally:
        _local.unpickling = previous
