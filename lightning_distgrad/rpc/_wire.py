"""Wire format: pickled metadata plus raw tensor buffers.

A message is one small *frame* (a pickled tuple: message kind, routing fields
and the tensor table's metadata) followed, on the data communicator, by the
bytes of every tensor too big to ride inside the frame. Tensors are never
pickled: the payload pickler swaps each dense tensor for its index in a tensor
table (``persistent_id``), like ``torch.distributed.rpc.internal``.
"""

from __future__ import annotations

import ctypes
import enum
import io
import math
import pickle
import threading
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from .._compat import CFuture
from . import _cuda, _sparse

if TYPE_CHECKING:
    from ._buffers import ReceiveBufferPool

__all__ = [
    "Kind",
    "Frame",
    "MalformedFrame",
    "FrameLimits",
    "decode_frame",
    "encode_payload",
    "decode_payload",
    "tensor_bytes_view",
    "current_pickling_context",
    "prepare_tensor",
    "allocate_tensor",
]

#: Tensors up to this size travel inside the frame (saves one MPI message).
INLINE_LIMIT = 64 * 1024
_PROTOCOL = pickle.HIGHEST_PROTOCOL


class _PicklingLocal(threading.local):
    ctx: PicklingContext | None = None  # a class default: no AttributeError when unset


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


class Kind(enum.IntEnum):
    """What a frame carries; each kind has one handler on the receiver."""

    REQUEST = 0  # (func, args, kwargs) payload; answered by one RESPONSE
    RESPONSE = 1  # (ok, value) payload, or no payload and the value as the one tensor
    QUICK_REQUEST = 2  # a REQUEST of a torch operator on small tensors: runs where it lands
    GRADIENTS = 3  # distributed autograd: gradients for a backward pass (typed body)
    CREDIT = 4  # distributed autograd: credit and errors returned to a pass's root
    CONTEXT_RELEASE = 5  # distributed autograd: a context ended on its creator
    RREF_FORK = 6  # RRef bookkeeping: a fork added or deleted at its owner
    JOIN = 7  # graceful shutdown: the sender has called shutdown
    PROFILED_REQUEST = 8  # a REQUEST whose caller profiles: its callee records the run
    REMOTE_EVENTS = 9  # what the callee recorded of a PROFILED_REQUEST, sent before its RESPONSE
    RREF_CONFIRM = 10  # RRef bookkeeping: the owner registered the receiver's fork
    FLUSH = 11  # graceful shutdown: a round's marker, after every frame its sender sent before


#: Kinds that are answered by a RESPONSE (a malformed one is answered with an error).
CALL_KINDS = frozenset((Kind.REQUEST, Kind.QUICK_REQUEST, Kind.PROFILED_REQUEST))


class Frame(NamedTuple):
    """One message; pickled as a plain tuple (cheaper than any class)."""

    kind: Kind
    call_id: int  # REQUEST and RESPONSE; -1 for one-way kinds
    payload: bytes | None  # None: a RESPONSE whose value is its one tensor
    # One (dtype code, shape, nbytes, inline bytes or None or PUSHED or a CUDA IPC export,
    # device) per tensor.
    metas: tuple = ()
    # A call's distributed-autograd metadata, or a one-way kind's typed body (sent as a
    # plain tuple).
    body: Any = None
    # RRef forks the receiver registers on arrival, before later frames run.
    forks: tuple = ()
    # Where sparse tensors stood among the tensors and how to rebuild each from the dense
    # components that travel in their place (see ``_sparse``); empty for dense ones only.
    sparse: tuple = ()

    def dumps(self, metas: tuple | None = None) -> bytes:
        """The frame's bytes; ``metas`` replaces the tensor table's metadata if given."""
        return pickle.dumps(
            (
                int(self.kind),
                self.call_id,
                self.payload,
                self.metas if metas is None else metas,
                self.body,
                self.forks,
                self.sparse,
            ),
            _PROTOCOL,
        )


