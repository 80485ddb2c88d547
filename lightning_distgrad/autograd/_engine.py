"""The FAST-mode distributed backward engine.

On each worker a pass owns the local graph reachable from its roots and from
every send function of the context (FAST mode: all sends take part). The
engine's own work is bookkeeping: dependency counts across the points where
gradients enter (the roots, send functions whose peer shipped gradients) and
leave (recv functions, leaves). The node-level work runs in PyTorch's native
engine: each *region* is one native ``torch.autograd.grad`` call that starts at
``GradientEdge``\\ s and stops at recv functions, leaves, and nodes that still
wait for gradients from elsewhere. A node therefore runs once, with its summed
gradient, however many regions feed it.

A send function is an identity: the gradients its peer ships go straight to
the nodes of the tensors it sent, with no native run for the send node itself.

Completion is detected by credit recovery: the root starts with credit 1; a
worker that ships gradient messages splits the credit it got among them and
returns what it keeps to the root, with a report of its state (or an error).
Gradient messages are one-way (nothing answers them), and a message to the
root carries the credit and report back itself, so a pass costs only its
gradient hops. When all the credit is back, every worker has finished its
part; send functions that never got a gradient are RPC results that did not
reach the loss, reported as an error instead of the hang of PyTorch's FAST mode.
"""

from __future__ import annotations

import collections
import itertools
import threading
import traceback
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, _engine_run_backward, get_gradient_edge

from ..rpc import _core
from ..rpc._errors import timeout_error
from ..rpc._wire import Kind
from ._context import ContextContainer, DistAutogradContext, check_context_id, sum_grads
from ._messages import CreditReturn, Gradients

_container: ContextContainer | None = None
_pass_ids = itertools.count()
_pass_creation_lock = threading.Lock()


def container() -> ContextContainer:
    if _container is None:
        raise RuntimeError(
            "Need to initialize distributed autograd using "
            "lightning_distgrad.rpc.init_rpc() first.")
    return _container


def init_container(worker_id: int) -> None:
    global _container
    _container = ContextContainer(worker_id)


def _is_leaf_node(node: Any) -> bool:
    return hasattr(node, "variable")


