"""Many ranks: what starting and ending RPC costs each rank as the job grows, beside TensorPipe.

At every rank count, each rank runs ``init_rpc``, one ``rpc_sync`` to its neighbour, a
distributed backward pass through a call to its partner (ranks 2k and 2k+1), and
``shutdown()``; ours first, then TensorPipe in the same job (where it starts). Per rank count:
wall times of ``init_rpc`` and ``shutdown`` (the slowest rank's), CPU seconds per rank, the
agent's memory (what ``init_rpc`` added to the process's proportional set size, PSS: its
private pages, and each shared page divided by the processes that map it; the resident set,
RSS, is shown beside it: it counts in full every page of MPI's node-wide shared memory
segment that the rank touched, which grows with the ranks it talks to on the node but is
allocated once a node, by ``MPI_Init``), the largest rank's peak RSS, and what each
rank sent and received, counted where it happens: at init the bytes it handed to collectives
and got from them (the rendezvous's ``traffic``; init_rpc sends no frame), at shutdown the
frames and bytes its transport sent and received. The rank counts
run on one machine: with more ranks than cores they share them (oversubscribed), so times grow
with the ratio; counts and bytes do not.

``python benchmarks/many_ranks.py --ranks 8,16,32,64`` (one job per count);
one count: ``mpiexec -n N python -m mpi4py benchmarks/many_ranks.py``.
"""

import math
import os
import resource
import sys
import time
import traceback

import torch
from _harness import TP, Stack, drive, parse, row, run, sleep_barrier

#: Targets: frames a rank sends in shutdown, bytes it receives in init_rpc, agent memory growth.
FRAMES_BOUND = "4 log2(n) + 4"
INIT_BYTES_BOUND = 4096
MEMORY_GROWTH_MIB = 1.0


def memory_mib() -> dict[str, float]:
    """This process's resident (``rss``) and proportional (``pss``) set sizes, in MiB."""
    sizes = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, value, *_ = line.split()
            if key in ("Rss:", "Pss:"):
                sizes[key[:-1].lower()] = int(value) / 1024
    return sizes


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def sent_and_received(agent) -> tuple[int, int, int, int]:
    """Frames and bytes this rank's transport has sent and received, over all peers."""
    traffic = agent.transport.traffic()
    keys = ("messages_sent", "bytes_sent", "messages_received", "bytes_received")
    return tuple(sum(peer[k] for peer in traffic) for k in keys)


