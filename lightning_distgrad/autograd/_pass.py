"""One backward pass on one worker: the local graph, its regions, and what leaves it.

The engine's own work is bookkeeping: dependency counts across the points where
gradients enter (the roots, send functions whose peer shipped gradients) and
leave (recv functions, leaves). The node-level work runs in PyTorch's native
engine: each *region* is one native ``torch.autograd.grad`` call that starts at
``GradientEdge``\\ s and stops at recv functions, leaves, and nodes that still
wait for gradients from elsewhere. A node therefore runs once, with its summed
gradient, however many regions feed it.

Gradients leave as soon as they are known, as PyTorch's engine sends them
while it runs on: when a region would finish recv functions and also run
nodes they do not need, the nodes they need run first, in a native call of
their own, and their gradient messages are shipped before the next region
runs, so the peers work on them meanwhile. Nodes that only hand leaves a view of
their gradient (weight transposes) are not split off: they have no work to overlap.

A send function is an identity: the gradients its peer ships go straight to
the nodes of the tensors it sent, with no native run for the send node itself.

A gradient may be *absent* (``None``): a send resolved as unused, a recv output
that got no gradient, a native run that returned none for an edge. An absent
gradient still counts as delivered; a node all of whose incoming gradients are
absent does not run and passes absence on, so every node of the graph is
settled once every start has been.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from .._compat import engine_run_backward, num_node_inputs, tensor_hooks
from ..rpc._internal import run_recorded, timeout_error
from ._context import DistAutogradContext, sum_grads
from ._credit import NO_CREDIT, Credit, add_credit, is_all_credit
from ._graph import Graph, is_leaf_node
from ._leaves import LeafGradients
from ._wrappers import check_no_sharded_modules

#: Profiler spans of the send and recv functions, under the names torch's engine records
#: them by: a send function taking the gradients its peer shipped, a recv function's
#: gradients collected for its peer.
SEND_FUNCTION_SPAN = "torch::distributed::autograd::SendRpcBackward"
RECV_FUNCTION_SPAN = "torch::distributed::autograd::RecvRpcBackward"

#: Nodes whose backward returns a view of their gradient, whatever its values.
VIEW_NODES = frozenset(("TBackward0", "TransposeBackward0", "PermuteBackward0"))

#: Where a pass hands gradient messages ``[(peer, items)]`` to leave while it runs on.
Ship = Callable[[list[tuple[int, list]]], None]


def native_grad(
    outputs: list, inputs: list, grad_outputs: list, retain_graph: bool
) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(..., allow_unused=True)`` without its Python-side checks.

    Those checks (``_make_grads``, argument normalisation) add nothing for
    gradients built by this engine; the native engine still validates every
    gradient's shape against the node it enters.
    """
    return engine_run_backward(
        tuple(outputs), tuple(grad_outputs), retain_graph, False, tuple(inputs), True, False
    )


def on_send_devices(grads: list, devices: list) -> list:
    """``grads`` moved to the devices of the tensors a send carried (no device map covered
    them: they came on the CPU)."""
    if not devices:
        return grads
    return [
        g if g is None or nr >= len(devices) or g.device == devices[nr] else g.to(devices[nr])
        for nr, g in enumerate(grads)
    ]


def run_operators(ready: list[tuple[Any, list, tuple]], retain_graph: bool) -> list[tuple]:
    """Operator sends in one native call, from each send's children to its request's recv
    node. ``ready``: (send node, its gradients, (recv node, request id, peer, recv meta)).
    Returns (peer, (request id, gradient or None per received tensor)) per send."""
    outputs, grad_outputs, inputs = [], [], []
    for send, grads, (recv, _, _, meta) in ready:
        for (child, nr), grad in zip(send.next_functions, grads, strict=True):
            if child is not None and grad is not None:
                outputs.append(GradientEdge(child, nr))
                grad_outputs.append(grad)
        inputs += [GradientEdge(recv, i) for i in range(len(meta))]
    if outputs:
        found = iter(native_grad(outputs, inputs, grad_outputs, retain_graph))
    else:
        found = iter([None] * len(inputs))
    return [
        (peer, (request, [next(found) for _ in meta])) for _, _, (_, request, peer, meta) in ready
    ]


