"""The distributed backward engine: entry points, gradient messages, completion.

A pass starts on the worker that calls :func:`backward` (its *root*). On each
worker it reached, a :class:`~._pass.Pass` owns the local graph reachable from
the roots and from every send function of the context, and runs it in native
regions as gradients arrive (see ``_pass``). Gradient messages are one-way
GRADIENTS frames (``_shipping`` sends them and returns the credit).

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

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from ..rpc import _internal
from ..rpc._internal import run_recorded
from . import _shipping
from ._context import DistAutogradContext, check_context_id, container
from ._credit import ALL_CREDIT, NO_CREDIT
from ._graph import is_leaf_node
from ._leaves import LeafGradients
from ._messages import Gradients, decode_gradients
from ._pass import Pass, native_grad
from ._shipping import (
    RECEIVE_SPAN,
    answer_operators,
    deliver_and_ship,
    end_pass,
    latest_reports,
    message_span,
    operators_alone,
    return_credit,
    wait_for_credit,
    worker_pass,
    wrap_error,
)
from ._smart import settle_waiting_sends
from ._wrappers import check_no_sharded_modules

#: The profiler span of a whole pass on its root (torch's name); the spans of its local work
#: and messages are in ``_shipping``.
BACKWARD_SPAN = "torch::distributed::autograd::backward"


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
    p = Pass(ctx, (cont.worker_id, next(_shipping.pass_ids)), retain_graph, edges)
    ctx.backward_pass = p
    involved: set[int] = set()  # workers a settling round asked about the pass
    # The pass's gradient messages to this worker run on this thread, even those that
    # come back before it waits: they are the work it waits for.
    try:
        with _internal.require_agent().waiting.waiting_for(p.pass_id):
            ones = [torch.ones_like(r) for r in roots]
            deliver_and_ship(p, ALL_CREDIT, p.deliver_roots, edges, ones)
            wait_for_credit(p)
            latest = latest_reports(p.reports + [p.report(cont.worker_id)])
            if p.error is None and not strict and any(latest.values()):
                latest = settle_waiting_sends(p, latest, involved)
            # Workers whose sends still wait for gradients (unused RPC results in a
            # strict pass, or an error cut the pass short) or that a settling round
            # asked hold state for the pass: end it there.
            stuck = {w for w, pending in latest.items() if pending} | involved
            stuck.discard(cont.worker_id)
            for fut in [
                _internal.invoke(
                    w,
                    _end_pass_here,
                    (context_id, p.pass_id),
                    None,
                    _internal.UNSET_RPC_TIMEOUT,
                    user_visible=False,
                    force_autograd=False,
                )
                for w in sorted(stuck)
            ]:
                try:
                    _internal.wait(fut)
                except Exception:  # that worker's part ends with its context anyway
                    pass
            if p.error is not None:
                raise p.error
            # Its DDP parameters through DDP's reducer, now that this thread polls no more.
            p.leaves.finish()
            _check_all_sends_used(context_id, latest)
    finally:
        end_pass(ctx, p)


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
    check_no_sharded_modules()
    try:
        grads = native_grad(
            roots,
            [GradientEdge(n, 0) for n in leaves],
            [torch.ones_like(r) for r in roots],
            retain_graph,
        )
    except Exception as e:
        raise wrap_error(container().worker_id, e) from None
    handed = LeafGradients(ctx)
    handed.add(list(zip(leaves, grads, strict=True)))
    handed.finish()
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


def _end_pass_here(context_id: int, pass_id: tuple) -> None:
    """Runs on a worker whose part of a pass is over without completing here."""
    ctx = container().find(context_id)  # may be released meanwhile
    p = ctx.backward_pass if ctx is not None else None
    if p is not None and p.pass_id == pass_id:
        end_pass(ctx, p)


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


def on_gradients(source: int, body: Gradients, tensors: list[torch.Tensor]) -> None:
    """A GRADIENTS message, on the worker that sent the messages it answers."""
    me = container().worker_id
    name = functools.partial(message_span, RECEIVE_SPAN, source, me, tensors)
    run_recorded(name, _take_gradients, source, body, tensors)


def _take_gradients(source: int, body: Gradients, tensors: list[torch.Tensor]) -> None:
    context_id, layout, retain_graph, pass_id, credit, report, order = body
    items = decode_gradients(layout, tensors, order)
    cont = container()
    is_root = pass_id[0] == cont.worker_id
    ctx = cont.find(context_id)
    p = alone = None
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
            alone = operators_alone(ctx, pass_id, retain_graph, items)
            if alone is None:
                p = worker_pass(ctx, pass_id, retain_graph)
        for msg_id, _ in items:
            if msg_id not in ctx.sends:
                raise RuntimeError(
                    f"Could not find send function for autograd message id: {msg_id}"
                )
    except Exception as e:
        if p is not None and not is_root:
            end_pass(ctx, p)
        error = wrap_error(cont.worker_id, e).with_traceback(e.__traceback__)
        return_credit(context_id, pass_id, credit, None, error)
        return
    if alone is not None:
        answer_operators(ctx, pass_id, retain_graph, credit, alone)
        return
    deliver_and_ship(p, credit, p.deliver_sends, items)


def num_backward_passes() -> int:
    return sum(c.backward_pass is not None for c in container().all_contexts())
