"""Scaling: all-to-all ``rpc_async`` calls at N ranks vs a minimal mpi4py request/reply loop.

Every rank makes 2400 calls (``torch.add`` of 8 B) round robin over the others, ``WINDOW``
in flight, while its agent answers theirs; the baseline keeps ``WINDOW`` 8 B ``Isend``
requests in flight and answers what ``Iprobe`` finds. Cost per call: time until the last
rank is done over all ranks' calls. Also ``init_rpc`` time and the largest RSS of a rank."""

import os
import time
from resource import RUSAGE_SELF, getrusage
from statistics import median

import torch
from _harness import Stack, drive, parse, row, run, sleep_barrier

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
    answered = replies = 0
    comm.Barrier()
    t0 = time.perf_counter()
    while replies < calls or answered < expected:
        while todo and calls - len(todo) - replies < WINDOW:  # requests awaiting a reply
            sends.append(comm.Isend(buf, todo.pop(), REQUEST))
        if comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
            source, tag = status.Get_source(), status.Get_tag()
            comm.Recv(buf, source, tag)
            if tag == REQUEST:
                sends.append(comm.Isend(buf, source, REPLY))
                answered += 1
            else:
                replies += 1
        else:
            os.sched_yield()
        if len(sends) > 256:
            sends = [r for r in sends if not r.Test()]
    MPI.Request.Waitall(sends)
    elapsed = time.perf_counter() - t0
    sleep_barrier(comm)  # ranks done early must not spin while the others work
    return max(comm.allgather(elapsed))


def ours(comm, calls: int) -> tuple[float, float]:
    """The slowest rank's ``init_rpc`` seconds, and seconds until all calls returned."""
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
        return max(comm.allgather(s.init_s)), max(comm.allgather(elapsed))


def measure(comm, args) -> tuple[list[dict], dict]:
    max_rss_mib = lambda: max(comm.allgather(getrusage(RUSAGE_SELF).ru_maxrss)) / 1024
    n, calls, rss0 = comm.Get_size(), 240 if args.quick else 2400, max_rss_mib()
    runs = [(baseline(comm, calls), *ours(comm, calls)) for _ in range(1 if args.quick else 3)]
    base, init_s, elapsed = (median(v) for v in zip(*runs, strict=True))
    m = {"ranks": n, "baseline": base / (n * calls), "ours": elapsed / (n * calls)}
    m |= {"init_s": init_s, "rss0": rss0, "rss": max_rss_mib()}
    return combine([{"measured": [m]}])


def combine(docs: list[dict]) -> tuple[list[dict], dict]:
    """Rows of the jobs' measurements at each rank count, and the growth of ours / baseline."""
    ms = [d["measured"][0] for d in docs]
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
    return rows, {"measured": ms}


if __name__ == "__main__":
    counts = {"type": lambda s: [int(n) for n in s.split(",")], "help": "N,M,...: a job each"}
    args = parse(__doc__, ranks=counts)
    jobs = {str(n): n for n in args.ranks or ()}
    drive("scaling", args, jobs, combine) if jobs else run("scaling", None, measure, args)
