"""The distributed backward engine: entry points, gradient messages, completion.

A pass starts on the worker that calls :func:`backward` (its *root*). On each
worker it reached, a :class:`~._pass.Pass` owns the local graph reachable from
the roots and from every send function of the context, and runs it in native
regions as gradients arrive (see ``_pass``). Gradient messages are one-way
GRADIENTS frames.

Completion is detected by credit recovery: the root starts with credit 1; a
worker that ships gradient messages splits the credit it got among them and
returns what it keeps to the root, with a report of its sends still waiting (or
an error). A message to the root carries the credit and report itself, so a
pass costs only its gradient hops. When all the credit is back, the pass is
*quiescent*: no message is in flight and no worker has work it can do.

Two modes share all of that and differ only in what quiescence with sends still
waiting means:

* SMART (the default) computes the gradients of the roots with respect to every
  tensor that reaches them and nothing else. RPCs whose results do not reach
  the roots take no part. At quiescence, the sends still waiting are settled
  (``_smart``): the root asks the workers involved for their waiting sends and
  unfinished recv functions; a send whose recv function is in no graph of the
  pass can never get a gradient, and the root resolves it as *absent*, which
  lets the nodes waiting on it run. That may ship more gradients: the root
  waits for quiescence again and repeats until no send waits. When every RPC
  takes part (the common case) nothing waits at quiescence, and a SMART pass
  costs exactly what a strict one does; each settling round costs one probe
  RPC per worker involved and one resolve message per worker holding dead sends.
* Strict (``strict=True``, PyTorch's FAST-mode contract): every RPC of the
  context that carries tensors requiring grad must take part. Sends still
  waiting at quiescence end the pass with an error naming each message and its
  two workers, instead of the hang of PyTorch's FAST mode.

In both modes an output that got no gradient travels as absent, not zeros, so
gradients equal those of local autograd on the same values, and an error on
any worker reaches the root (``Error on Node N: ...``), which then ends the
pass on every worker still holding state for it.
"""

from __future__ import annotations

import functools
import itertools
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from ..rpc import _core
from ..rpc._profiling import run_recorded
from ..rpc._sparse import tensor_nbytes
from ..rpc._wire import Kind
from ._context import ContextContainer, DistAutogradContext, check_context_id
from ._credit import (  # noqa: F401  (re-exported)
    ALL_CREDIT,
    NO_CREDIT,
    Credit,
    add_credit,
    is_all_credit,
    split_credit,
)
from ._graph import is_leaf_node
from ._messages import CreditReturn, Gradients, decode_gradients, encode_gradients
from ._pass import Pass, accumulate_leaves, native_grad

_container: ContextContainer | None = None
_pass_ids = itertools.count()
_pass_creation_lock = threading.Lock()

#: Profiler spans of a pass: the whole pass on its root (torch's name), each stretch of
#: local engine work, and each gradient message sent and handled (``...(worker0 ->
#: worker1)``; a merged timeline also shows their bytes and gradient counts).
BACKWARD_SPAN = "torch::distributed::autograd::backward"
LOCAL_WORK_SPAN = "torch::distributed::autograd::local_work"
SEND_SPAN = "torch::distributed::autograd::send_gradients"
RECEIVE_SPAN = "torch::distributed::autograd::receive_gradients"


def container() -> ContextContainer:
    if _container is None:
        raise RuntimeError(
            "Need to initialize distributed autograd using lightning_distgrad.rpc.init_rpc() first."
        )
    return _container


def init_container(worker_id: int) -> None:
    global _container
    _container = ContextContainer(worker_id)


# ---------------------------------------------------------------------------
# Entry points


def _root_edges(roots: list[torch.Tensor]) -> list[GradientEdge]:
    if not roots:
        raise RuntimeError("No tensors provided for gradient computation.")
    edges = []
    for root in roots:
        if not isinstance(root, torch.Tensor):
            raise TypeError(f"backward(): roots must be tensors, got {type(root).__name__}")
        if not root.requires_grad:
            raise RuntimeError("requires_grad not set on root")
        if root.numel() != 1:
            raise RuntimeError(" is not a scalar, all roots need to be scalar")
        if root.grad_fn is None:
            raise RuntimeError(" does not have a valid gradient function.")
        edges.append(get_gradient_edge(root))
    return edges


def _wrap_error(worker_id: int, e: BaseException) -> RuntimeError:
    text = str(e)
    if text.startswith("Error on Node"):
        return RuntimeError(text)
    return RuntimeError(f"Error on Node {worker_id}: {text}")