class MalformedFrame(Exception):
    """A frame this agent cannot read. ``frame`` is set when its header decoded (so a
    call can be answered with the reason)."""

    def __init__(self, reason: str, frame: Frame | None = None):
        super().__init__(reason)
        self.frame = frame
        self.source = -1  # the sender's rank, set by the transport


class FrameLimits(NamedTuple):
    """What a receiver accepts: declared sizes up to ``max_message_bytes``, tensors on
    ``devices`` (``str(torch.device)`` of each device this process has)."""

    max_message_bytes: int
    devices: frozenset


def local_devices() -> frozenset:
    """The devices a received tensor may be mapped to on this process."""
    devices = {"cpu"}
    if torch.cuda.is_available():
        devices.add("cuda")
        devices.update(f"cuda:{i}" for i in range(torch.cuda.device_count()))
    return frozenset(devices)


def decode_frame(raw: bytes | bytearray, limits: FrameLimits) -> Frame:
    """Decode and validate a received frame before anything is allocated for it.

    Raises :class:`MalformedFrame` saying what is wrong.
    """
    try:
        fields = pickle.loads(raw)
    except Exception as e:
        raise MalformedFrame(f"undecodable frame ({type(e).__name__}: {e})") from None
    if type(fields) is not tuple or len(fields) != 7:
        raise MalformedFrame(f"a frame is a 7-field tuple, got {type(fields).__name__}")
    kind, call_id, payload, metas, body, forks, sparse = fields
    try:
        kind = Kind(kind)
    except (ValueError, TypeError):
        raise MalformedFrame(f"unknown frame kind {kind!r}") from None
    if type(call_id) is not int:
        raise MalformedFrame(f"call id {call_id!r} is not an int")
    frame = Frame(kind, call_id, payload, metas, body, forks, sparse)
    if payload is not None and type(payload) is not bytes:
        raise MalformedFrame(f"payload is a {type(payload).__name__}, not bytes", frame)
    if type(metas) is not tuple or type(forks) is not tuple or type(sparse) is not tuple:
        raise MalformedFrame("tensor table, forks and sparse table must be tuples", frame)
    if not all(_is_fork(f) for f in forks):
        raise MalformedFrame("forks must be ((worker, id), (worker, id)) pairs", frame)
    total = len(raw)
    for index, meta in enumerate(metas):
        problem = _meta_problem(meta, limits)
        if problem is not None:
            raise MalformedFrame(f"tensor {index}: {problem}", frame)
        total += meta[2]
    if sparse:
        problem = _sparse.problem(sparse, [(_DTYPES[m[0]], m[1]) for m in metas])
        if problem is not None:
            raise MalformedFrame(problem, frame)
    if total > limits.max_message_bytes:
        raise MalformedFrame(
            f"the message declares {_size(total)} in all, above this worker's "
            f"max_message_bytes ({_size(limits.max_message_bytes)}); raise it with "
            "MPIRpcBackendOptions(max_message_bytes=...) on the receiver",
            frame,
        )
    return frame


def _is_guid(guid: Any) -> bool:
    return type(guid) is tuple and len(guid) == 2 and all(type(i) is int for i in guid)


def _is_fork(fork: Any) -> bool:
    """An (RRef id, fork id) pair, each a (worker id, local id) guid."""
    return type(fork) is tuple and len(fork) == 2 and _is_guid(fork[0]) and _is_guid(fork[1])


