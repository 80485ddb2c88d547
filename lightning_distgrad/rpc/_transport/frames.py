"""Frames: the one small message that opens every RPC message, and its validation.

A message is one *frame* (a pickled tuple: message kind, routing fields and the tensor
table's metadata, see ``tensor_bytes``) followed, on the data communicator, by the bytes of
every tensor too big to ride inside the frame. A received frame is decoded and validated
(:func:`decode_frame`) before anything is allocated for it.
"""

from __future__ import annotations

import enum
import math
import pickle
from typing import Any, NamedTuple

import torch

from .cuda import export_problem
from .sparse import problem as sparse_problem
from .tensor_bytes import DTYPES, ITEMSIZES, PUSHED

_PROTOCOL = pickle.HIGHEST_PROTOCOL


class Kind(enum.IntEnum):
    """What a frame carries; each kind has one handler on the receiver."""

    REQUEST = 0  # (func, args, kwargs) payload; answered by one RESPONSE
    RESPONSE = 1  # (ok, value) payload, or no payload and the value as the one tensor
    QUICK_REQUEST = 2  # a REQUEST of a torch operator on small tensors: runs where it lands
    GRADIENTS = 3  # distributed autograd: gradients for a backward pass (typed body)
    CREDIT = 4  # distributed autograd: credit and errors returned to a pass's root
    CONTEXT_RELEASE = 5  # distributed autograd: a context ended on its creator
    RREF_FORK = 6  # RRef bookkeeping: a fork added or deleted at its owner
    JOIN = 7  # not sent (graceful shutdown joins in a barrier); kept: kinds keep their numbers
    PROFILED_REQUEST = 8  # a REQUEST whose caller profiles: its callee records the run
    REMOTE_EVENTS = 9  # what the callee recorded of a PROFILED_REQUEST, sent before its RESPONSE
    RREF_CONFIRM = 10  # RRef bookkeeping: the owner registered the receiver's fork
    FLUSH = 11  # not sent (graceful shutdown counts frames); kept: kinds keep their numbers


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
    # components that travel in their place (see ``sparse``); empty for dense ones only.
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
        problem = sparse_problem(sparse, [(DTYPES[m[0]], m[1]) for m in metas])
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
    if type(code) is not int or not 0 <= code < len(DTYPES):
        return f"unknown dtype code {code!r}"
    if type(shape) is not tuple or not all(type(d) is int and d >= 0 for d in shape):
        return f"shape {shape!r} is not a tuple of non-negative ints"
    if type(nbytes) is not int or nbytes != math.prod(shape) * ITEMSIZES[code]:
        return (
            f"declares {nbytes!r} bytes for shape {shape} of {DTYPES[code]} "
            f"({math.prod(shape) * ITEMSIZES[code]} expected)"
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
        return export_problem(inline)
    if inline is not None and (type(inline) not in (bytes, bytearray) or len(inline) != nbytes):
        return f"its inline bytes do not match the declared {nbytes} bytes"
    return None


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024:
            return f"{nbytes:.4g} {unit}"
        nbytes /= 1024
    return f"{nbytes:.4g} TiB"