def backward(
    context_id: int,
    roots: list[torch.Tensor],
    retain_graph: bool = False,
    strict: bool | None = None,
) -> None:
    """Run the distributed backward pass from ``roots`` (on the worker that calls it).

    ``strict=None`` takes the context's setting (see ``context(strict=...)``).
    """
    check_context_id(context_id)
    if not isinstance(roots, (list, tuple)):
        raise TypeError(
            "backward(): incompatible function arguments: roots must be a list of tensors, "
            f"got {type(roots).__name__}"
        )
    cont = container()
    ctx = cont.retrieve(context_id)
    if strict is None:
        strict = ctx.strict
    edges = _root_edges(list(roots))
    with ctx.lock:
        local = not ctx.recvs and ctx.consumed_sends.issuperset(ctx.sends)
    if local and _local_backward(ctx, list(roots), edges, retain_graph):
        return
    p = Pass(ctx, (cont.worker_id, next(_pass_ids)), retain_graph, edges)
    ctx.backward_pass = p
    involved: set[int] = set()  # workers a settling round asked about the pass
    # The pass's gradient messages to this worker run on this thread, even those that
    # come back before it waits: they are the work it waits for.
    try:
        with _core.require_agent().waiting_for(p.pass_id):
            ones = [torch.ones_like(r) for r in roots]
            deliver_and_ship(p, ALL_CREDIT, p.deliver_roots, edges, ones)
            _wait_for_credit(p)
            latest = _latest_reports(p.reports + [p.report(cont.worker_id)])
            if p.error is None and not strict and any(latest.values()):
                from ._smart import settle_waiting_sends

                latest = settle_waiting_sends(p, latest, involved)
            # Workers whose sends still wait for gradients (unused RPC results in a
            # strict pass, or an error cut the pass short) or that a settling round
            # asked hold state for the pass: end it there.
            stuck = {w for w, pending in latest.items() if pending} | involved
            stuck.discard(cont.worker_id)
            for fut in [
                _core.invoke(
                    w,
                    _end_pass_here,
                    (context_id, p.pass_id),
                    None,
                    _core.UNSET_RPC_TIMEOUT,
                    user_visible=False,
                    force_autograd=False,
                )
                for w in sorted(stuck)
            ]:
                try:
                    _core.wait(fut)
                except Exception:  # that worker's part ends with its context anyway
                    pass
            if p.error is not None:
                raise p.error
            _check_all_sends_used(context_id, latest)
    finally:
        _end_pass(ctx, p)


def _wait_for_credit(p: Pass) -> None:
    """Wait (polling MPI) until all credit is back or the RPC timeout passes."""
    agent = _core.require_agent()
    # This pass's gradient messages to the root run on this thread (their waiter key
    # is the pass id): they are what it waits for.
    if not agent.wait_done(p.finished, agent.timeout, key=p.pass_id):
        p.expire(agent.timeout)


def _local_backward(
    ctx: DistAutogradContext,
    roots: list[torch.Tensor],
    edges: list[GradientEdge],
    retain_graph: bool,
) -> bool:
    """A context that exchanged no gradients: one native pass to its leaves.

    The general engine would do the same with more bookkeeping (graph copy,
    regions, boundary); this keeps a purely local backward near plain
    autograd's cost. False if there is nothing to capture (the caller then
    takes the general path).
    """
    leaves = _leaf_nodes([e.node for e in edges])
    if not leaves:
        return False
    try:
        grads = native_grad(
            roots,
            [GradientEdge(n, 0) for n in leaves],
            [torch.ones_like(r) for r in roots],
            retain_graph,
        )
    except Exception as e:
        raise _wrap_error(container().worker_id, e) from None
    accumulate_leaves(ctx, [(n, g) for n, g in zip(leaves, grads, strict=True) if g is not None])
    return True


def _leaf_nodes(starts: list) -> list:
    """The AccumulateGrad nodes reachable from ``starts``."""
    seen = set(starts)
    stack = list(starts)
    leaves = [n for n in starts if is_leaf_node(n)]
    while stack:
        for child, _ in stack.pop().next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                if is_leaf_node(child):
                    leaves.append(child)
                else:
                    stack.append(child)
    return leaves


def _end_pass(ctx: DistAutogradContext, p: Pass) -> None:
    p.close()
    with _pass_creation_lock:
        ctx.ended_pass_id = p.pass_id
        if ctx.backward_pass is p:
            ctx.backward_pass = None


def _end_pass_here(context_id: int, pass_id: tuple) -> None:
    """Runs on a worker whose part of a pass is over without completing here."""
    ctx = container().find(context_id)  # may be released meanwhile
    p = ctx.backward_pass if ctx is not None else None
    if p is not None and p.pass_id == pass_id:
        _end_pass(ctx, p)