def _meta_problem(meta: Any, limits: FrameLimits) -> str | None:
    if type(meta) is not tuple or len(meta) != 5:
        return "its description is not a (dtype, shape, nbytes, inline, device) tuple"
    code, shape, nbytes, inline, device = meta
    if type(code) is not int or not 0 <= code < len(_DTYPES):
        return f"unknown dtype code {code!r}"
    if type(shape) is not tuple or not all(type(d) is int and d >= 0 for d in shape):
        return f"shape {shape!r} is not a tuple of non-negative ints"
    if type(nbytes) is not int or nbytes != math.prod(shape) * _ITEMSIZES[code]:
        return (
            f"declares {nbytes!r} bytes for shape {shape} of {_DTYPES[code]} "
            f"({math.prod(shape) * _ITEMSIZES[code]} expected)"
        )
    if nbytes > limits.max_message_bytes:
        return (
            f"declares {_size(nbytes)}, above this worker's max_message_bytes "
            f"({_size(limits.max_message_bytes)}); raise it with "
            "MPIRpcBackendOptions(max_message_bytes=...) on the receiver"
        )
    if inline is PUSHED:
        return None
    if type(device) is not str or device not in limits.devices:
        return (
            f"it is mapped to device {device!r}, which this worker lacks "
            f"(it has {sorted(limits.devices)}); fix the sender's device map"
        )
    if type(inline) is tuple:
        if device == "cpu":
            return "it is a CUDA IPC export mapped to the CPU"
        return _cuda.export_problem(inline)
    if inline is not None and (type(inline) not in (bytes, bytearray) or len(inline) != nbytes):
        return f"its inline bytes do not match the declared {nbytes} bytes"
    return None


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024:
            return f"{nbytes:.4g} {unit}"
        nbytes /= 1024
    return f"{nbytes:.4g} TiB"


# ---------------------------------------------------------------------------
# Payload pickling


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
        if o.layout is not torch.strided and o.layout not in _sparse.LAYOUTS:
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


def decode_payload(data: bytes, tensors: list[torch.Tensor]) -> Any:
    """Inverse of :func:`encode_payload`, given the received tensor table."""
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
    return unpickler.load()


# ---------------------------------------------------------------------------
# Tensor bytes


# dtypes travel as their index in this list (cheaper than pickling a reference);
# ``init_rpc`` checks that every rank has the same list.
_DTYPES = tuple(sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
_ITEMSIZES = tuple(dtype.itemsize for dtype in _DTYPES)
#: What ranks must agree on to read each other's frames (``init_rpc`` checks it).
DTYPE_TABLE = tuple(str(dtype) for dtype in _DTYPES)


#: A meta's inline slot for a tensor whose sender writes its bytes into the receiver's
#: buffer (see ``_push``); ``None`` there: they follow on the ``data`` communicator.
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


def prepare_tensor(
    t: torch.Tensor, device: str = "cpu", inline_limit: int = INLINE_LIMIT
) -> tuple[tuple, Any]:
    """Describe ``t`` for the wire, to land on ``device`` at the receiver.

    Returns (meta, CPU tensor to send as a buffer, or None when inline); the
    meta is (dtype code, shape, byte count, inline bytes or None, device).
    """
    if not t.is_cpu:  # staged through host memory
        t = _cuda.to_pinned_host(t) if t.nbytes > inline_limit else t.cpu()
    t = plain_contiguous(t)
    nbytes = t.nbytes
    if nbytes <= inline_limit:
        # A bytearray unpickles as a fresh writable buffer: the receiver wraps it
        # without another copy (torch.frombuffer).
        inline = bytearray(ctypes.string_at(t.data_ptr(), nbytes)) if nbytes else b""
        return (_DTYPE_CODES[t.dtype], tuple(t.shape), nbytes, inline, device), None
    return (_DTYPE_CODES[t.dtype], tuple(t.shape), nbytes, None, device), t.detach()


def exported_meta(t: torch.Tensor, export: tuple, device: str) -> tuple:
    """The meta of CUDA tensor ``t`` sent as its IPC ``export`` (see ``_cuda``)."""
    return (_DTYPE_CODES[t.dtype], tuple(t.shape), t.nbytes, export, device)


def meta_dtype(meta: tuple) -> torch.dtype:
    return _DTYPES[meta[0]]


def allocate_tensor(meta: tuple, pool: ReceiveBufferPool | None = None) -> torch.Tensor:
    """A CPU tensor for ``meta``: filled from the frame, or empty for MPI to fill."""
    code, shape, nbytes, inline, _ = meta
    dtype = _DTYPES[code]
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
