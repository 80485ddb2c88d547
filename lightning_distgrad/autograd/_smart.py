"""SMART mode: settling the sends that still wait when a pass is quiescent.

When all the credit of a pass is back, no message is in flight and no worker
can do more; sends that still wait for gradients are then of two kinds. *Dead*
sends: the recv function on their peer is in no graph of the pass (not
reachable from that worker's roots or sends), so no gradient can ever come.
*Blocked* sends: their recv function is in a graph but waits itself, on
nodes that wait on other sends. Following what a blocked send waits for leads,
through a finite graph, to a dead send, so every settling round has one to
resolve while any send waits.

A round: the root asks every worker involved (those reporting waiting sends,
and the peers of those sends, transitively) for its waiting sends and
unfinished recv functions; resolves every dead send as absent with one
GRADIENTS message per worker holding some (credit split as for any gradient
message); and waits for all credit again. Resolving as absent is exact: the
send's recv function can never produce a gradient. Rounds repeat until no
send waits.
"""

from __future__ import annotations

from ..rpc import _internal
from . import _shipping
from ._context import container
from ._credit import ALL_CREDIT, split_credit
from ._pass import Pass


def settle_waiting_sends(p: Pass, latest: dict[int, list], involved: set[int]) -> dict[int, list]:
    """Resolve dead sends at quiescence until no send waits (root only).

    ``latest`` maps workers to their waiting sends ``(message id, worker,
    peer)``; the workers asked are added to ``involved``. Returns the waiting
    sends left (empty unless an error or timeout cut the pass short; the error
    is then in ``p.error``).
    """
    me = container().worker_id
    while True:
        states = _probe(p, latest, involved, me)
        waiting = [item for pending, _ in states.values() for item in pending]
        if not waiting:
            return {}
        dead: dict[int, list[int]] = {}
        for msg_id, worker, peer in waiting:
            if peer is None or msg_id not in states.get(peer, ((), set()))[1]:
                dead.setdefault(worker, []).append(msg_id)
        if not dead:
            raise RuntimeError(
                f"Error on Node {me}: distributed backward in context "
                f"{p.ctx._context_id()} cannot settle its waiting sends "
                f"{sorted(m for m, _, _ in waiting)}: each waits on another."
            )
        p.new_round()
        _resolve(p, dead, me)
        _shipping.wait_for_credit(p)
        if p.error is not None:
            return {w: pending for w, (pending, _) in states.items()}
        latest = _shipping.latest_reports(p.reports + [p.report(me)])


def _probe(
    p: Pass, latest: dict[int, list], involved: set[int], me: int
) -> dict[int, tuple[list, set]]:
    """Every involved worker's (waiting sends, unfinished recv message ids)."""
    context_id = p.ctx._context_id()
    states: dict[int, tuple[list, set]] = {}
    ask = {w for w, pending in latest.items() if pending}
    ask.update(peer for pending in latest.values() for _, _, peer in pending if peer is not None)
    while ask:
        futures = {}
        for worker in sorted(ask):
            if worker == me:
                states[me] = (p.report(me)[2], set(p.waiting_recvs()))
            else:
                involved.add(worker)
                futures[worker] = _internal.invoke(
                    worker,
                    probe_here,
                    (context_id, p.pass_id, p.retain_graph),
                    None,
                    _internal.UNSET_RPC_TIMEOUT,
                    user_visible=False,
                    force_autograd=False,
                )
        for worker, fut in futures.items():
            pending, recvs = _internal.wait(fut)
            states[worker] = (pending, set(recvs))
        ask = {
            peer
            for pending, _ in states.values()
            for _, _, peer in pending
            if peer is not None and peer not in states
        }
    return states


def probe_here(context_id: int, pass_id: tuple, retain_graph: bool) -> tuple[list, list]:
    """On a worker: its waiting sends and unfinished recv functions in the pass.

    A worker the pass has not reached yet joins it here (its graph is built
    from its sends); one whose part is over, or that released the context,
    has neither.
    """
    cont = container()
    ctx = cont.find(context_id)
    if ctx is None or ctx.ended_pass_id == pass_id:
        return [], []
    p = _shipping.worker_pass(ctx, pass_id, retain_graph)
    return p.report(cont.worker_id)[2], p.waiting_recvs()


def _resolve(p: Pass, dead: dict[int, list[int]], me: int) -> None:
    """Deliver an all-absent gradient to every dead send, one message per worker."""
    share, kept = split_credit(ALL_CREDIT, len(dead))
    p.return_credit(kept, None, None)
    agent = _internal.require_agent()
    for worker, msg_ids in sorted(dead.items()):
        items = [(msg_id, None) for msg_id in msg_ids]
        if worker == me:
            _shipping.deliver_and_ship(p, share, p.deliver_sends, items)
            continue
        try:
            _shipping.send_gradients(agent, worker, p, items, share, None)
        except Exception as e:  # never sent: its credit comes back here
            p.return_credit(share, None, _shipping.wrap_error(me, e))