def _latest_reports(reports: list[tuple]) -> dict[int, list]:
    """Each worker's unused sends, from its latest report."""
    latest: dict[int, tuple] = {}
    for worker, seq, pending in reports:
        if worker not in latest or seq > latest[worker][0]:
            latest[worker] = (seq, pending)
    return {worker: pending for worker, (_, pending) in latest.items()}


def _check_all_sends_used(context_id: int, latest: dict[int, list]) -> None:
    unused = [item for pending in latest.values() for item in pending]
    if unused:
        described = "; ".join(
            f"autograd message {mid} (worker {src} -> worker {dst})" for mid, src, dst in unused
        )
        raise RuntimeError(
            f"Distributed backward in context {context_id} finished, but {len(unused)} RPC(s) "
            f"carrying tensors that require grad got no gradient: {described}. Their results "
            "were not used to compute the roots (a strict pass expects every RPC of the "
            "context to take part). Use the results in the loss, send detached tensors / run "
            "such RPCs under torch.no_grad() or outside the context, or run the pass "
            "without strict=True."
        )


def _message_span(name: str, src: int, dst: int, tensors: list) -> tuple[str, dict]:
    """The span of one gradient message: its route in the name, its size in the args."""
    infos = _core.require_agent().infos
    route = f"{infos[src].name} -> {infos[dst].name}"
    size = {"bytes": sum(tensor_nbytes(t) for t in tensors), "gradients": len(tensors)}
    return f"{name}({route})", size


def send_gradients(
    agent,
    peer: int,
    p: Pass,
    items: list[tuple[int, list | None]],
    credit: Credit,
    report: tuple | None,
) -> None:
    """One GRADIENTS frame to ``peer`` for ``(message id, gradients)`` items of pass ``p``."""
    layout, tensors = encode_gradients(items)
    body = Gradients(p.ctx._context_id(), layout, p.retain_graph, p.pass_id, credit, report)
    name = functools.partial(_message_span, SEND_SPAN, agent.info.id, peer, tensors)
    devices = agent.gradient_devices(tensors, peer)
    run_recorded(name, agent.send_one_way, peer, Kind.GRADIENTS, body, tensors, devices)


class Outbox:
    """A worker's gradient messages of one delivery, sharing out the credit it came with.

    Messages made while regions still run (:meth:`send_early`) take half the credit left
    and carry no report; :meth:`finish` sends the last ones and returns the credit kept,
    with this worker's report, to the root. A message to the root carries the report
    itself. A message that could not be sent keeps its credit here.
    """

    def __init__(self, p: Pass, credit: Credit):
        self.p = p
        self.credit = credit
        self.error: BaseException | None = None

    def send_early(self, messages: list[tuple[int, list]]) -> None:
        half, rest = split_credit(self.credit, 2)
        kept, _ = self._send(messages, half, None)
        self.credit = add_credit(add_credit(half, rest), kept)

    def finish(self, messages: list[tuple[int, list]]) -> None:
        me, root = container().worker_id, self.p.pass_id[0]
        report = self.p.report(me) if me != root else None
        kept, reported = self._send(messages, self.credit, report)
        self.credit = NO_CREDIT
        if kept[0] or not reported:
            self._return(kept, None if reported else report, self.error)

    def fail(self, error: BaseException) -> None:
        """The delivery failed: the credit not shipped goes back to the root with ``error``."""
        credit, self.credit = self.credit, NO_CREDIT
        self._return(credit, None, error)

    def _return(self, credit: Credit, report: tuple | None, error: BaseException | None) -> None:
        self.error = None  # passed on; its traceback holds this outbox (see Pass.close)
        _return_credit(self.p.ctx._context_id(), self.p.pass_id, credit, report, error)

    def _send(
        self, messages: list[tuple[int, list]], credit: Credit, report: tuple | None
    ) -> tuple[Credit, bool]:
        """Send ``messages`` with equal shares of ``credit``; (credit kept, report sent)."""
        root, agent = self.p.pass_id[0], _core.require_agent()
        reported = report is not None and any(peer == root for peer, _ in messages)
        share, kept = split_credit(credit, len(messages) + (0 if reported else 1))
        if not reported:
            kept = add_credit(kept, share)
        for peer, items in messages:
            carried = report if peer == root else None
            try:
                send_gradients(agent, peer, self.p, items, share, carried)
            except Exception as e:  # never sent: its credit (and report) stay here
                kept = add_credit(kept, share)
                me = container().worker_id
                self.error = self.error or _wrap_error(me, e).with_traceback(e.__traceback__)
                reported = reported and carried is None
        return kept, reported


