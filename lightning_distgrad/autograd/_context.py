"""Distributed autograd contexts and their globally unique ids.

Ids carry the worker id in their top 16 bits (torch's container layout), so
contexts and autograd messages created on different workers never collide.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .._compat import coo_parts

AUTO_INCREMENT_BITS = 48
AUTO_INCREMENT_MASK = (1 << AUTO_INCREMENT_BITS) - 1
MAX_WORKER_ID = 65535
# Remember this many released ids, so late messages do not resurrect them.
_RELEASED_MEMORY = 65536


def sum_grads(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """``old + new`` with AccumulateGrad's rule: a dense term goes first (sparse + dense fails)."""
    if old is None:
        return new
    return new + old if old.is_sparse and not new.is_sparse else old + new


def first_gradient(leaf: torch.Tensor, grad: torch.Tensor, shared: bool) -> torch.Tensor:
    """What the context stores as ``leaf``'s first gradient: ``grad`` itself, or a copy.

    AccumulateGrad's rule, as torch's distributed autograd applies it: the
    context keeps ``grad`` only if no other leaf got the same tensor (``shared``)
    and it has the leaf's layout (the "gradient layout contract": the leaf's
    strides, or contiguous); a sparse COO gradient with contiguous indices and
    values gets a tensor of its own over them (so that changing the metadata of
    one never changes the other); anything else is copied. Gradients stored
    for two leaves thus never alias, and an in-place change of one (gradient
    clipping, an optimizer) cannot reach the other.
    """
    if grad.layout is torch.sparse_coo:
        indices, values = coo_parts(grad)
        if shared or not (indices.is_contiguous() and values.is_contiguous()):
            return grad.clone()
        return torch.sparse_coo_tensor(
            indices, values, grad.shape, is_coalesced=grad.is_coalesced(), check_invariants=False
        )
    if grad.layout is not torch.strided:
        return grad.clone()
    if leaf.is_contiguous():
        keeps_layout = grad.is_contiguous()
    else:
        keeps_layout = grad.stride() == leaf.stride()
    if keeps_layout and not shared:
        return grad
    # The leaf's strides where it has dense, non-overlapping ones; else contiguous.
    return torch.empty_like(leaf, dtype=grad.dtype, device=grad.device).copy_(grad)


def check_context_id(context_id: Any) -> None:
    """Context ids are ints (torch's bindings reject anything else with a TypeError)."""
    if not isinstance(context_id, int) or isinstance(context_id, bool):
        raise TypeError(
            f"incompatible function arguments: context_id must be an int, got "
            f"{type(context_id).__name__}"
        )


