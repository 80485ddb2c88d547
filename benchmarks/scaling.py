"""Scaling: all-to-all ``rpc_async`` calls at N ranks vs a minimal mpi4py request/reply loop.

Every rank makes ``--calls`` calls (``torch.add`` of 8 B) round robin over the others,
``WINDOW`` in flight, while its agent answers theirs; the baseline loop keeps ``WINDOW``
8-byte requests in flight (``Isend``) and answers what ``Iprobe`` finds. Cost per call: time
until the last rank is done over all ranks' calls. Target: ours / baseline grows at most
1.3x from the fewest ranks to the most. Also ``init_rpc`` time and a rank's largest RSS.
"""

import os
import resource
import sys
import time
from statistics import median

import torch
from _harness import RESULTS, Stack, finish, launch, parse, row, sleep_barrier, world, write

WINDOW = 8
REQUEST, REPLY = 11, 12
GROWTH_TARGET = 1.3
BASE = "mpi4py request/reply loop"


def targets(rank: int, size: int, calls: int) -> list[int]:
    peers = [p for p in range(size) if p != rank]
    return [peers[i % len(peers)] for i in range(calls)]


def baseline(comm, calls: int) -> float:
    """Seconds until every rank got its replies and answered every request."""
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    todo, buf, status, sends = targets(rank, size, calls), bytearray(8), MPI.Status(), []
    expected = sum(targets(r, size, calls).count(rank) for r in range(size))
    answered = replies = in_flight = 0
    comm.Barrier()
    t0 = time.perf_counter()
    while replies < calls or answered < expected:
        while todo and in_flight < WINDOW:
            sends.append(comm.Isend(buf, todo.pop(), REQUEST))
            in_flight += 1
        if comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
            source, tag = status.Get_source(), status.Get_tag()
            comm.Recv(buf, source, tag)
            if tag == REQUEST:
                sends.append(comm.Isend(buf, source, REPLY))
                answered += 1
            else:
                replies, in_flight = replies + 1, in_flight - 1
        else:
            os.sched_yield()
        if len(sends) > 256:
            sends = [r for r in sends if not r.Test()]
    MPI.Request.Waitall(sends)
    elapsed = time.perf_counter() - t0
    sleep_barrier(comm)  # ranks done early must not spin while the others work
    return comm.allreduce(elapsed, op=MPI.MAX)


def ours(comm, calls: int) -> tuple[float, float]:
    """The slowest rank's ``init_rpc`` seconds, and seconds until all calls returned."""
    from mpi4py import MPI

    with Stack("ours", comm) as s:
        t, todo = torch.ones(2), targets(comm.Get_rank(), comm.Get_size(), calls)
        comm.Barrier()
        t0 = time.perf_counter()
        for i in range(0, calls, WINDOW):
            futures = [s.rpc.rpc_async(f"worker{p}", torch.add, (t, 1)) for p in todo[i:][:WINDOW]]
            if not all(torch.equal(f.wait(), t + 1) for f in futures):
                raise AssertionError("torch.add returned a wrong result")
        elapsed = time.perf_counter() - t0
        sleep_barrier(comm)
        return comm.allreduce(s.init_s, op=MPI.MAX), comm.allreduce(elapsed, op=MPI.MAX)


def max_rss_mib(comm) -> float:
    from mpi4py import MPI

    return comm.allreduce(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, op=MPI.MAX)


def job(args) -> None:
    comm, base, runs = world("scaling"), [], []
    n, calls, rss0 = comm.Get_size(), args.calls or (240 if args.quick else 2400), max_rss_mib(comm)
    for _ in range(args.rounds or (1 if args.quick else 3)):
        base.append(baseline(comm, calls) / (n * calls))
        init_s, elapsed = ours(comm, calls)
        runs.append((init_s, elapsed / (n * calls)))
    m = {"ranks": n, "baseline": median(base), "ours": median([r[1] for r in runs])}
    m |= {"init_s": median([r[0] for r in runs]), "rss0": rss0, "rss": max_rss_mib(comm)}
    finish("scaling", rows_for([m]), comm, args, measured=[m])


def rows_for(ms: list[dict]) -> list[dict]:
    """Rows of the measurements at each rank count, and the growth of ours / baseline."""
    rows, first, last = [], ms[0], ms[-1]
    for m in ms:
        n, init0 = m["ranks"], first["init_s"] if m is not first else None
        rows.append(row(f"rpc_async all-to-all, {n} ranks", m["ours"], m["baseline"], BASE, "s"))
        rows.append(row(f"init_rpc, {n} ranks", m["init_s"], init0, f"{first['ranks']} ranks", "s"))
        rows.append(row(f"max RSS, {n} ranks", m["rss"], m["rss0"], "before init_rpc", "MiB"))
    if len(ms) > 1:
        lo, hi = (m["ours"] / m["baseline"] for m in (first, last))
        name = f"ours/baseline per call, {last['ranks']} vs {first['ranks']} ranks"
        rows.append(row(name, hi, lo, f"{first['ranks']} ranks", "x", ("<=", GROWTH_TARGET)))
    return rows


def jobs(args) -> None:
    """One job per rank count in ``args.ranks``; the rows of all of them."""
    extra = ["--quick"] * args.quick
    extra += [f"--{k}={getattr(args, k)}" for k in ("rounds", "calls") if getattr(args, k)]
    parts = [(n, RESULTS / "parts" / f"scaling.{n}.json") for n in args.ranks.split(",")]
    docs = [launch("scaling.py", int(n), extra, part) for n, part in parts]
    ms = [d["measured"][0] for d in docs]
    env = docs[-1]["env"] | {"command": " ".join(sys.argv)}
    write("scaling", rows_for(ms), env, args.out, measured=ms)


if __name__ == "__main__":
    arguments = parse(
        __doc__.splitlines()[0],
        (["--ranks"], {"help": "comma list of rank counts, one job each"}),
        (["--calls"], {"type": int, "help": "calls per rank (default 2400, quick 240)"}),
        (["--rounds"], {"type": int, "help": "default 3, quick 1"}),
    )
    jobs(arguments) if arguments.ranks else job(arguments)
