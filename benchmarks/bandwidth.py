"""Bandwidth: ``rpc_sync`` echo of large tensors vs raw MPI ``Send``/``Recv`` (and TensorPipe).

For float32 tensors of 1 MiB, 4 MiB, ... 4 GiB, rank 0 times ``rpc_sync(echo)`` and, our
agent up and idle, raw MPI between buffers allocated beforehand; throughput is ``2 * bytes /
round trip``. Each size is freed before the next (4 GiB: ~12 GiB of memory)."""

import gc
from statistics import median

import torch
from _harness import TP, GiB, MiB, Stack, echo, parse, ping_pong, row, run, sample, sleep_barrier
from mpi4py import MPI

STRIDE = 4099  # an echo is checked at every STRIDE-th element and the last one
TP_MAX_BYTES = GiB  # TensorPipe is timed up to this size
ANCHORS = {"raw": ("raw MPI Send+Recv", (">=", 0.7)), "tp": (TP, None)}  # (name, target)


def label(nbytes: int) -> str:
    return f"{nbytes // GiB} GiB" if nbytes >= GiB else f"{nbytes // MiB} MiB"


def check(got: torch.Tensor, sent: torch.Tensor, what: str) -> None:
    same = got.shape == sent.shape and torch.equal(got[::STRIDE], sent[::STRIDE])
    if not same or not torch.equal(got[-1:], sent[-1:]):
        raise AssertionError(f"{what}: the echo differs from the tensor sent")


def raw_mpi(comm: MPI.Comm, nbytes: int, reps: int) -> float | None:
    """Median round trip of ``nbytes`` by ``Send``/``Recv`` (rank 0; rank 1 echoes)."""
    back = torch.zeros(nbytes // 4)  # its pages touched before the timed loop
    sent = torch.arange(nbytes // 4, dtype=torch.float32) if comm.Get_rank() == 0 else back
    seconds = ping_pong(comm, sent.numpy(), back.numpy(), reps)
    if seconds is not None:
        check(back, sent, f"raw MPI, {label(nbytes)}")
    return seconds


def rpc_echo(rpc, nbytes: int, reps: int, what: str) -> float:
    """Median round trip of ``rpc_sync(echo)`` of ``nbytes`` (rank 0)."""
    sent = torch.arange(nbytes // 4, dtype=torch.float32)
    check(rpc.rpc_sync("worker1", echo, (sent,)), sent, f"{what}, {label(nbytes)}")
    call = lambda: rpc.rpc_sync("worker1", echo, (sent,))  # noqa: E731
    sample(call, 1, warmup=0, min_s=0.2)  # a waking agent runs slower for a while
    return median(sample(call, reps, warmup=0))


def measure(comm: MPI.Comm, args) -> tuple[list[dict], dict]:
    top = args.max_bytes or (16 * MiB if args.quick else 4 * GiB)
    sizes = [MiB << 2 * k for k in range(12) if MiB << 2 * k <= top]
    reps = {n: 3 if args.quick else max(5, min(50, 320 * MiB // n)) for n in sizes}
    rank, times = comm.Get_rank(), {"raw": {}, "ours": {}, "tp": {}}
    for kind in ("ours", "tp"):
        with Stack(kind, comm) as s:
            for n in sizes if kind == "ours" else [n for n in sizes if n <= TP_MAX_BYTES]:
                sleep_barrier(comm)  # rank 1 waits here, asleep, while rank 0 calls it
                if kind == "ours":
                    times["raw"][n] = raw_mpi(comm, n, reps[n])
                    gc.collect()
                if rank == 0:
                    times[kind][n] = rpc_echo(s.rpc, n, reps[n], kind)
                gc.collect()
    rows = []
    for kind, (anchor, target) in ANCHORS.items():
        for n in times[kind] if rank == 0 else ():
            ours, other = (2 * n / times[k][n] / 1e9 for k in ("ours", kind))
            metric = f"rpc_sync echo {label(n)}: throughput"
            rows.append(row(metric, ours, other, anchor, "GB/s", target))
    return rows, {"round_trip_s": times}


if __name__ == "__main__":
    largest = {"type": int, "help": "largest size (default 4 GiB, quick 16 MiB)"}
    run("bandwidth", 2, measure, parse(__doc__, max_bytes=largest))
