"""The messages of a distributed backward pass that its engine and SMART mode share.

A pass moves by GRADIENTS messages (:func:`send_gradients`), each carrying a share of the
credit its sender got; a worker's deliveries ship the messages they make through an
:class:`Outbox`, which returns the credit kept to the root (:func:`apply_credit` there) with
the worker's report of its sends still waiting. The root waits until all credit is back
(:func:`wait_for_credit`): then no message is in flight (see ``_engine``). A worker's part of
a pass ends with :func:`end_pass`.
"""

from __future__ import annotations

import functools
import itertools
import threading
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

from ..rpc import _internal
from ..rpc._internal import Kind, run_recorded, tensor_nbytes
from ._context import DistAutogradContext, container, current_container
from ._credit import NO_CREDIT, Credit, add_credit, split_credit
from ._messages import CreditReturn, Gradients, encode_gradients
from ._pass import SEND_FUNCTION_SPAN, Pass, on_send_devices, run_operators

#: Profiler spans: each stretch of local engine work, and each gradient message sent and
#: handled (``...(worker0 -> worker1)``; a merged timeline also shows their bytes and
#: gradient counts).
LOCAL_WORK_SPAN = "torch::distributed::autograd::local_work"
SEND_SPAN = "torch::distributed::autograd::send_gradients"
RECEIVE_SPAN = "torch::distributed::autograd::receive_gradients"

pass_ids = itertools.count()
#: Concurrent first messages of a pass on a worker must share one Pass.
_pass_creation_lock = threading.Lock()


def wrap_error(worker_id: int, e: BaseException) -> RuntimeError:
    text = str(e)
    if text.startswith("Error on Node"):
        return RuntimeError(text)
    return RuntimeError(f"Error on Node {worker_id}: {text}")


def wait_for_credit(p: Pass) -> None:
    """Wait (polling MPI) until all credit is back or the RPC timeout passes."""
    agent = _internal.require_agent()
    # This pass's gradient messages to the root run on this thread (their waiter key
    # is the pass id): they are what it waits for.
    if not agent.waiting.wait(p.finished, agent.timeout, key=p.pass_id):
        p.expire(agent.timeout)


def end_pass(ctx: DistAutogradContext, p: Pass) -> None:
    p.close()
    with _pass_creation_lock:
        ctx.ended_pass_id = p.pass_id
        if ctx.backward_pass is p:
            ctx.backward_pass = None


def latest_reports(reports: list[tuple]) -> dict[int, list]:
    """Each worker's unused sends, from its latest report."""
    latest: dict[int, tuple] = {}
    for worker, seq, pending in reports:
        if worker not in latest or seq > latest[worker][0]:
            latest[worker] = (seq, pending)
    return {worker: pending for worker, (_, pending) in latest.items()}


def message_span(name: str, src: int, dst: int, tensors: list) -> tuple[str, dict]:
    """The span of one gradient message: its route in the name, its size in the args."""
    infos = _internal.require_agent().infos
    route = f"{infos[src].name} -> {infos[dst].name}"
    size = {"bytes": sum(tensor_nbytes(t) for t in tensors), "gradients": len(tensors)}
    return f"{name}({route})", size


def send_gradients(
    agent,
    peer: int,
    p: Pass | _PassRef,
    items: list[tuple[int, list | None]],
    credit: Credit,
    report: tuple | None,
) -> None:
    """One GRADIENTS frame to ``peer`` for ``(message id, gradients)`` items of pass ``p``."""
    layout, tensors, order = encode_gradients(items)
    body = Gradients(p.ctx._context_id(), layout, p.retain_graph, p.pass_id, credit, report, order)
    name = functools.partial(message_span, SEND_SPAN, agent.info.id, peer, tensors)
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
        return_credit(self.p.ctx._context_id(), self.p.pass_id, credit, report, error)

    def _send(
        self, messages: list[tuple[int, list]], credit: Credit, report: tuple | None
    ) -> tuple[Credit, bool]:
        """Send ``messages`` with equal shares of ``credit``; (credit kept, report sent)."""
        root, agent = self.p.pass_id[0], _internal.require_agent()
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
                self.error = self.error or wrap_error(me, e).with_traceback(e.__traceback__)
                reported = reported and carried is None
        return kept, reported