class Pass:
    """One backward pass of one context on this worker."""

    def __init__(
        self,
        ctx: DistAutogradContext,
        pass_id: tuple,
        retain_graph: bool,
        root_edges: list[GradientEdge],
    ):
        check_no_sharded_modules()
        self.ctx = ctx
        self.pass_id = pass_id
        self.retain_graph = retain_graph
        self.lock = threading.Lock()
        with ctx.lock:
            # Sends whose graph an earlier pass freed (no retain_graph) take no
            # part: a second forward in the same context starts afresh.
            sends = {mid: node for mid, node in ctx.sends.items() if mid not in ctx.consumed_sends}
            self.recv_ids = {node: mid for mid, node in ctx.recvs.items()}
            # Operator responses: send -> operator -> recv, a graph of their own.
            self.operators = {
                mid: (ctx.recvs[request], request, ctx.recv_peers[request], ctx.recv_meta[request])
                for mid, request in ctx.op_sends.items()
                if mid in sends
            }
        self.send_nodes = sends
        self.pending_sends = set(sends)
        graph_sends = [node for mid, node in sends.items() if mid not in self.operators]
        self.graph = Graph([e.node for e in root_edges] + graph_sends, set(self.recv_ids))
        for edge in root_edges:
            self.graph.remaining[edge.node] += 1
        for node in graph_sends:
            self.graph.remaining[node] += 1
        # Operator sends delivered, not run yet: (message id, gradients).
        self.operators_ready: list[tuple[int, list]] = []
        self.buffers: dict[Any, dict[int, torch.Tensor]] = {}
        self.finalized: set = set()
        # Interior nodes whose incoming gradients are all delivered and all absent,
        # not yet passed on to their children.
        self.empty: list = []
        self.held_hooks: dict[Any, dict] = {}  # leaf node -> hooks taken off it
        self.leaves = LeafGradients(ctx)
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

    def _delivered(self, node: Any) -> None:
        """One incoming edge of ``node`` delivered (after its gradient, if any, was added)."""
        remaining = self.graph.remaining
        left = remaining[node] - 1
        remaining[node] = left
        if left == 0 and node not in self.buffers and node not in self.graph.boundary:
            self.empty.append(node)

    def deliver_roots(
        self, root_edges: list[GradientEdge], grads: list[torch.Tensor], ship: Ship
    ) -> list[tuple[int, list]]:
        """Gradients for the roots; returns the last gradient messages to ship (see ``_run``)."""
        with self.lock:
            for edge, grad in zip(root_edges, grads, strict=False):
                self._add(edge.node, edge.output_nr, grad)
                self._delivered(edge.node)
            return self._run(ship)

    def deliver_sends(
        self, items: list[tuple[int, list | None]], ship: Ship
    ) -> list[tuple[int, list]]:
        """Gradients for send functions from one peer; returns the last gradient messages to
        ship (see ``_run``).

        ``items`` are ``(message id, one gradient or None per sent tensor)``;
        ``None`` instead of the list: every gradient of that send is absent.
        """
        with self.lock:
            for msg_id, grads in items:
                run_recorded(SEND_FUNCTION_SPAN, self._deliver_send, msg_id, grads)
            return self._run(ship)

    def _deliver_send(self, msg_id: int, grads: list | None) -> None:
        if msg_id not in self.pending_sends:
            if msg_id in self.ctx.consumed_sends and msg_id not in self.send_nodes:
                raise RuntimeError(
                    "Trying to backward through the graph a second time: the send "
                    f"function of autograd message {msg_id} already ran in a pass "
                    "without retain_graph, which freed its graph. Specify "
                    "retain_graph=True if you need to backward through the graph a "
                    "second time."
                )
            raise RuntimeError(
                f"Send function for autograd message id {msg_id} got its "
                "gradients twice in one backward pass"
            )
        node = self.send_nodes[msg_id]
        self.pending_sends.discard(msg_id)
        if grads is None:
            grads = [None] * len(node.next_functions)
        # Only a send whose gradients ran through its graph has consumed it.
        if not self.retain_graph and any(g is not None for g in grads):
            with self.ctx.lock:
                self.ctx.consumed_sends.add(msg_id)
        grads = on_send_devices(grads, self.ctx.send_devices.get(msg_id, ()))
        if msg_id in self.operators:
            self.operators_ready.append((msg_id, grads))
            return
        self.graph.remaining[node] -= 1
        # The send node is an identity: its gradients go straight to the nodes
        # of the tensors it sent (a native run of it would only copy them).
        for (child, child_nr), grad in zip(node.next_functions, grads, strict=True):
            if child is None:
                continue
            if grad is not None:
                if is_leaf_node(child):
                    self._hold_hooks(child)
                self._add(child, child_nr, grad)
            self._delivered(child)

    # -- regions --------------------------------------------------------------------

    def _run(self, ship: Ship) -> list[tuple[int, list]]:
        """Run every region that is ready; returns the gradient messages (one per peer) that
        the last region made. Those of earlier regions go to ``ship`` before the next region
        runs, so that their peers work on them meanwhile."""
        by_peer: dict[int, list] = {}
        if self.operators_ready:
            self._run_operators(by_peer)
        while True:
            self._pass_on_absence()
            self._finalize_boundary(by_peer)
            region = self._next_region()
            if region is None:
                return list(by_peer.items())
            if by_peer:
                ship(list(by_peer.items()))
                by_peer = {}
            region()

    def _pass_on_absence(self) -> None:
        """Settle the children of nodes whose every incoming gradient was absent."""
        children = self.graph.children
        while self.empty:
            for child, _ in children[self.empty.pop()]:
                self._delivered(child)

    def _next_region(self) -> Callable[[], None] | None:
        """The next native call (or lone node) that can run now; None if none can."""
        graph = self.graph
        remaining = graph.remaining
        starts = [n for n in self.buffers if remaining[n] == 0 and n not in graph.boundary]
        if not starts:
            return None
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
        run_set = graph.ancestors_within(targets, in_ready)
        run = [n for n in ready if n in run_set]
        if not run:
            return None
        capture = self._recvs_first(run, targets, rem) or self._split_off_conflicts(run)
        if capture is not None:
            return functools.partial(self._run_native, *capture)
        # Every node that could run now feeds both a node that still waits and
        # one of that node's descendants: run one alone, outside the native engine.
        needed = graph.ancestors_within(targets & graph.boundary, in_ready)
        alone = [n for n in run if n in self.buffers and remaining[n] == 0 and n in needed]
        if not alone:
            return None  # they wait for the node that blocks them
        return functools.partial(self._run_alone, alone[0])

    def _recvs_first(self, run: list, targets: set, rem: dict) -> tuple[list, list] | None:
        """(nodes, captures) of a native call that runs less than all of ``run`` and finishes
        the recv functions among ``targets`` that ``run`` finishes, if one can: their gradients
        then leave before the rest of ``run`` runs."""
        recvs = [t for t in targets if t in self.recv_ids and rem[t] == 0]
        if not recvs or len(recvs) == len(targets):
            return None
        first = self.graph.ancestors_within(recvs, set(run))
        if all(self._views_a_leaf(n) for n in run if n not in first):
            return None  # nothing else runs, or nothing a peer could overlap
        part = [n for n in run if n in first]
        split = self._split_off_conflicts(part)
        return split if split is not None and len(split[0]) == len(part) else None

    def _views_a_leaf(self, node: Any) -> bool:
        """Whether ``node`` hands only a view of its gradient to leaves (``nn.Linear``'s
        weight transpose). Such nodes run in the recvs' native call: they do no work a peer
        could overlap, and a call of their own costs more (about 10 us an edge)."""
        return type(node).__name__ in VIEW_NODES and all(
            is_leaf_node(child) for child, _ in self.graph.children[node]
        )

    def _run_native(self, run: list, capture: list) -> None:
        """One native call: ``run``'s buffered gradients in, ``capture``'s gradients out."""
        graph = self.graph
        remaining = graph.remaining
        captured_nodes = {c for c, _ in capture}
        outputs, grad_outputs = [], []
        for node in run:
            for nr, grad in self.buffers.pop(node, {}).items():
                outputs.append(GradientEdge(node, nr))
                grad_outputs.append(grad)
        run_set = set(run)
        rem = {
            c: remaining[c] - sum(1 for p in graph.parents[c] if p in run_set)
            for c in captured_nodes
        }
        self._hold_hooks_of_partial_leaves(captured_nodes, rem)
        grads = native_grad(
            outputs, [GradientEdge(c, nr) for c, nr in capture], grad_outputs, self.retain_graph
        )
        for (child, nr), grad in zip(capture, grads, strict=False):
            self._add(child, nr, grad)
        for node in run:
            for child, _ in graph.children[node]:
                if child in run_set:
                    remaining[child] -= 1  # ran in this call
                else:
                    self._delivered(child)

    def _run_operators(self, by_peer: dict[int, list]) -> None:
        """The delivered operator sends (see :func:`run_operators`); each recv's gradients go to
        ``by_peer`` (absent where none came)."""
        ready, self.operators_ready = self.operators_ready, []
        ran = run_operators(
            [(self.send_nodes[m], grads, self.operators[m]) for m, grads in ready],
            self.retain_graph,
        )
        for peer, item in ran:
            run_recorded(RECV_FUNCTION_SPAN, by_peer.setdefault(peer, []).append, item)

    def _split_off_conflicts(self, run: list) -> tuple[list, list] | None:
        """(nodes to run, edges to capture) for one native call; None if no node can run.

        Invariant of a native call: no captured node is a descendant of another
        captured node that is not on the boundary (the native engine would run
        that one with a partial gradient). Nodes feeding such a descendant are
        left out of the call (they stay buffered, or run alone).
        """
        graph = self.graph
        while run:
            run_set = set(run)
            capture = sorted(
                {(c, nr) for n in run for c, nr in graph.children[n] if c not in run_set},
                key=lambda e: (id(e[0]), e[1]),
            )
            captured = {c for c, _ in capture}
            interior = [c for c in captured if c not in graph.boundary]
            bad = captured & graph.descendants(interior)
            if not bad:
                return run, capture
            # Leave out the nodes feeding ``bad`` and, with them, everything they feed.
            out = {n for n in run if any(c in bad for c, _ in graph.children[n])}
            queue = list(out)
            while queue:
                for child, _ in graph.children[queue.pop()]:
                    if child in run_set and child not in out:
                        out.add(child)
                        queue.append(child)
            run = [n for n in run if n not in out]
        return None

    def _run_alone(self, node: Any) -> None:
        """Run one node by calling it directly: it feeds a node that still waits and
        one of that node's descendants, which one native call cannot separate."""
        if not callable(node):
            raise RuntimeError(
                f"lightning_distgrad cannot run {type(node).__name__} here: it feeds both a "
                "tensor that still waits for gradients from another worker and nodes below "
                "that tensor, and custom autograd.Function nodes cannot run outside the "
                "native engine."
            )
        slots = self.buffers.pop(node)
        grads = node(*[slots.get(i) for i in range(num_node_inputs(node))])
        if isinstance(grads, torch.Tensor):
            grads = (grads,)
        remaining = self.graph.remaining
        for (child, nr), grad in zip(node.next_functions, grads, strict=True):
            if child is None:
                continue
            if grad is not None:
                if is_leaf_node(child) and (remaining[child] > 1 or child in self.buffers):
                    self._hold_hooks(child)
                self._add(child, nr, grad)
            self._delivered(child)

    def _hold_hooks_of_partial_leaves(self, captured: set, rem: dict) -> None:
        """Leaf hooks must see the full gradient once: take them off partial leaves."""
        for node in captured:
            if is_leaf_node(node) and (rem[node] > 0 or node in self.buffers):
                self._hold_hooks(node)

    def _hold_hooks(self, leaf: Any) -> None:
        """Take ``leaf``'s hooks off until its gradient is complete (see _run_held_hooks)."""
        hooks = tensor_hooks(leaf.variable)
        if hooks and leaf not in self.held_hooks:
            self.held_hooks[leaf] = dict(hooks)
            hooks.clear()

    # -- leaving the local graph ------------------------------------------------------

    def _finalize_boundary(self, by_peer: dict[int, list]) -> None:
        """Hand complete leaves to the context; add finished recv functions' gradients to
        ``by_peer``."""
        leaf_grads = []
        remaining = self.graph.remaining
        for node in self.graph.boundary:
            if remaining[node] != 0 or node in self.finalized:
                continue
            self.finalized.add(node)
            grads = self.buffers.pop(node, {})
            if node in self.recv_ids:
                peer, item = run_recorded(RECV_FUNCTION_SPAN, self._recv_gradients, node, grads)
                by_peer.setdefault(peer, []).append(item)
            else:
                leaf_grads.append((node, self._run_held_hooks(node, grads.get(0))))
        if leaf_grads:
            self.leaves.add(leaf_grads)

    def _run_held_hooks(self, node: Any, grad: torch.Tensor | None) -> torch.Tensor | None:
        """Give a leaf its hooks back, and run them on its (now full) gradient."""
        hooks = self.held_hooks.pop(node, None)
        if hooks is not None:
            tensor_hooks(node.variable).update(hooks)
            if grad is not None:
                for hook in hooks.values():
                    result = hook(grad)
                    grad = grad if result is None else result
        return grad

    def _recv_gradients(self, node: Any, grads: dict[int, torch.Tensor]) -> tuple[int, tuple]:
        """(peer, (message id, one gradient or None per output)) for a finished recv function.

        An output that got no gradient ships as absent, not as zeros: the tensors
        behind it on the peer get no gradient from it, as in local autograd.
        """
        msg_id = self.recv_ids[node]
        with self.ctx.lock:
            peer = self.ctx.recv_peers[msg_id]
            count = len(self.ctx.recv_meta[msg_id])
        full = [grads.get(i) for i in range(count)]
        return peer, (msg_id, full)

    # -- state ----------------------------------------------------------------------

    def complete(self) -> bool:
        return not self.pending_sends and not self.buffers

    def report(self, worker_id: int) -> tuple:
        """(worker, sequence, sends still waiting) for the root's final check."""
        with self.lock:
            self.seq += 1
            pending = [
                (mid, worker_id, self.ctx.send_peers.get(mid)) for mid in sorted(self.pending_sends)
            ]
            return (worker_id, self.seq, pending)

    def waiting_recvs(self) -> list[int]:
        """Message ids of the recv functions in this pass's graph not finished yet."""
        with self.lock:
            waiting = [
                mid
                for node, mid in self.recv_ids.items()
                if node in self.graph.children and node not in self.finalized
            ]
            # An operator's recv finishes with its response's send.
            return waiting + [
                self.operators[m][1] for m in self.pending_sends if m in self.operators
            ]

    def close(self) -> None:
        for node, hooks in self.held_hooks.items():
            tensor_hooks(node.variable).update(hooks)
        self.held_hooks.clear()
        # The error (raised by now) has a traceback whose frames hold this pass: a reference
        # cycle, left to the garbage collector with the Python objects of the graph's nodes.
        # A collection, on whatever thread it runs, clears each object of the cycle even if
        # another thread took it up meanwhile (the next pass of the context, built from the
        # same nodes): that pass would then hold dead node objects, while gradients reach
        # new objects of the same nodes, and wait for ever. Without the cycle, they are freed
        # when their last reference goes.
        self.error = None

    # -- credit (root only) -----------------------------------------------------------

    def return_credit(
        self, credit: Credit, report: tuple | None, error: BaseException | None
    ) -> None:
        """Credit back from a worker (with its report or error); all back: the round is over."""
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

    def new_round(self) -> None:
        """Start another round of credit (all the last one's is back)."""
        with self.credit_lock:
            self.credit = NO_CREDIT
            self.finished = torch.futures.Future()

    def expire(self, timeout: float) -> None:
        """The pass ran past the RPC timeout: stop waiting for the credit still out."""
        with self.credit_lock:
            if not self.finished.done():
                self.error = timeout_error(timeout)
                self.finished.set_result(None)