class DistAutogradContext:
    """The send/recv functions and gradients of one forward/backward pass on one worker.

    Made by :class:`~lightning_distgrad.autograd.context` on the worker that opens it, and on
    every worker an RPC of the context reaches; released everywhere when the ``with`` block
    ends. Users see its id; :func:`~lightning_distgrad.autograd.get_gradients` reads it.

    Example::

        >>> # xdoctest: +SKIP
        >>> with dist_autograd.context() as context_id:
        ...     ctx = dist_autograd._retrieve_context(context_id)
        ...     ctx._context_id() == context_id
        True
    """

    def __init__(self, context_id: int):
        self._id = context_id
        self.lock = threading.Lock()
        self.sends: dict[int, Any] = {}  # message id -> send node
        self.send_peers: dict[int, int] = {}  # message id -> worker the message went to
        # message id -> device of each sent tensor, for messages with non-CPU tensors
        self.send_devices: dict[int, list] = {}
        self.consumed_sends: set[int] = set()  # sends run by a pass without retain_graph
        self.recvs: dict[int, Any] = {}  # message id -> recv node
        self.recv_peers: dict[int, int] = {}  # message id -> worker the message came from
        self.recv_meta: dict[int, list[tuple]] = {}  # message id -> (shape, dtype) per output
        # A torch operator's request and its response enclose its whole graph (an operator
        # makes no calls): recv -> operator -> send. Its backward is one native call from the
        # send's children to the recv node's inputs (see ``_pass``), no graph analysis.
        self.op_requests: dict[tuple, int] = {}  # (caller, call id) -> request's message id
        self.op_sends: dict[int, int] = {}  # response's message id -> request's message id
        self.known_workers: set[int] = set()
        self.grads: dict[torch.Tensor, torch.Tensor] = {}  # leaf -> gradient (identity keys)
        self.backward_pass: Any = None  # the engine's state for the current pass
        self.ended_pass_id: tuple | None = None  # the last pass ended on this worker
        self.strict = False  # backward's default: every RPC must take part

    def _context_id(self) -> int:
        return self._id

    def _send_functions(self) -> dict[int, Any]:
        with self.lock:
            return dict(self.sends)

    def _recv_functions(self) -> dict[int, Any]:
        with self.lock:
            return dict(self.recvs)

    def _known_worker_ids(self) -> set[int]:
        with self.lock:
            return set(self.known_workers)

    def gradients(self) -> dict[torch.Tensor, torch.Tensor]:
        """A copy of this context's gradients on this worker, keyed by leaf tensor."""
        with self.lock:
            return dict(self.grads)

    def map_gradients(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every gradient ``g`` of this context by ``fn(g)`` (under ``no_grad``)."""
        with self.lock, torch.no_grad():
            for leaf, grad in list(self.grads.items()):
                self.grads[leaf] = fn(grad)

    def set_gradients(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """Set each ``(leaf, gradient)``; a ``None`` gradient removes the leaf's."""
        with self.lock:
            for leaf, grad in pairs:
                if grad is None:
                    self.grads.pop(leaf, None)
                else:
                    self.grads[leaf] = grad

    def take_gradients(self, leaves: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Remove the gradients of ``leaves`` from this context and return them (None for a
        leaf without one)."""
        with self.lock:
            return [self.grads.pop(leaf, None) for leaf in leaves]

    def accumulate(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Add each ``(leaf, gradient)`` to the leaf's gradient in this context.

        A first gradient is kept or copied as :func:`first_gradient` says; one tensor
        given to several leaves of ``pairs``, or kept for another leaf already, is copied.
        """
        with self.lock, torch.no_grad():
            grads = self.grads
            uses = collections.Counter(id(g) for _, g in pairs) if len(pairs) > 1 else None
            kept = None  # ids of the gradients held, taken when the first one is needed
            for leaf, grad in pairs:
                old = grads.get(leaf)
                if old is None:
                    shared = uses is not None and uses[id(grad)] > 1
                    if not shared and grads:
                        if kept is None:
                            kept = {id(g) for g in grads.values()}
                        shared = id(grad) in kept
                    grads[leaf] = first_gradient(leaf, grad, shared)
                else:
                    grads[leaf] = sum_grads(old, grad)

    def __repr__(self) -> str:
        return f"DistAutogradContext(id={self._id})"


class _CurrentContextId(threading.local):
    """A thread's current context id (None until set). The class default makes reading
    an unset id a plain attribute read, with no exception raised and caught, on every
    request a server thread runs."""

    id: int | None = None


class ContextContainer:
    """All contexts of this worker, plus the thread-local current context."""

    def __init__(self, worker_id: int):
        if not 0 <= worker_id <= MAX_WORKER_ID:
            raise ValueError(f"worker id must be in [0, {MAX_WORKER_ID}], got {worker_id}")
        self.worker_id = worker_id
        base = worker_id << AUTO_INCREMENT_BITS
        self.max_id = AUTO_INCREMENT_MASK | base
        self._context_ids = itertools.count(base)
        self._message_ids = itertools.count(base)
        self._lock = threading.Lock()
        self._contexts: dict[int, DistAutogradContext] = {}
        self._released: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._local = _CurrentContextId()

    # -- thread-local current context ---------------------------------------------

    def current_id(self) -> int | None:
        return self._local.id

    def set_current_id(self, context_id: int | None) -> None:
        self._local.id = context_id

    # -- lifetime -----------------------------------------------------------------

    def new_context(self) -> DistAutogradContext:
        if self.current_id() is not None:
            raise RuntimeError("Already have an autograd context id for this thread.")
        context_id = next(self._context_ids)
        if context_id > self.max_id:
            raise RuntimeError(
                f"distributed autograd context ids exhausted on worker {self.worker_id}"
            )
        ctx = DistAutogradContext(context_id)
        with self._lock:
            self._contexts[context_id] = ctx
        self.set_current_id(context_id)
        return ctx

    def new_message_id(self) -> int:
        return next(self._message_ids)

    def find(self, context_id: int) -> DistAutogradContext | None:
        return self._contexts.get(context_id)

    def retrieve(self, context_id: int) -> DistAutogradContext:
        check_context_id(context_id)
        ctx = self._contexts.get(context_id)
        if ctx is None:
            raise RuntimeError(f"Could not find autograd context with id: {context_id}")
        return ctx

    def get_or_create(self, context_id: int) -> DistAutogradContext | None:
        """The context for an incoming message; None if it was already released here."""
        with self._lock:
            ctx = self._contexts.get(context_id)
            if ctx is None and context_id not in self._released:
                ctx = self._contexts[context_id] = DistAutogradContext(context_id)
            return ctx

    def release(self, context_id: int, must_exist: bool = True) -> DistAutogradContext | None:
        """Drop a context; returns it (for cleanup of the workers it knows)."""
        check_context_id(context_id)
        with self._lock:
            ctx = self._contexts.pop(context_id, None)
            if ctx is None and must_exist:
                raise RuntimeError(f"Could not find autograd context with id: {context_id}")
            self._released[context_id] = None
            if len(self._released) > _RELEASED_MEMORY:
                self._released.popitem(last=False)
        if self.current_id() == context_id:
            self.set_current_id(None)
        return ctx

    def __len__(self) -> int:
        return len(self._contexts)

    def all_contexts(self) -> list[DistAutogradContext]:
        with self._lock:
            return list(self._contexts.values())


_container: ContextContainer | None = None


def container() -> ContextContainer:
    """This worker's contexts (``init_rpc`` makes them)."""
    if _container is None:
        raise RuntimeError(
            "Need to initialize distributed autograd using lightning_distgrad.rpc.init_rpc() first."
        )
    return _container


def current_container() -> ContextContainer | None:
    """This worker's contexts, or None before ``init_rpc``."""
    return _container


def init_container(worker_id: int) -> None:
    global _container
    _container = ContextContainer(worker_id)
