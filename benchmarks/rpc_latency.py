"""RPC latency: ours vs TensorPipe vs raw MPI, what a small call costs each side, idle CPU.

Rank 0 times 8 B round trips of ``rpc_sync`` (``torch.add`` and a Python function), and of
``rpc_async(...).wait()`` after 20 and 200 ms without traffic (an idle agent naps), beside
an mpi4py ``Send``/``Recv`` ping-pong and the same call's messages alone (our payload pickling
and frames over bare mpi4py, one thread a side: the part of a round trip no agent design
removes while messages are pickled in Python) in the same job. Each side's CPU time and context
switches per call are counted over a second loop of the same calls (the callee's
involuntary switches show threads preempting each other). Idle CPU is what a process uses
while its main thread sleeps. Medians over rounds of fresh stacks."""

import time
from statistics import median

import torch
from _harness import (
    FLOOR,
    TP,
    Stack,
    costs,
    echo,
    parse,
    ping_pong,
    row,
    run,
    sample,
    sleep_barrier,
)
from mpi4py import MPI

FIGURES = [  # (key, metric, target on ours / TensorPipe)
    ("add", "8 B rpc_sync(torch.add) round trip", ("<=", 0.25)),
    ("fn", "8 B rpc_sync(Python function) round trip", None),
    (0.02, "rpc_async(torch.add) after 20 ms quiet", None),
    (0.2, "rpc_async(torch.add) after 200 ms quiet", None),
    ("idle", "idle CPU per process, agent up", None),
]
#: Per call, on each side: (key in a round's "costs", metric, unit).
COSTS = [
    ("cpu_s", "CPU time per call", "s"),
    ("involuntary", "involuntary context switches per call", "/call"),
    ("voluntary", "voluntary context switches per call", "/call"),
]
SIDES = ("caller", "callee")


def stack_round(kind: str, comm: MPI.Comm, reps: int, quiet_reps: int, idle_s: float) -> dict:
    """One stack's medians (rank 0), per-call costs of each side, and the idle CPU of the
    busier process."""
    out: dict = {"costs": {}}
    with Stack(kind, comm) as s:
        t, rpc = torch.ones(2), s.rpc
        calls = {"add": (torch.add, (t, 1), t + 1), "fn": (echo, (t,), t)}
        for key, (fn, args, expected) in calls.items():
            call = lambda fn=fn, args=args: rpc.rpc_sync("worker1", fn, args)  # noqa: E731
            if comm.Get_rank() == 0:
                if not torch.equal(call(), expected):
                    raise AssertionError(f"{kind}: {fn.__name__} returned a wrong result")
                out[key] = median(sample(call, reps, warmup=reps // 10, min_s=0.3))
            out["costs"][key] = costs(comm, call, reps)[:2]  # caller, callee
        if comm.Get_rank() == 0:
            wake = lambda: rpc.rpc_async("worker1", torch.add, (t, 1)).wait()  # noqa: E731
            for quiet, n in ((0.02, quiet_reps), (0.2, max(3, quiet_reps // 4))):
                out[quiet] = median(sample(wake, n, warmup=0, pause=quiet))
        sleep_barrier(comm)
        cpu0, t0 = time.process_time(), time.perf_counter()
        time.sleep(idle_s)
        idle = (time.process_time() - cpu0) / (time.perf_counter() - t0)
        out["idle"] = comm.allreduce(idle, op=MPI.MAX)
    return out


def wire_floor(comm, reps: int) -> float | None:
    """Rank 0: the median round trip of ``rpc_sync(torch.add)``'s request and response
    through our payload pickling and frame format over bare mpi4py, one thread a side,
    polling without pause: what the messages' Python costs with no agent around them
    (threads, futures, dispatch, progress). None on the other ranks."""
    from mpi4py import MPI

    from lightning_distgrad.rpc._calls.payload import decode_payload, encode_payload
    from lightning_distgrad.rpc._transport.frames import Frame, FrameLimits, Kind, decode_frame
    from lightning_distgrad.rpc._transport.tensor_bytes import (
        allocate_tensor,
        describe_host_tensor,
    )

    limits, status, peer = FrameLimits(1 << 20, frozenset({"cpu"})), MPI.Status(), 1 - comm.rank

    def send(kind: Kind, obj) -> MPI.Request:
        payload, tensors, _ = encode_payload(obj, peer)
        metas = tuple(describe_host_tensor(t)[0] for t in tensors)
        return comm.Isend(Frame(kind, 0, payload).dumps(metas), peer)

    def receive():
        while (message := comm.Improbe(peer, 0, status)) is None:
            pass
        raw = bytearray(status.Get_count(MPI.BYTE))
        message.Recv(raw)
        frame = decode_frame(raw, limits)
        return decode_payload(frame.payload, [allocate_tensor(m) for m in frame.metas])

    t = torch.ones(2)
    call = lambda: (send(Kind.REQUEST, (torch.add, (t, 1), {})), receive())[0].Wait()  # noqa: E731
    sleep_barrier(comm)
    if comm.Get_rank() == 0:
        return median(sample(call, reps, warmup=reps // 10))
    for _ in range(reps + reps // 10 if comm.Get_rank() == 1 else 0):
        fn, args, kwargs = receive()
        send(Kind.RESPONSE, fn(*args, **kwargs)).Wait()
    return None


def _median_cost(rounds: list[dict], call: str, side: int, key: str) -> float:
    return median(r["costs"][call][side][key] for r in rounds)


def measure(comm: MPI.Comm, args) -> tuple[list[dict] | None, dict]:
    reps, quiet_reps, idle_s = (200, 12, 1.0) if args.quick else (2000, 50, 2.0)
    runs: dict = {"mpi": [], "floor": [], "ours": [], "tp": []}
    for _ in range(1 if args.quick else 3):
        runs["mpi"].append(ping_pong(comm, bytearray(8), bytearray(8), reps, warmup=10))
        runs["floor"].append(wire_floor(comm, reps))
        for kind in ("ours", "tp"):
            runs[kind].append(stack_round(kind, comm, reps, quiet_reps, idle_s))
    if comm.Get_rank() != 0:
        return None, {}
    scalars = [k for k, _, _ in FIGURES]
    ours, tp = ({k: median([r[k] for r in runs[s]]) for k in scalars} for s in ("ours", "tp"))
    rows = [row(m, ours[k], tp[k], TP, "cores" if k == "idle" else "s", t) for k, m, t in FIGURES]
    rows.insert(1, row(FIGURES[0][1], ours["add"], median(runs["mpi"]), "raw MPI", "s", ("<=", 10)))
    rows.insert(2, row(FIGURES[0][1], ours["add"], median(runs["floor"]), FLOOR, "s"))
    for call, name in (("add", "rpc_sync(torch.add)"), ("fn", "rpc_sync(Python function)")):
        for side, side_name in enumerate(SIDES):
            for key, metric, unit in COSTS:
                mine, theirs = (_median_cost(runs[s], call, side, key) for s in ("ours", "tp"))
                rows.append(row(f"{name}: {side_name} {metric}", mine, theirs, TP, unit))
    return rows, {"runs": runs}


if __name__ == "__main__":
    run("rpc_latency", 2, measure, parse(__doc__))