def _native_grad(outputs: list, inputs: list, grad_outputs: list,
                 retain_graph: bool) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(..., allow_unused=True)`` without its Python-side checks.

    The engine call behind ``torch.autograd.grad``: on small graphs the checks
    (``_make_grads``, argument normalisation) took twice as long as the native
    pass itself (85-170 vs 30-45 us for a 3x3 region here). They add nothing
    for gradients built by this engine, and the native engine still validates
    every gradient's shape against the node it enters.
    """
    return _engine_run_backward(tuple(outputs), tuple(grad_outputs), retain_graph, False,
                                tuple(inputs), True, False)


# ---------------------------------------------------------------------------
# Credits: exact dyadic fractions ``n / 2**e`` as ``(n, e)`` int pairs. Splitting and
# summing them is integer arithmetic (a Fraction operation cost 1-2 us, about 15 per
# pass), they travel as the pair, and unlike a fixed integer budget they never run out.

Credit = tuple[int, int]
NO_CREDIT: Credit = (0, 0)
ALL_CREDIT: Credit = (1, 0)


def split_credit(credit: Credit, parts: int) -> tuple[Credit, Credit]:
    """(each of ``parts`` equal shares, the remainder): ``parts`` shares plus the
    remainder make ``credit`` exactly."""
    n, e = credit
    bits = (parts - 1).bit_length()  # 2**bits >= parts
    return (n, e + bits), (n * ((1 << bits) - parts), e + bits)


def add_credit(a: Credit, b: Credit) -> Credit:
    (n1, e1), (n2, e2) = a, b
    if e1 < e2:
        return (n1 << (e2 - e1)) + n2, e2
    return n1 + (n2 << (e1 - e2)), e1


def is_all_credit(credit: Credit) -> bool:
    n, e = credit
    return n == 1 << e


# ---------------------------------------------------------------------------
# The local graph of a pass


class _Graph:
    """Edges, parents and incoming-edge counts of the nodes reachable from ``starts``."""

    def __init__(self, starts: list, recvs: set):
        self.children: dict[Any, list[tuple[Any, int]]] = {}
        self.parents: dict[Any, list[Any]] = collections.defaultdict(list)
        self.remaining: dict[Any, int] = collections.defaultdict(int)
        self.boundary: set = set()
        seen = set(starts)
        queue = list(starts)
        while queue:
            node = queue.pop()
            if node in recvs or _is_leaf_node(node):
                self.boundary.add(node)
                self.children[node] = []
                continue
            kids = [(c, nr) for c, nr in node.next_functions if c is not None]
            self.children[node] = kids
            for child, _ in kids:
                self.remaining[child] += 1
                self.parents[child].append(node)
                if child not in seen:
                    seen.add(child)
                    queue.append(child)

    def descendants(self, nodes) -> set:
        out: set = set()
        queue = [c for n in nodes for c, _ in self.children[n]]
        while queue:
            node = queue.pop()
            if node not in out:
                out.add(node)
                queue.extend(c for c, _ in self.children[node])
        return out


class _Pass:
    """One backward pass of one context on this worker."""

    def __init__(self, ctx: DistAutogradContext, pass_id: tuple, retain_graph: bool,
                 root_edges: list[GradientEdge]):
        self.ctx = ctx
        self.pass_id = pass_id
        self.retain_graph = retain_graph
        self.lock = threading.Lock()
        with ctx.lock:
            # Sends whose graph an earlier pass freed (no retain_graph) take no
            # part: a second forward in the same context starts afresh.
            sends = {mid: node for mid, node in ctx.sends.items()
                     if mid not in ctx.consumed_sends}
            self.recv_ids = {node: mid for mid, node in ctx.recvs.items()}
        self.send_nodes = sends
        self.pending_sends = set(sends)
        self.graph = _Graph([e.node for e in root_edges] + list(sends.values()),
                            set(self.recv_ids))
        for edge in root_edges:
            self.graph.remaining[edge.node] += 1
        for node in sends.values():
            self.graph.remaining[node] += 1
        self.buffers: dict[Any, dict[int, torch.Tensor]] = {}
        self.finalized: set = set()
        self.held_hooks: dict[Any, dict] = {}  # leaf node -> hooks taken off it
        self.seq = 0
        # Root only, under credit_lock (never held during graph work): the
        # credit back so far, the workers' reports, the first error.
        self.credit_lock = threading.Lock()
        self.credit = NO_CREDIT
        self.reports: list[tuple] = []
        self.error: BaseException | None = None
        self.finished = torch.futures.Future()  # set when all credit is back

    # -- deliveries ---------------------------------------------------------------

    def _add(self, node: Any, nr: int, grad: torch.Tensor | None) -> None:
        if grad is None:
            return
        slots = self.buffers.setdefault(node, {})
        slots[nr] = sum_grads(slots.get(nr), grad)

    def deliver_roots(self, root_edges: list[GradientEdge],
                      grads: list[torch.Tensor]) -> list[tuple[int, list]]:
        """Gradients for the roots; returns the gradient messages to ship."""
        with self.lock:
            for edge, grad in zip(root_edges, grads, strict=False):
                self._add(edge.node, edge.output_nr, grad)
                self.graph.remaining[edge.node] -= 1
            return self._run()

    def deliver_sends(self, items: list[tuple[int, list[torch.Tensor]]]) -> list[tuple[int, list]]:
        """Gradients for send functions (``(message id, gradients)`` pairs) from one peer;
        returns the gradient messages to ship."""
        with self.lock:
            for msg_id, grads in items:
                self._deliver_send(msg_id, grads)
            return self._run()

    def _deliver_send(self, msg_id: int, grads: list[torch.Tensor]) -> None:
        if msg_id not in self.pending_sends:
            if msg_id in self.ctx.consumed_sends and msg_id not in self.send_nodes:
                raise RuntimeError(
                    "Trying to backward through the graph a second time: the send "
                    f"function of autograd message {msg_id} already ran in a pass "
                    "without retain_graph, which freed its graph. Specify "
                    "retain_graph=True if you need to backward through the graph a "
                    "second time.")
            raise RuntimeError(f"Send function for autograd message id {msg_id} got its "
                               "gradients twice in one backward pass")
        node = self.send_nodes[msg_id]
        self.pending_sends.discard(msg_id)
        if not self.retain_graph:
            with self.ctx.lock:
                self.ctx.consumed_sends.add(msg_id)
        devices = self.ctx.send_devices.get(msg_id, ())
        remaining = self.graph.remaining
        remaining[node] -= 1
        # The send node is an identity: its gradients go straight to the nodes
        # of the tensors it sent (a native run of it would only copy them).
        for nr, ((child, child_nr), grad) in enumerate(zip(node.next_functions, grads,
                                                           strict=True)):
            if child is None:
                continue
            if nr < len(devices) and grad.device != devices[nr]:
                grad = grad.to(devices[nr])  # gradients travel through host memory
            if _is_leaf_node(child):
                self._hold_hooks(child)
            self._add(child, child_nr, grad)
            remaining[child] -= 1

    # -- regions --------------------------------------------------------------------

    def _run(self) -> list[tuple[int, list]]:
        """Run every region that is ready; returns one gradient message per peer."""
        by_peer: dict[int, list] = {}
        while self._run_region():
            self._finalize_boundary(by_peer)
        self._finalize_boundary(by_peer)
        return list(by_peer.items())

    def _run_region(self) -> bool:
        graph = self.graph
        remaining = graph.remaining
        starts = [n for n in self.buffers if remaining[n] == 0 and n not in graph.boundary]
        if not starts:
            return False
        # Nodes whose every incoming edge is delivered once ``starts`` run.
        rem: dict[Any, int] = {}
        ready: list = []
        in_ready: set = set()
        queue = list(starts)
        while queue:
            node = queue.pop()
            if node in in_ready:
                continue
            in_ready.add(node)
            ready.append(node)
            for child, _ in graph.children[node]:
                r = rem.get(child, remaining[child]) - 1
                rem[child] = r
                if r == 0 and child not in graph.boundary:
                    queue.append(child)
        for node in ready:  # dead ends (no input needs grad): nothing to run
            if not graph.children[node]:
                self.buffers.pop(node, None)
        frontier = {c for n in ready for c, _ in graph.children[n] if c not in in_ready}
        waiting = [c for c in frontier if c not in graph.boundary]
        blocked = graph.descendants(waiting)
        # Run only nodes that lead somewhere useful now; the rest wait with
        # their gradients buffered until what blocks them has run.
        targets = frontier - blocked
        useful: set = set()
        queue = [p for t in targets for p in graph.parents[t] if p in in_ready]
        while queue:
            node = queue.pop()
            if node not in useful:
                useful.add(node)
                queue.extend(p for p in graph.parents[node] if p in in_ready)
        useful.update(n for n in starts if any(c in targets for c, _ in graph.children[n]))
        run = [n for n in ready if n in useful]
        if not run:
            return False
        run_set = set(run)
        capture = sorted({(c, nr) for n in run for c, nr in graph.children[n]
                          if c not in run_set}, key=lambda e: (id(e[0]), e[1]))
        captured_nodes = {c for c, _ in capture}
        interior = [c for c in captured_nodes if c not in graph.boundary]
        if captured_nodes & graph.descendants(interior):
            raise RuntimeError(
                "lightning_distgrad cannot split this graph into native regions: a tensor that "
                "is still waiting for gradients from another worker feeds nodes that also "
                "receive gradients now. Please report this graph shape.")
        outputs, grad_outputs = [], []
        for node in run:
            for nr, grad in self.buffers.pop(node, {}).items():
                outputs.append(GradientEdge(node, nr))
                grad_outputs.append(grad)
        self._hold_hooks_of_partial_leaves(captured_nodes, rem)
        grads = _native_grad(outputs, [GradientEdge(c, nr) for c, nr in capture],
                             grad_outputs, self.retain_graph)
        for (child, nr), grad in zip(capture, grads, strict=False):
            self._add(child, nr, grad)
        for node in run:
            for child, _ in graph.children[node]:
                remaining[child] -= 1
        return True

    def _hold_hooks_of_partial_leaves(self, captured: set, rem: dict) -> None:
        """Leaf hooks must see the full gradient once: take them off partial leaves."""
        for node in captured:
            if _is_leaf_node(node) and (rem.get(node, self.graph.remaining[node]) > 0
                                        or node in self.buffers):
                self._hold_hooks(node)

    def _hold_hooks(self, leaf: Any) -> None:
        """Take ``leaf``'s hooks off until its gradient is complete (see _run_held_hooks)."""
        hooks = getattr(leaf.variable, "_backward_hooks", None)
        if hooks and leaf not in self.held_hooks:
            self.held_hooks[leaf] = dict(hooks)
            hooks.clear()

    # -- leaving the local graph ------------------------------------------------------

    def _finalize_boundary(self, by_peer: dict[int, list]) -> None:
        """Accumulate complete leaves; add finished recv functions' gradients to ``by_peer``."""
        leaf_grads = []
        remaining = self.graph.remaining
        for node in self.graph.boundary:
            if remaining[node] != 0 or node in self.finalized:
                continue
            self.finalized.add(node)
            grads = self.buffers.pop(node, {})
            if node in self.recv_ids:
                peer, item = self._recv_gradients(node, grads)
                by_peer.setdefault(peer, []).append(item)
            else:
                grad = self._run_held_hooks(node, grads.get(0))
                if grad is not None:
                    leaf_grads.append((node.variable, grad))
        if leaf_grads:
            self.ctx.accumulate(leaf_grads)

    def _run_held_hooks(self, node: Any, grad: torch.Tensor | None) -> torch.Tensor | None:
        """Give a leaf its hooks back, and run them on its (now full) gradient."""
        hooks = self.held_hooks.pop(node, None)
        if hooks is not None:
            node.variable._backward_hooks.update(hooks)
            if grad is not None:
                for hook in hooks.values():
                    result = hook(grad)
                    grad = grad if result is None else result
        return grad

    def _recv_gradients(self, node: Any, grads: dict[int, torch.Tensor]) -> tuple[int, tuple]:
        """(peer, (message id, one gradient per output)) for a finished recv function."""
        msg_id = self.recv_ids[node]
        with self.ctx.lock:
            peer = self.ctx.recv_peers[msg_id]
            metas = self.ctx.recv_meta[msg_id]
        # Shipped through host memory: no device map needed for gradients.
        full = [grads[i].cpu() if grads.get(i) is not None else torch.zeros(shape, dtype=dtype)
                for i, (shape, dtype) in enumerate(metas)]
        return peer, (msg_id, full)

    # -- state ----------------------------------------------------------------------

    def complete(self) -> bool:
        return not self.pending_sends and not self.buffers

    def report(self, worker_id: int) -> tuple:
        """(worker, sequence, unused sends) for the root's final check."""
        with self.lock:
            self.seq += 1
            pending = [(mid, worker_id, self.ctx.send_peers.get(mid)) for mid in
                       sorted(self.pending_sends)]
            return (worker_id, self.seq, pending)

    def close(self) -> None:
        for node, hooks in self.held_hooks.items():
            node.variable._backward_hooks.update(hooks)
        self.held_hooks.clear()

    # -- credit (root only) -----------------------------------------------------------

    def return_credit(self, credit: Credit, report: tuple | None,
                      error: BaseException | None) -> None:
        """Credit back from a worker (with its report or error); all back: the pass is over."""
        with self.credit_lock:
            if self.finished.done():
                return  # timed out already
            self.credit = add_credit(self.credit, credit)
            if report is not None:
                self.reports.append(report)
            if error is not None and self.error is None:
                self.error = error
            if is_all_credit(self.credit):
                self.finished.set_result(None)

    def expire(self, timeout: float) -> None:
        """The pass ran past the RPC timeout: stop waiting for the credit still out."""
        with self.credit_lock:
            if not self.finished.done():
                self.error = timeout_error(timeout)
                self.finished.set_result(None)


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