def return_credit(
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
        _internal.require_agent().send_one_way(
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
    cont = current_container()
    ctx = cont.find(context_id) if cont is not None else None
    p = ctx.backward_pass if ctx is not None else None
    if p is not None and p.pass_id == pass_id:  # else the pass timed out: drop it
        p.return_credit(credit, report, RuntimeError(error) if isinstance(error, str) else error)


def worker_pass(ctx: DistAutogradContext, pass_id: tuple, retain_graph: bool) -> Pass:
    """This worker's part of a pass that another worker (the root) started."""
    with _pass_creation_lock:  # concurrent first messages of a pass must share it
        p = ctx.backward_pass
        if p is None or p.pass_id != pass_id:
            p = ctx.backward_pass = Pass(ctx, pass_id, retain_graph, [])
        return p


class _PassRef(NamedTuple):
    """What a gradient message names of its pass, for a worker's part run without a Pass."""

    ctx: DistAutogradContext
    pass_id: tuple
    retain_graph: bool


def operators_alone(
    ctx: DistAutogradContext, pass_id: tuple, retain_graph: bool, items: list
) -> list | None:
    """The sends ``items`` deliver, ready for :func:`run_operators`, when they are every send
    of ``ctx`` still waiting, all of torch operators called by the root, and no pass holds
    state here: this worker's whole part of the pass is then one native call, run by
    :func:`answer_operators` with no :class:`Pass`, and the pass is marked over here (a later
    probe of SMART mode finds nothing waiting). None otherwise."""
    root = pass_id[0]
    with _pass_creation_lock, ctx.lock:
        if ctx.backward_pass is not None or ctx.ended_pass_id == pass_id:
            return None
        ids = {msg_id for msg_id, _ in items}
        waiting = {msg_id for msg_id in ctx.sends if msg_id not in ctx.consumed_sends}
        if len(ids) != len(items) or ids != waiting:
            return None
        ready = []
        for msg_id, grads in items:
            request = ctx.op_sends.get(msg_id)
            if request is None or ctx.recv_peers[request] != root:
                return None
            send = ctx.sends[msg_id]
            if grads is None:
                grads = [None] * len(send.next_functions)
            recv = (ctx.recvs[request], request, root, ctx.recv_meta[request])
            ready.append((msg_id, send, grads, recv))
        ctx.ended_pass_id = pass_id
        if not retain_graph:
            ctx.consumed_sends.update(
                m for m, _, grads, _ in ready if any(g is not None for g in grads)
            )
    return ready


def answer_operators(
    ctx: DistAutogradContext, pass_id: tuple, retain_graph: bool, credit: Credit, ready: list
) -> None:
    """Run what :func:`operators_alone` found and send the gradients to the root, with all the
    credit and this worker's report (nothing waits here); an error goes back instead."""
    me = container().worker_id
    try:
        devices = ctx.send_devices
        run = [
            (
                send,
                run_recorded(SEND_FUNCTION_SPAN, on_send_devices, grads, devices.get(m, ())),
                recv,
            )
            for m, send, grads, recv in ready
        ]
        ran = run_recorded(LOCAL_WORK_SPAN, run_operators, run, retain_graph)
        items = [item for _, item in ran]
        agent = _internal.require_agent()
        send_gradients(
            agent, pass_id[0], _PassRef(ctx, pass_id, retain_graph), items, credit, (me, 1, [])
        )
    except Exception as e:
        error = wrap_error(me, e).with_traceback(e.__traceback__)
        return_credit(ctx._context_id(), pass_id, credit, None, error)


def deliver_and_ship(p: Pass, credit: Credit, deliver: Callable, *args: Any) -> None:
    """Run a delivery to ``p`` (``deliver(*args, ship)``) and ship the gradient messages it
    makes, sharing ``credit``; an error goes back to the root with the credit not shipped.

    A worker other than the root ends its part of the pass once that part is complete or
    failed, before its credit goes back (the root's backward returns after that). Its DDP
    parameters then go through DDP's reducer (``LeafGradients.finish``) on a thread of their
    own: the reducer waits for its replicas, whose passes may need the thread running this.
    """
    me = container().worker_id
    outbox = Outbox(p, credit)
    try:
        messages = run_recorded(LOCAL_WORK_SPAN, deliver, *args, outbox.send_early)
    except Exception as e:
        if p.pass_id[0] != me:
            end_pass(p.ctx, p)
        outbox.fail(wrap_error(me, e).with_traceback(e.__traceback__))
        return
    if p.pass_id[0] != me and p.complete():
        if p.leaves.pending:
            outbox.send_early(messages)
            name = "lightning_distgrad DDP reduction"
            threading.Thread(target=_finish_part, args=(p, outbox), name=name, daemon=True).start()
            return
        end_pass(p.ctx, p)
    outbox.finish(messages)


def _finish_part(p: Pass, outbox: Outbox) -> None:
    """This worker's complete part of a pass: its DDP parameters through DDP's reducer, then
    the credit kept back to the root."""
    error = None
    try:
        p.leaves.finish()
    except Exception as e:
        error = wrap_error(container().worker_id, e).with_traceback(e.__traceback__)
    end_pass(p.ctx, p)
    if error is None:
        outbox.finish([])
    else:
        outbox.fail(error)