def one_job(comm, kind: str) -> dict:
    """init_rpc, a neighbour call, a two-rank backward pass and shutdown on every rank; what
    each cost, the largest over the ranks (counts: per rank, the largest)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if kind == "ours":
        from lightning_distgrad.rpc._calls import dispatch
        from lightning_distgrad.rpc._transport import rendezvous

        before_init = dict(rendezvous.traffic)
    memory0, cpu0 = memory_mib(), cpu_s()
    s = Stack(kind, comm).__enter__()
    try:
        grown = {k: v - memory0[k] for k, v in memory_mib().items()}
        if kind == "ours":
            agent = dispatch.require_agent()
            init_coll = {k: rendezvous.traffic[k] - before_init[k] for k in before_init}
        x = torch.ones(3, requires_grad=True)
        neighbour = f"worker{(rank + 1) % size}"
        assert torch.equal(s.rpc.rpc_sync(neighbour, torch.add, (x.detach(), 1)), x.detach() + 1)
        partner = rank ^ 1 if rank ^ 1 < size else rank
        with s.autograd.context() as context_id:
            y = s.rpc.rpc_sync(f"worker{partner}", torch.mul, (x, 2.0))
            s.autograd.backward(context_id, [y.sum()])
            grad = s.autograd.get_gradients(context_id)[x]
        assert torch.equal(grad, torch.full((3,), 2.0)), grad
    except BaseException:  # the other ranks would wait for this one forever
        traceback.print_exc()
        comm.Abort(1)
    sleep_barrier(comm)
    if kind == "ours":
        before = sent_and_received(agent)
    t0 = time.perf_counter()
    s.rpc.shutdown()
    shutdown_s = time.perf_counter() - t0
    m = {"init_s": s.init_s, "shutdown_s": shutdown_s, "cpu_s": cpu_s() - cpu0}
    m |= {"agent_mib": grown["pss"], "agent_rss_mib": grown["rss"]}
    m["peak_rss_mib"] = resource.getrusage(0).ru_maxrss / 1024
    if kind == "ours":
        after = sent_and_received(agent)
        m["init_collectives"] = init_coll["collectives"]
        m["init_collective_bytes_sent"] = init_coll["bytes_sent"]
        m["init_collective_bytes_received"] = init_coll["bytes_received"]
        names = ("frames_sent", "bytes_sent", "frames_received", "bytes_received")
        m |= {f"shutdown_{k}": a - b for k, a, b in zip(names, after, before, strict=True)}
    everyone = comm.allgather(m)
    return {k: max(r[k] for r in everyone) for k in m}


def measure(comm, args) -> tuple[list[dict], dict]:
    m = {"ranks": comm.Get_size(), "ours": one_job(comm, "ours")}
    try:
        m["tp"] = one_job(comm, "tp")
    except Exception as error:  # TensorPipe did not start at this size on this machine
        m["tp"] = None
        m["tp_error"] = f"{type(error).__name__}: {error}"[:300]
    return combine([{"measured": [m]}])


def exit_without_tensorpipe_teardown() -> None:
    """After TensorPipe failed to start, its threads abort the process at exit: end at once,
    once every rank wrote what it had to."""
    from mpi4py import MPI

    sys.stdout.flush()
    MPI.COMM_WORLD.Barrier()
    os._exit(0)


def combine(docs: list[dict]) -> tuple[list[dict], dict]:
    ms = sorted((d["measured"][0] for d in docs), key=lambda m: m["ranks"])
    rows = []
    for m in ms:
        n, ours, tp = m["ranks"], m["ours"], m.get("tp") or {}
        bound = 4 * math.log2(n) + 4
        rows.append(
            row(
                f"frames a rank sends in shutdown, {n} ranks",
                ours["shutdown_frames_sent"],
                bound,
                FRAMES_BOUND,
                "frames",
                ("<=", 1.0),
            )
        )
        received = ours["init_collective_bytes_received"]  # init_rpc sends no frame
        rows.append(
            row(
                f"bytes a rank receives in init_rpc, {n} ranks",
                received,
                INIT_BYTES_BOUND,
                "4 KiB",
                "B",
                ("<=", 1.0),
            )
        )
        for key, what in (("init_s", "init_rpc"), ("shutdown_s", "shutdown"), ("cpu_s", "CPU")):
            rows.append(row(f"{what}, {n} ranks", ours[key], tp.get(key), TP, "s"))
        for key, what in (("agent_mib", "agent memory (PSS)"), ("agent_rss_mib", "agent RSS")):
            rows.append(row(f"{what}, {n} ranks", ours[key], tp.get(key), TP, "MiB"))
    if len(ms) > 1:
        growth = ms[-1]["ours"]["agent_mib"] - ms[0]["ours"]["agent_mib"]
        name = f"agent memory (PSS) growth, {ms[0]['ranks']} to {ms[-1]['ranks']} ranks"
        rows.append(row(name, growth, MEMORY_GROWTH_MIB, "1 MiB", "MiB", ("<=", 1.0)))
    return rows, {"measured": ms}


if __name__ == "__main__":
    counts = {"type": lambda s: [int(n) for n in s.split(",")], "help": "N,M,...: a job each"}
    args = parse(__doc__, ranks=counts)
    jobs = {str(n): n for n in args.ranks or ()}
    if jobs:
        drive("many_ranks", args, jobs, combine)
    else:
        run("many_ranks", None, measure, args)
        if "torch.distributed.rpc" in sys.modules:  # TensorPipe started, or tried to
            exit_without_tensorpipe_teardown()