def _return_credit(
    context_id: int,
    pass_id: tuple,
    credit: Credit,
    report: tuple | None,
    error: BaseException | None,
) -> None:
    root = pass_id[0]
    if root == container().worker_id:
        apply_credit(context_id, pass_id, credit, report, error)
    else:
        text = None if error is None else _error_text(error)
        _core.require_agent().send_one_way(
            root, Kind.CREDIT, CreditReturn(context_id, pass_id, credit, report, text)
        )


def _error_text(error: BaseException) -> str:
    """The error as the root raises it: "Error on Node N: ...", then where it happened."""
    where = "".join(traceback.format_tb(error.__traceback__)) if error.__traceback__ else ""
    return f"{error}\n{where}" if where else str(error)


def on_credit(source: int, body: CreditReturn, tensors: list) -> None:
    """A CREDIT message, applied on arrival (must not block)."""
    apply_credit(*body)


def apply_credit(
    context_id: int,
    pass_id: tuple,
    credit: Credit,
    report: tuple | None,
    error: BaseException | str | None,
) -> None:
    """Credit back to the root."""
    cont = _container
    ctx = cont.find(context_id) if cont is not None else None
    p = ctx.backward_pass if ctx is not None else None
    if p is not None and p.pass_id == pass_id:  # else the pass timed out: drop it
        p.return_credit(credit, report, RuntimeError(error) if isinstance(error, str) else error)


def _worker_pass(ctx: DistAutogradContext, pass_id: tuple, retain_graph: bool) -> Pass:
    """This worker's part of a pass that another worker (the root) started."""
    with _pass_creation_lock:  # concurrent first messages of a pass must share it
        p = ctx.backward_pass
        if p is None or p.pass_id != pass_id:
            p = ctx.backward_pass = Pass(ctx, pass_id, retain_graph, [])
        return p


def on_gradients(source: int, body: Gradients, tensors: list[torch.Tensor]) -> None:
    """A GRADIENTS message, on the worker that sent the messages it answers."""
    me = container().worker_id
    name = functools.partial(_message_span, RECEIVE_SPAN, source, me, tensors)
    run_recorded(name, _take_gradients, source, body, tensors)


def _take_gradients(source: int, body: Gradients, tensors: list[torch.Tensor]) -> None:
    context_id, layout, retain_graph, pass_id, credit, report = body
    items = decode_gradients(layout, tensors)
    cont = container()
    is_root = pass_id[0] == cont.worker_id
    ctx = cont.find(context_id)
    p = None
    try:
        if ctx is None:
            raise RuntimeError(f"Could not find autograd context with id: {context_id}")
        if is_root:
            p = ctx.backward_pass
            if p is None or p.pass_id != pass_id:
                return  # the root's pass is over (timed out): nobody waits for this
            if report is not None:
                p.return_credit(NO_CREDIT, report, None)
        else:
            p = _worker_pass(ctx, pass_id, retain_graph)
        for msg_id, _ in items:
            if msg_id not in ctx.sends:
                raise RuntimeError(
                    f"Could not find send function for autograd message id: {msg_id}"
                )
    except Exception as e:
        if p is not None and not is_root:
            _end_pass(ctx, p)
        error = _wrap_error(cont.worker_id, e).with_traceback(e.__traceback__)
        _return_credit(context_id, pass_id, credit, None, error)
        return
    deliver_and_ship(p, credit, p.deliver_sends, items)


def deliver_and_ship(p: Pass, credit: Credit, deliver: Callable, *args: Any) -> None:
    """Run a delivery to ``p`` (``deliver(*args, ship)``) and ship the gradient messages it
    makes, sharing ``credit``; an error goes back to the root with the credit not shipped.

    A worker other than the root ends its part of the pass once that part is complete or
    failed, before its credit goes back (the root's backward returns after that).
    """
    me = container().worker_id
    outbox = Outbox(p, credit)
    try:
        messages = run_recorded(LOCAL_WORK_SPAN, deliver, *args, outbox.send_early)
    except Exception as e:
        if p.pass_id[0] != me:
            _end_pass(p.ctx, p)
        outbox.fail(_wrap_error(me, e).with_traceback(e.__traceback__))
        return
    if p.pass_id[0] != me and p.complete():
        _end_pass(p.ctx, p)
    outbox.finish(messages)


def num_backward_passes() -> int:
    return sum(c.backward_pass is not None for c in container().all_contexts())
