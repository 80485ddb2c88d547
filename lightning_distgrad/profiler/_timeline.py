"""One timeline from every rank's trace: aligned clocks, a lane per worker, message arrows."""

from __future__ import annotations

import collections
import time

from mpi4py import MPI

#: Round trips per rank for the clock-offset estimate (the fastest one is kept).
PING_PONGS = 10
#: The lane of each worker that shows its messages.
MESSAGE_TID = 0
#: Flow phases of the Chrome trace format; torch's flow ids move past the message ids.
FLOW_PHASES = ("s", "t", "f")
TORCH_FLOW_ID_STRIDE = 1 << 40
#: Spans the RPC layer logs on every thread (torch's trace has them for one thread only).
LOGGED_SPANS = ("rpc_", "torch::distributed::autograd::")


def clock_offsets(comm: MPI.Comm, root: int = 0) -> list[tuple[float, float]] | None:
    """On ``root``, each rank's clock minus its own, and the error bound, in us
    (``time.time_ns``, the clock torch's traces use); None elsewhere. A collective.

    A rank learns its offset from its parent in a binomial tree rooted at ``root``: the parent
    asks for its time, and with ``t0`` and ``t1`` the ask and the answer on the parent, the
    rank read its clock at ``(t0 + t1) / 2`` give or take ``(t1 - t0) / 2``; the parent, which
    knows its own offset from the root, sends the rank the sum. The tree's levels measure in
    turn, each level's pairs at once: log2(n) rounds of ``PING_PONGS`` round trips, and no
    rank measures more than log2(n) others. The root gathers the offsets; each bound adds the
    bounds of the hops from the root.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    me = (rank - root) % size  # place in the tree: the root is 0
    mine = (0.0, 0.0)
    step = 1
    while step < size:
        if me < step and me + step < size:  # a parent at this level: measure the child
            child = (me + step + root) % size
            best = None
            for _ in range(PING_PONGS):
                t0 = time.time_ns()
                comm.send(None, dest=child)
                theirs = comm.recv(source=child)
                t1 = time.time_ns()
                if best is None or t1 - t0 < best[1]:
                    best = (theirs - (t0 + t1) / 2, t1 - t0)
            comm.send((mine[0] + best[0] / 1000, mine[1] + best[1] / 2000), dest=child)
        elif step <= me < 2 * step:  # the child at this level: answer, then learn the offset
            parent = (me - step + root) % size
            for _ in range(PING_PONGS):
                comm.recv(source=parent)
                comm.send(time.time_ns(), dest=parent)
            mine = comm.recv(source=parent)
        step *= 2
    return comm.gather(mine, root=root)


def merge_traces(
    gathered: list[tuple[dict, list]], offsets: list[tuple[float, float]], names: list[str]
) -> dict:
    """Every rank's ``(chrome trace, message log)`` as one trace: process ``r`` is worker
    ``r``, times in us since the earliest event, each matched message an arrow. A rank
    without a torch profiler of its own gives ``{}`` as its trace."""
    events: list[dict] = []
    for rank, (trace, _) in enumerate(gathered):
        shift = trace.get("baseTimeNanoseconds", 0) / 1000 - offsets[rank][0]
        for event in trace.get("traceEvents", []):
            own_lane = not isinstance(event.get("pid"), int)
            process_name = event.get("ph") == "M" and event.get("name", "").startswith("process_")
            logged = event.get("ph") == "X" and event.get("name", "").startswith(LOGGED_SPANS)
            if own_lane or process_name or logged:
                continue  # the profiler's own lanes (process names are set below), and
                # spans the log holds for every thread
            event = dict(event, pid=rank)
            if isinstance(event.get("id"), int) and event.get("ph") in FLOW_PHASES:
                # torch's own flows (forward to backward, ...): ids unique across ranks
                event["id"] += (rank + 1) * TORCH_FLOW_ID_STRIDE
            if "ts" in event:
                event["ts"] = float(event["ts"]) + shift
            events.append(event)
    messages, clamped = _message_events(gathered, offsets)
    events += messages + _span_events(gathered, offsets)
    start = min((e["ts"] for e in events if e.get("ph") != "M" and "ts" in e), default=0.0)
    for event in events:
        if "ts" in event:
            event["ts"] = round(event["ts"] - start, 3) if event.get("ph") != "M" else 0
    for rank, name in enumerate(names):
        events += [
            {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": name}},
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": rank,
                "tid": 0,
                "args": {"sort_index": rank},
            },
            {
                "ph": "M",
                "name": "thread_name",
                "pid": rank,
                "tid": MESSAGE_TID,
                "args": {"name": "messages"},
            },
        ]
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "workers": names,
            "clock_offset_us": [round(o, 3) for o, _ in offsets],
            "clock_error_us": [round(e, 3) for _, e in offsets],
            "start_unix_us": start,
            "messages_clamped": clamped,
        },
    }


def _message_events(
    gathered: list[tuple[dict, list]], offsets: list[tuple[float, float]]
) -> tuple[list[dict], int]:
    """A short slice at each send and each receipt, and a flow arrow between them.

    A frame is named by (sender, receiver, tag) in both logs; tags repeat only after
    many frames, so repeats are matched in order. A receipt that the clock estimate
    puts before its send is drawn at the send (counted in ``messages_clamped``).
    """
    sends: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
    receipts = []
    for rank, (_, log) in enumerate(gathered):
        for way, time_ns, kind, peer, tag, nbytes in (e for e in log if e[0] != "span"):
            at = time_ns / 1000 - offsets[rank][0]
            if way == "send":
                sends[(rank, peer, tag)].append((at, kind, nbytes))
            else:
                receipts.append((at, peer, rank, tag, kind, nbytes))
    events = []
    clamped = 0
    for flow, (at, src, dst, tag, kind, nbytes) in enumerate(sorted(receipts)):
        queue = sends.get((src, dst, tag))
        if not queue:
            continue  # sent before the timeline started
        sent_at, _, _ = queue.popleft()
        if at < sent_at:
            at, clamped = sent_at, clamped + 1
        args = {"kind": kind, "bytes": nbytes, "from": src, "to": dst}
        events += [
            {
                "ph": "X",
                "name": f"send {kind}",
                "cat": "rpc_message",
                "pid": src,
                "tid": MESSAGE_TID,
                "ts": sent_at,
                "dur": 1.0,
                "args": args,
            },
            {
                "ph": "X",
                "name": f"receive {kind}",
                "cat": "rpc_message",
                "pid": dst,
                "tid": MESSAGE_TID,
                "ts": at,
                "dur": 1.0,
                "args": args,
            },
            {
                "ph": "s",
                "name": kind,
                "cat": "rpc_message",
                "id": flow,
                "pid": src,
                "tid": MESSAGE_TID,
                "ts": sent_at,
            },
            {
                "ph": "f",
                "bp": "e",
                "name": kind,
                "cat": "rpc_message",
                "id": flow,
                "pid": dst,
                "tid": MESSAGE_TID,
                "ts": at,
            },
        ]
    return events, clamped


def _span_events(
    gathered: list[tuple[dict, list]], offsets: list[tuple[float, float]]
) -> list[dict]:
    """The spans each rank logged, on the thread that ran them, with their args."""
    events = []
    for rank, (_, log) in enumerate(gathered):
        for _, start_ns, end_ns, name, tid, args in (e for e in log if e[0] == "span"):
            event = {
                "ph": "X",
                "name": name,
                "cat": "user_annotation",
                "pid": rank,
                "tid": tid,
                "ts": start_ns / 1000 - offsets[rank][0],
                "dur": (end_ns - start_ns) / 1000,
            }
            if args:
                event["args"] = args
            events.append(event)
    return events