def backward(context_id: int, roots: list[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the distributed backward pass from ``roots`` (on the worker that calls it)."""
    check_context_id(context_id)
    if not isinstance(roots, (list, tuple)):
        raise TypeError(f"backward(): roots must be a list of tensors, got "
                        f"{type(roots).__name__}")
    cont = container()
    ctx = cont.retrieve(context_id)
    edges = _root_edges(list(roots))
    with ctx.lock:
        local = not ctx.recvs and ctx.consumed_sends.issuperset(ctx.sends)
    if local and _local_backward(ctx, list(roots), edges, retain_graph):
        return
    p = _Pass(ctx, (cont.worker_id, next(_pass_ids)), retain_graph, edges)
    ctx.backward_pass = p
    try:
        try:
            messages = p.deliver_roots(edges, [torch.ones_like(r) for r in roots])
        except Exception as e:
            p.return_credit(ALL_CREDIT, None, _wrap_error(cont.worker_id, e))
        else:
            _ship(p, messages, ALL_CREDIT)
        _wait_for_credit(p)
        # Workers whose sends still wait for gradients (unused RPC results, or
        # an error cut the pass short) hold state for the pass: end it there.
        own = p.report(cont.worker_id)
        latest = _latest_reports(p.reports + [own])
        stuck = sorted(w for w, pending in latest.items() if pending and w != own[0])
        for fut in [_core.invoke(w, _end_pass_here, (context_id, p.pass_id), None,
                                 _core.UNSET_RPC_TIMEOUT, user_visible=False,
                                 force_autograd=False) for w in stuck]:
            try:
                _core.wait(fut)
            except Exception:  # that worker's part ends with its context anyway
                pass
        if p.error is not None:
            raise p.error
        _check_all_sends_used(context_id, latest)
    finally:
        _end_pass(ctx, p)


def _wait_for_credit(p: _Pass) -> None:
    """Wait (polling MPI) until all credit is back or the RPC timeout passes."""
    agent = _core.require_agent()
    # This pass's gradient messages to the root run on this thread (their waiter key
    # is the pass id): they are what it waits for.
    if not agent.wait_done(p.finished, agent.timeout, key=p.pass_id):
        p.expire(agent.timeout)


def _local_backward(ctx: DistAutogradContext, roots: list[torch.Tensor],
                    edges: list[GradientEdge], retain_graph: bool) -> bool:
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
        grads = _native_grad(roots, [GradientEdge(n, 0) for n in leaves],
                             [torch.ones_like(r) for r in roots], retain_graph)
    except Exception as e:
        raise _wrap_error(container().worker_id, e) from None
    ctx.accumulate([(n.variable, g) for n, g in zip(leaves, grads, strict=True)
                    if g is not None])
    return True


def _leaf_nodes(starts: list) -> list:
    """The AccumulateGrad nodes reachable from ``starts``."""
    seen = set(starts)
    stack = list(starts)
    leaves = [n for n in starts if _is_leaf_node(n)]
    while stack:
        for child, _ in stack.pop().next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                if _is_leaf_node(child):
                    leaves.append(child)
                else:
                    stack.append(child)
    return leaves


def _end_pass(ctx: DistAutogradContext, p: _Pass) -> None:
    p.close()
    with _pass_creation_lock:
        if ctx.backward_pass is p:
            ctx.backward_pass = None


def _end_pass_here(context_id: int, pass_id: tuple) -> None:
    """Runs on a worker whose part of a pass cannot complete (unused sends)."""
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
        described = "; ".join(f"autograd message {mid} (worker {src} -> worker {dst})"
                              for mid, src, dst in unused)
        raise RuntimeError(
            f"Distributed backward in context {context_id} finished, but {len(unused)} RPC(s) "
            f"carrying tensors that require grad got no gradient: {described}. Their results "
            "were not used to compute the roots (FAST mode expects every RPC of the context "
            "to take part). Use the results in the loss, or send detached tensors / run "
            "such RPCs under torch.no_grad() or outside the context.")


def _ship(p: _Pass, messages: list[tuple[int, list]], credit: Credit) -> None:
    """Send gradient messages, splitting ``credit`` among them; return the rest to the root.

    A message to the root carries this worker's report itself; otherwise a
    credit return (a CREDIT frame, applied on arrival) does.
    """
    root = p.pass_id[0]
    me = container().worker_id
    context_id = p.ctx._context_id()
    to_root = me != root and any(peer == root for peer, _ in messages)
    share, kept = split_credit(credit, len(messages) + (0 if to_root else 1))
    if not to_root:
        kept = add_credit(kept, share)
    report = p.report(me) if me != root else None
    error = None
    agent = _core.require_agent()
    for peer, items in messages:
        carried = report if peer == root else None
        layout = [(msg_id, len(grads)) for msg_id, grads in items]
        try:
            agent.send_one_way(
                peer, Kind.GRADIENTS,
                Gradients(context_id, layout, p.retain_graph, p.pass_id, share, carried),
                [g for _, grads in items for g in grads])
        except Exception as e:  # never sent: its credit and report come back here
            kept = add_credit(kept, share)
            error = error or _wrap_error(me, e).with_traceback(e.__traceback__)
            to_root = to_root and carried is None
    if kept[0] or not to_root:
        _return_credit(context_id, p.pass_id, kept, None if to_root else report, error)


def _return_credit(context_id: int, pass_id: tuple, credit: Credit, report: tuple | None,
                   error: BaseException | None) -> None:
    root = pass_id[0]
    if root == container().worker_id:
        apply_credit(context_id, pass_id, credit, report, error)
    else:
        text = None if error is None else _error_text(error)
        _core.require_agent().send_one_way(
            root, Kind.CREDIT, CreditReturn(context_id, pass_id, credit, report, text))


def _error_text(error: BaseException) -> str:
    """The error as the root raises it: "Error on Node N: ...", then where it happened."""
    where = "".join(traceback.format_tb(error.__traceback__)) if error.__traceback__ else ""
    return f"{error}\n{where}" if where else str(error)


def on_credit(source: int, body: CreditReturn, tensors: list) -> None:
    """A CREDIT message, applied on arrival (must not block)."""
    apply_credit(*body)


def apply_credit(context_id: int, pass_id: tuple, credit: Credit,
                 report: tuple | None, error: BaseException | str | None) -> None:
    """Credit back to the root."""
    cont = _container
    ctx = cont.find(context_id) if cont is not None else None
    p = ctx.backward_pass if ctx is not None else None
    if p is not None and p.pass_id == pass_id:  # else the pass timed out: drop it
        p.return_credit(credit, report,
                        RuntimeError(error) if isinstance(error, str) else error)


def _worker_pass(ctx: DistAutogradContext, pass_id: tuple, retain_graph: bool) -> _Pass:
    """This worker's part of a pass that another worker (the root) started."""
    with _pass_creation_lock:  # concurrent first messages of a pass must share it
        p = ctx.backward_pass
        if p is None or p.pass_id != pass_id:
            p = ctx.backward_pass = _Pass(ctx, pass_id, retain_graph, [])
        return p


def on_gradients(source: int, body: Gradients, tensors: list[torch.Tensor]) -> None:
    """A GRADIENTS message, on the worker that sent the messages it answers."""
    context_id, layout, retain_graph, pass_id, credit, report = body
    items = []
    start = 0
    for msg_id, count in layout:
        items.append((msg_id, tensors[start:start + count]))
        start += count
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
                    f"Could not find send function for autograd message id: {msg_id}")
        messages = p.deliver_sends(items)
    except Exception as e:
        if p is not None and not is_root:
            _end_pass(ctx, p)
        error = _wrap_error(cont.worker_id, e).with_traceback(e.__traceback__)
        _return_credit(context_id, pass_id, credit, None, error)
        return
    if not is_root and p.complete():
        _end_pass(ctx, p)  # before the credit goes back: backward returns after that
    _ship(p, messages, credit)


def num_backward_passes() -> int:
    return sum(c.backward_pass is not None for c in container().all_contexts())
