"""RPC latency: ours vs TensorPipe vs raw MPI, the first call after a quiet spell, idle CPU.

Rank 0 times 8 B round trips of ``rpc_sync`` (``torch.add`` and a Python function), and of
``rpc_async(...).wait()`` after 20 and 200 ms without traffic (an idle agent naps); idle CPU
is what a process uses while its main thread sleeps. Medians over rounds of fresh stacks."""

import time
from statistics import median

import torch
from _harness import TP, Stack, echo, parse, ping_pong, row, run, sample, sleep_barrier
from mpi4py import MPI

FIGURES = [  # (key, metric, target on ours / TensorPipe)
    ("add", "8 B rpc_sync(torch.add) round trip", None),
    ("fn", "8 B rpc_sync(Python function) round trip", None),
    (0.02, "rpc_async(torch.add) after 20 ms quiet", None),
    (0.2, "rpc_async(torch.add) after 200 ms quiet", None),
    ("idle", "idle CPU per process, agent up", None),
]


def stack_round(kind: str, comm: MPI.Comm, reps: int, quiet_reps: int, idle_s: float) -> dict:
    """One stack's medians (rank 0), and the idle CPU of the busier process."""
    out: dict = {}
    with Stack(kind, comm) as s:
        t, rpc = torch.ones(2), s.rpc
        calls = {"add": (torch.add, (t, 1), t + 1), "fn": (echo, (t,), t)}
        if comm.Get_rank() == 0:
            for key, (fn, args, expected) in calls.items():
                if not torch.equal(rpc.rpc_sync("worker1", fn, args), expected):
                    raise AssertionError(f"{kind}: {fn.__name__} returned a wrong result")
                call = lambda fn=fn, args=args: rpc.rpc_sync("worker1", fn, args)  # noqa: E731
                out[key] = median(sample(call, reps, warmup=reps // 10, min_s=0.3))
            wake = lambda: rpc.rpc_async("worker1", torch.add, (t, 1)).wait()  # noqa: E731
            for quiet, n in ((0.02, quiet_reps), (0.2, max(3, quiet_reps // 4))):
                out[quiet] = median(sample(wake, n, warmup=0, pause=quiet))
        sleep_barrier(comm)
        cpu0, t0 = time.process_time(), time.perf_counter()
        time.sleep(idle_s)
        idle = (time.process_time() - cpu0) / (time.perf_counter() - t0)
        out["idle"] = comm.allreduce(idle, op=MPI.MAX)
    return out


def measure(comm: MPI.Comm, args) -> tuple[list[dict] | None, dict]:
    reps, quiet_reps, idle_s = (200, 12, 1.0) if args.quick else (2000, 50, 2.0)
    runs: dict = {"mpi": [], "ours": [], "tp": []}
    for _ in range(1 if args.quick else 3):
        runs["mpi"].append(ping_pong(comm, bytearray(8), bytearray(8), reps, warmup=10))
        for kind in ("ours", "tp"):
            runs[kind].append(stack_round(kind, comm, reps, quiet_reps, idle_s))
    if comm.Get_rank() != 0:
        return None, {}
    ours, tp = ({k: median([r[k] for r in runs[s]]) for k in runs[s][0]} for s in ("ours", "tp"))
    rows = [row(m, ours[k], tp[k], TP, "cores" if k == "idle" else "s", t) for k, m, t in FIGURES]
    rows.insert(1, row(FIGURES[0][1], ours["add"], median(runs["mpi"]), "raw MPI", "s"))
    return rows, {"runs": runs}


if __name__ == "__main__":
    run("rpc_latency", 2, measure, parse(__doc__))
