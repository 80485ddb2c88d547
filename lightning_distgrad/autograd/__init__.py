"""Distributed autograd over MPI with the API of ``torch.distributed.autograd``.

Every RPC made inside a :class:`context` whose tensors require grad records a
send function on the sender and a recv function on the receiver;
:func:`backward` then runs the backward pass across the workers the context
reached, and :func:`get_gradients` returns the gradients accumulated on this
worker. By default (SMART mode) RPCs whose results do not reach the roots take
no part; ``strict=True`` (on :func:`backward` or :class:`context`) makes such
an RPC an error instead (PyTorch's FAST-mode contract). See ``_engine``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..rpc import _internal
from ..rpc._internal import Kind, register_one_way, run_recorded
from . import _context, _engine, _messages, _shipping
from ._context import DistAutogradContext, check_context_id, container
from ._functions import record_recv, record_send
from ._messages import ContextRelease

__all__ = ["context", "backward", "get_gradients", "is_available", "DistAutogradContext"]


def is_available() -> bool:
    """Whether distributed autograd can be used: always, as in a torch build with RPC.

    Example::

        >>> import lightning_distgrad.autograd as dist_autograd
        >>> dist_autograd.is_available()
        True
    """
    return True


class context:
    r"""Context manager for one distributed forward/backward pass; yields its id.

    Leaving it releases the context here and, asynchronously, on every worker
    the context reached.

    Args:
        strict (bool): the default of :func:`backward`'s ``strict`` for passes
            in this context: with ``True`` an RPC whose results do not reach the
            roots is an error.

    Example::
        Run with ``mpiexec -n 2 python -m mpi4py example.py``:

        >>> # xdoctest: +SKIP
        >>> import torch
        >>> import lightning_distgrad.rpc as rpc
        >>> import lightning_distgrad.autograd as dist_autograd
        >>> # On worker 0:
        >>> rpc.init_rpc()
        >>> t1 = torch.rand((3, 3), requires_grad=True)
        >>> t2 = torch.rand((3, 3), requires_grad=True)
        >>> with dist_autograd.context() as context_id:
        ...     loss = rpc.rpc_sync("worker1", torch.add, args=(t1, t2)).sum()
        ...     dist_autograd.backward(context_id, [loss])
        ...     grads = dist_autograd.get_gradients(context_id)
        >>> grads[t1]
        tensor([[1., 1., 1.], [1., 1., 1.], [1., 1., 1.]])
        >>> rpc.shutdown()
    """

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict

    def __enter__(self) -> int:
        self.autograd_context = _new_context()
        self.autograd_context.strict = self.strict
        return self.autograd_context._context_id()

    def __exit__(self, type: Any, value: Any, traceback: Any) -> None:
        _release_context(self.autograd_context._context_id())


def backward(
    context_id: int,
    roots: list[torch.Tensor],
    retain_graph: bool = False,
    *,
    strict: bool | None = None,
) -> None:
    r"""Run the distributed backward pass from ``roots`` in context ``context_id``.

    Computes the gradients of the roots with respect to every tensor that
    reaches them, on every worker, and nothing else: leaves and RPCs that do not
    reach the roots get no gradient (as with local autograd). Gradients of
    leaves go into the context of the worker that owns them (read them with
    :func:`get_gradients` there), summed over repeated passes; ``.grad`` is not
    touched. Returns when every worker the pass reached is done.

    Args:
        context_id (int): the id yielded by :class:`context`.
        roots (list[Tensor]): scalar tensors to differentiate.
        retain_graph (bool): keep the graph (on every worker) for another pass.
        strict (bool, optional): ``True``: every RPC of the context carrying
            tensors that require grad (and not consumed by an earlier pass) must
            reach the roots; one that does not makes the pass raise, naming its
            autograd message id and workers. ``None`` (default): the context's
            setting (:class:`context`'s ``strict``, ``False`` unless given).

    Example::
        >>> # xdoctest: +SKIP
        >>> with dist_autograd.context() as context_id:
        ...     pred = rpc.rpc_sync("worker1", torch.mul, args=(w, x))
        ...     loss = ((pred - y) ** 2).sum()
        ...     dist_autograd.backward(context_id, [loss])
        >>> with dist_autograd.context() as context_id:
        ...     unused = rpc.rpc_sync("worker1", torch.add, args=(w, x))
        ...     dist_autograd.backward(context_id, [(w * x).sum()])  # fine
        ...     dist_autograd.backward(context_id, [(w * x).sum()], strict=True)  # raises
    """
    run_recorded(_engine.BACKWARD_SPAN, _engine.backward, context_id, roots, retain_graph, strict)


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    r"""The gradients accumulated on this worker in ``context_id``, keyed by leaf tensor.

    Example::
        >>> # xdoctest: +SKIP
        >>> with dist_autograd.context() as context_id:
        ...     loss = rpc.rpc_sync("worker1", torch.add, args=(t1, t2)).sum()
        ...     dist_autograd.backward(context_id, [loss])
        ...     dist_autograd.get_gradients(context_id)[t1]
    """
    return container().retrieve(context_id).gradients()


def _new_context() -> DistAutogradContext:
    return container().new_context()


def _release_context(context_id: int) -> None:
    ctx = container().release(context_id)
    _release_on_known_workers(ctx)


def _release_on_known_workers(ctx: DistAutogradContext | None, done: int | None = None) -> None:
    """Tell the workers ``ctx`` reached (but ``done``, which released it) to release it."""
    agent = _internal.current_agent()
    if ctx is None or agent is None:
        return
    for worker in ctx._known_worker_ids() - {container().worker_id, done}:
        # Fire and forget (torch does not await it either): applied on arrival in
        # order, so no later message can find the context again. Counted by graceful
        # shutdown.
        agent.send_one_way(worker, Kind.CONTEXT_RELEASE, ContextRelease(ctx._context_id()))


def _retrieve_context(context_id: int) -> DistAutogradContext:
    return container().retrieve(context_id)


def _find_context(context_id: int) -> DistAutogradContext | None:
    """This worker's context ``context_id``; None if none of its messages reached this
    worker (or it was released here)."""
    check_context_id(context_id)
    return container().find(context_id)


def _gradients_here(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """Like :func:`get_gradients`, but empty where the context never reached this worker
    (an owner whose parameters got no gradient in it)."""
    ctx = _find_context(context_id)
    return {} if ctx is None else ctx.gradients()


def _current_context() -> DistAutogradContext:
    cont = container()
    context_id = cont.current_id()
    if context_id is None:
        raise RuntimeError(
            "Current thread doesn't have a valid autograd context. Please wrap your code "
            "using: `with lightning_distgrad.autograd.context() as context_id` to generate "
            "a valid context"
        )
    return cont.retrieve(context_id)


def _is_valid_context(context_id: int) -> None:
    container().retrieve(context_id)


def _get_max_id() -> int:
    return container().max_id


def _get_debug_info() -> dict[str, int]:
    return {
        "num_current_backward_passes": _engine.num_backward_passes(),
        "num_autograd_contexts": len(container()),
    }


# ---------------------------------------------------------------------------
# Recording, called by the RPC layer for every message


class _AutogradHooks(_internal.AutogradHooks):
    def on_init(self, worker_id: int) -> None:
        _context.init_container(worker_id)

    def outgoing(
        self,
        dst_id: int,
        tensors: list[torch.Tensor],
        force: bool,
        ctx_id: int | None = None,
        *,
        operator: bool = False,
        call_id: int | None = None,
    ) -> Any:
        cont = _context.current_container()
        if cont is None:
            return None
        responding = ctx_id is not None
        if ctx_id is None:
            ctx_id = cont.current_id()
            if ctx_id is None:
                return None
        grad_idx = [i for i, t in enumerate(tensors) if t.requires_grad]
        if not grad_idx and not force:
            return None
        ctx = cont.find(ctx_id)
        if ctx is None:
            return None
        msg_id = node = devices = None
        # A request made under torch.no_grad() records nothing. A response
        # (``ctx_id`` given) is recorded whenever its tensors require grad: the
        # callee's grad mode already decided that, and its reply may be sent
        # from any thread.
        if grad_idx and (responding or torch.is_grad_enabled()):
            msg_id = cont.new_message_id()
            sent = [tensors[i] for i in grad_idx]
            node = record_send(sent)
            # Gradients come back through host memory: only non-CPU ones move.
            if not all(t.is_cpu for t in sent):
                devices = [t.device for t in sent]
        else:
            grad_idx = []
        with ctx.lock:
            if node is not None:
                ctx.sends[msg_id] = node
                ctx.send_peers[msg_id] = dst_id
            if devices is not None:
                ctx.send_devices[msg_id] = devices
            ctx.known_workers.add(dst_id)
            if responding:
                request = ctx.op_requests.pop((dst_id, call_id), None)
                if request is not None and node is not None:
                    ctx.op_sends[msg_id] = request
        # The last field marks a request of a torch operator carrying a gradient.
        return (ctx_id, msg_id, tuple(grad_idx), operator and msg_id is not None)

    def incoming(
        self, meta: Any, src_id: int, tensors: list[torch.Tensor], call_id: int | None = None
    ) -> list:
        if meta is None:
            return tensors
        ctx_id, msg_id, grad_idx, operator = meta
        ctx = container().get_or_create(ctx_id)
        if ctx is None or msg_id is None:
            return tensors
        received = [tensors[i] for i in grad_idx]
        outs, node = record_recv(received)
        tensors = list(tensors)
        for i, out in zip(grad_idx, outs, strict=False):
            tensors[i] = out
        with ctx.lock:
            ctx.recvs[msg_id] = node
            ctx.recv_peers[msg_id] = src_id
            ctx.recv_meta[msg_id] = [(t.shape, t.dtype) for t in received]
            if operator and call_id is not None:
                ctx.op_requests[(src_id, call_id)] = msg_id
        return tensors

    def context_of(self, meta: Any) -> int | None:
        if meta is None:
            return None
        cont = _context.current_container()
        if cont is None or cont.get_or_create(meta[0]) is None:
            return None  # released already: run without recording
        return meta[0]

    def current_context(self) -> int | None:
        cont = _context.current_container()
        return cont.current_id() if cont is not None else None

    def call_in(self, ctx_id: int | None, fn: Callable[..., Any], *args: Any) -> Any:
        cont = _context.current_container()
        previous = cont.current_id() if cont is not None else ctx_id
        if previous == ctx_id:  # nothing to switch (the usual case off a user thread)
            return fn(*args)
        cont.set_current_id(ctx_id)
        try:
            return fn(*args)
        finally:
            cont.set_current_id(previous)

    def backward(self, ctx_id: int, roots: list[torch.Tensor], retain_graph: bool) -> None:
        _engine.backward(ctx_id, roots, retain_graph)

    def debug_info(self) -> dict[str, int]:
        return _get_debug_info()


def _on_context_release(source: int, body: ContextRelease, tensors: list) -> None:
    """Release the context here and on the workers it reached from here (transitively)."""
    _release_on_known_workers(container().release(body.context_id, must_exist=False), done=source)


_internal.install_autograd_hooks(_AutogradHooks())
register_one_way(Kind.CONTEXT_RELEASE, ContextRelease, _on_context_release)
register_one_way(Kind.CREDIT, _messages.CreditReturn, _shipping.on_credit)
register_one_way(
    Kind.GRADIENTS,
    _messages.Gradients,
    _engine.on_gradients,
    serve=True,
    waiter_key=lambda body: body.pass_id,
)
