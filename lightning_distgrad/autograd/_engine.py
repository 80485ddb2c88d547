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

Completion is detected with acknowledgements (Dijkstra-Scholten): a worker
answers a gradient message only when the work it caused, including the
messages it sent, is answered. When the root's own messages are all answered,
the pass is over everywhere; send functions that never got a gradient are
RPC results that did not reach the loss, reported as an error instead of the
hang of PyTorch's FAST mode.
"""

from __future__ import annotations

import collections
import itertools
import threading
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, _engine_run_backward, get_gradient_edge

from ..rpc import _core
from ..rpc._agent import set_error
from ..rpc.functions import async_execution
from ._context import ContextContainer, DistAutogradContext, check_context_id, sum_grads

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
        self.send_ids = {node: mid for mid, node in sends.items()}
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
        self.outstanding: list[torch.futures.Future] = []
        self.reports: list[tuple] = []  # acknowledgements' reports (root only)

    # -- deliveries ---------------------------------------------------------------

    def _add(self, node: Any, nr: int, grad: torch.Tensor | None) -> None:
        if grad is None:
            return
        slots = self.buffers.setdefault(node, {})
        slots[nr] = sum_grads(slots.get(nr), grad)

    def deliver_roots(self, root_edges: list[GradientEdge], grads: list[torch.Tensor]):
        with self.lock:
            for edge, grad in zip(root_edges, grads, strict=False):
                self._add(edge.node, edge.output_nr, grad)
                self.graph.remaining[edge.node] -= 1
            return self._run()

    def deliver_sends(self, items: list[tuple[int, list[torch.Tensor]]]):
        """Gradients for send functions (``(message id, gradients)`` pairs) from one peer."""
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
        devices = self.ctx.send_devices.get(msg_id, ())
        for nr, grad in enumerate(grads):
            if nr < len(devices) and grad.device != devices[nr]:
                grad = grad.to(devices[nr])  # gradients travel through host memory
            self._add(node, nr, grad)
        self.graph.remaining[node] -= 1

    # -- regions --------------------------------------------------------------------

    def _run(self) -> list[torch.futures.Future]:
        """Run every region that is ready; returns the futures of gradients shipped."""
        shipped: list[torch.futures.Future] = []
        while self._run_region():
            shipped.extend(self._finalize_boundary())
        shipped.extend(self._finalize_boundary())
        self.outstanding.extend(shipped)
        return shipped

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
        if not self.retain_graph:
            with self.ctx.lock:
                self.ctx.consumed_sends.update(self.send_ids[n] for n in run
                                               if n in self.send_ids)
        for (child, nr), grad in zip(capture, grads, strict=False):
            self._add(child, nr, grad)
        for node in run:
            for child, _ in graph.children[node]:
                remaining[child] -= 1
        return True

    def _hold_hooks_of_partial_leaves(self, captured: set, rem: dict) -> None:
        """Leaf hooks must see the full gradient once: take them off partial leaves."""
        for node in captured:
            if not _is_leaf_node(node) or node in self.held_hooks:
                continue
            partial = rem.get(node, self.graph.remaining[node]) > 0 or node in self.buffers
            hooks = getattr(node.variable, "_backward_hooks", None)
            if partial and hooks:
                self.held_hooks[node] = dict(hooks)
                hooks.clear()

    # -- leaving the local graph ------------------------------------------------------

    def _finalize_boundary(self) -> list[torch.futures.Future]:
        by_peer: dict[int, list[tuple[int, list[torch.Tensor]]]] = {}
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
        # One message per peer, however many of its recv functions finished.
        return [self._ship(peer, items) for peer, items in by_peer.items()]

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

    def _ship(self, peer: int, items: list[tuple]) -> torch.futures.Future:
        return _core.invoke(peer, _propagate_gradients,
                            (self.ctx._context_id(), items, self.retain_graph, self.pass_id),
                            None, _core.UNSET_RPC_TIMEOUT, user_visible=False,
                            force_autograd=False)

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


def _wait_all(futures: list[torch.futures.Future]) -> tuple[list, list]:
    reports, errors = [], []
    for fut in futures:
        try:
            reports.extend(_core.wait(fut))
        except Exception as e:
            errors.append(e)
    return reports, errors


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
        error = None
        try:
            p.deliver_roots(edges, [torch.ones_like(r) for r in roots])
        except Exception as e:
            error = _wrap_error(cont.worker_id, e)
        # Wait for every gradient shipped from here, even after an error, so
        # no worker is left working on this pass when backward returns.
        while True:
            with p.lock:
                futures, p.outstanding = p.outstanding, []
            if not futures:
                break
            reports, errors = _wait_all(futures)
            if errors and error is None:
                error = errors[0] if isinstance(errors[0], RuntimeError) else _wrap_error(
                    cont.worker_id, errors[0])
            p.reports.extend(reports)
        if error is not None:
            raise error
        _check_all_sends_used(context_id, p, p.report(cont.worker_id), p.reports)
    finally:
        _end_pass(ctx, p)


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


def _check_all_sends_used(context_id: int, p: _Pass, own: tuple, reports: list) -> None:
    latest: dict[int, tuple] = {}
    for worker, seq, pending in reports + [own]:
        if worker not in latest or seq > latest[worker][0]:
            latest[worker] = (seq, pending)
    unused = [item for _, pending in latest.values() for item in pending]
    if unused:
        # Those workers still wait for the unused sends' gradients: end their
        # part of the pass, so they hold no state for it.
        stuck = {worker for worker, (_, pending) in latest.items()
                 if pending and worker != own[0]}
        _wait_all([_core.invoke(w, _end_pass_here, (context_id, p.pass_id), None,
                                _core.UNSET_RPC_TIMEOUT, user_visible=False,
                                force_autograd=False) for w in sorted(stuck)])
        described = "; ".join(f"autograd message {mid} (worker {src} -> worker {dst})"
                              for mid, src, dst in unused)
        raise RuntimeError(
            f"Distributed backward in context {context_id} finished, but {len(unused)} RPC(s) "
            f"carrying tensors that require grad got no gradient: {described}. Their results "
            "were not used to compute the roots (FAST mode expects every RPC of the context "
            "to take part). Use the results in the loss, or send detached tensors / run "
            "such RPCs under torch.no_grad() or outside the context.")


@async_execution
def _propagate_gradients(context_id: int, items: list[tuple[int, list[torch.Tensor]]],
                         retain_graph: bool, pass_id: tuple) -> torch.futures.Future:
    """Runs on the worker that sent the messages of ``items``: gradients for their sends."""
    cont = container()
    ctx = cont.retrieve(context_id)
    for msg_id, _ in items:
        if msg_id not in ctx.sends:
            raise RuntimeError(
                f"Could not find send function for autograd message id: {msg_id}")
    with _pass_creation_lock:  # concurrent first messages of a pass must share it
        p = ctx.backward_pass
        if p is None or p.pass_id != pass_id:
            p = ctx.backward_pass = _Pass(ctx, pass_id, retain_graph, [])
    try:
        shipped = p.deliver_sends(items)
    except Exception as e:
        _end_pass(ctx, p)
        raise _wrap_error(cont.worker_id, e) from e
    done: torch.futures.Future = torch.futures.Future()

    def finish(_: Any = None) -> None:
        reports, errors = [], []
        for fut in shipped:
            try:
                reports.extend(fut.wait())
            except Exception as e:
                errors.append(e)
        if errors:
            _end_pass(ctx, p)
            set_error(done, errors[0])
            return
        reports.append(p.report(cont.worker_id))
        if p.complete():
            _end_pass(ctx, p)
        done.set_result(reports)

    if shipped:
        torch.futures.collect_all(shipped).add_done_callback(finish)
    else:
        finish()
    return done


def num_backward_passes() -> int:
    return sum(c.backward_pass is not None for c in container().all_contexts())
