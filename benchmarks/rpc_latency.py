"""RPC latency: ours vs TensorPipe vs raw MPI, the first call after a quiet spell, idle CPU.

Rank 0 times round trips of ``rpc_sync("worker1", torch.add, (t, 1))`` with an 8 B ``t``,
of ``rpc_sync("worker1", echo, (t,))`` (a Python function), and of the add by
``rpc_async(...).wait()`` after 20 ms and 200 ms without traffic (an idle agent naps);
raw MPI: an 8 B ``Send``/``Recv`` ping-pong. Idle CPU: what each process uses while its
main thread sleeps, the agent up. Medians over rounds, each starting both stacks afresh.
"""

import time
from statistics import median

import torch
from _harness import Stack, finish, parse, row, sample, sleep_barrier, world
from mpi4py import MPI

FIGURES = [  # (key, metric, target on ours / TensorPipe)
    ("add", "8 B rpc_sync(torch.add) round trip", ("<=", 0.25)),
    ("fn", "8 B rpc_sync(Python function) round trip", None),
    (0.02, "rpc_async(torch.add) after 20 ms quiet", None),
    (0.2, "rpc_async(torch.add) after 200 ms quiet", None),
    ("idle", "idle CPU per process, agent up", None),
]


def echo(t: torch.Tensor) -> torch.Tensor:
    return t


def raw_mpi(comm: MPI.Comm, reps: int) -> float | None:
    """Median 8 B ``Send``/``Recv`` round trip (rank 0; rank 1 echoes)."""
    buf, peer = bytearray(8), 1 - comm.Get_rank()
    for _ in range(reps + 10 if comm.Get_rank() == 1 else 0):
        comm.Recv(buf, source=peer)
        comm.Send(buf, dest=peer)
    ping = lambda: (comm.Send(buf, dest=peer), comm.Recv(buf, source=peer))  # noqa: E731
    return median(sample(ping, reps, warmup=10)) if comm.Get_rank() == 0 else None


def stack_round(kind: str, comm: MPI.Comm, reps: int, quiet_reps: int, idle_s: float) -> dict:
    """One stack's medians (rank 0), and the idle CPU of the busier process."""
    out: dict = {}
    with Stack(kind, comm) as s:
        t, rpc = torch.ones(2), s.rpc
        if comm.Get_rank() == 0:
            for key, fn, expected in (("add", torch.add, t + 1), ("fn", echo, t)):
                args = (t, 1) if fn is torch.add else (t,)
                if not torch.equal(rpc.rpc_sync("worker1", fn, args), expected):
                    raise AssertionError(f"{kind}: {fn.__name__} returned a wrong result")
                call = lambda fn=fn, args=args: rpc.rpc_sync("worker1", fn, args)  # noqa: E731
                out[key] = median(sample(call, reps, warmup=reps // 10, min_s=0.3))
            for quiet in (0.02, 0.2):
                times = []
                for _ in range(quiet_reps if quiet < 0.1 else max(3, quiet_reps // 4)):
                    time.sleep(quiet)
                    t0 = time.perf_counter()
                    rpc.rpc_async("worker1", torch.add, (t, 1)).wait()
                    times.append(time.perf_counter() - t0)
                out[quiet] = median(times)
        sleep_barrier(comm)
        cpu0, t0 = time.process_time(), time.perf_counter()
        time.sleep(idle_s)
        idle = (time.process_time() - cpu0) / (time.perf_counter() - t0)
        out["idle"] = comm.allreduce(idle, op=MPI.MAX)
    return out


def main() -> None:
    args = parse(__doc__.splitlines()[0], (["--rounds"], {"type": int, "help": "default 3"}))
    comm = world("rpc_latency", 2)
    reps, quiet_reps, idle_s = (200, 12, 1.0) if args.quick else (2000, 50, 2.0)
    runs: dict = {"mpi": [], "ours": [], "tp": []}
    for _ in range(args.rounds or (1 if args.quick else 3)):
        runs["mpi"].append(raw_mpi(comm, reps))
        for kind in ("ours", "tp"):
            runs[kind].append(stack_round(kind, comm, reps, quiet_reps, idle_s))
    rows = None
    if comm.Get_rank() == 0:
        ours, tp = (
            {k: median([r[k] for r in runs[s]]) for k in runs[s][0]} for s in ("ours", "tp")
        )
        units = {"idle": "cores"}
        rows = [row(m, ours[k], tp[k], "TensorPipe", units.get(k, "s"), t) for k, m, t in FIGURES]
        rows.insert(1, row(FIGURES[0][1], ours["add"], median(runs["mpi"]), "raw MPI", "s"))
    finish("rpc_latency", rows, comm, args, runs=runs)


if __name__ == "__main__":
    main()
