"""Bandwidth: ``rpc_sync`` echo of large tensors vs raw MPI ``Send``/``Recv`` (and TensorPipe).

For float32 tensors of 1 MiB, 4 MiB, ... 4 GiB, rank 0 times ``rpc_sync("worker1", echo,
(t,))`` and, with our agent up and idle, raw MPI moving the same bytes there and back
between buffers allocated beforehand. Throughput: ``2 * bytes / round trip``. One tensor
travels each way at a time and each size is freed before the next (4 GiB: ~12 GiB of memory).
"""

import gc
from statistics import median

import torch
from _harness import GiB, MiB, Stack, finish, parse, row, sample, sleep_barrier, world
from mpi4py import MPI

STRIDE = 4099  # an echo is checked at every STRIDE-th element and the last one


def echo(t: torch.Tensor) -> torch.Tensor:
    return t


def label(nbytes: int) -> str:
    return f"{nbytes // GiB} GiB" if nbytes >= GiB else f"{nbytes // MiB} MiB"


def check(got: torch.Tensor, sent: torch.Tensor, what: str) -> None:
    same = got.shape == sent.shape and torch.equal(got[::STRIDE], sent[::STRIDE])
    if not same or not torch.equal(got[-1:], sent[-1:]):
        raise AssertionError(f"{what}: the echo differs from the tensor sent")


def raw_mpi(comm: MPI.Comm, nbytes: int, reps: int) -> float | None:
    """Median round trip of ``nbytes`` by ``Send``/``Recv`` (rank 0; rank 1 echoes)."""
    peer = 1 - comm.Get_rank()
    if comm.Get_rank() == 1:
        buf = torch.empty(nbytes // 4).numpy()
        for _ in range(reps + 1):
            comm.Recv(buf, source=peer)
            comm.Send(buf, dest=peer)
        return None
    sent = torch.arange(nbytes // 4, dtype=torch.float32)
    back = torch.zeros_like(sent)  # its pages touched before the timed loop
    send, recv = sent.numpy(), back.numpy()
    times = sample(lambda: (comm.Send(send, dest=peer), comm.Recv(recv, source=peer)), reps)
    check(back, sent, f"raw MPI, {label(nbytes)}")
    return median(times)


def rpc_echo(rpc, nbytes: int, reps: int, what: str) -> float:
    """Median round trip of ``rpc_sync(echo)`` of ``nbytes`` (rank 0)."""
    sent = torch.arange(nbytes // 4, dtype=torch.float32)
    check(rpc.rpc_sync("worker1", echo, (sent,)), sent, f"{what}, {label(nbytes)}")
    return median(sample(lambda: rpc.rpc_sync("worker1", echo, (sent,)), reps, warmup=0))


def main() -> None:
    args = parse(
        __doc__.splitlines()[0],
        (["--max-bytes"], {"type": int, "help": "largest size (default 4 GiB, quick 16 MiB)"}),
        (["--tp-max-bytes"], {"type": int, "default": GiB, "help": "largest for TensorPipe"}),
    )
    comm = world("bandwidth", 2)
    top = args.max_bytes or (16 * MiB if args.quick else 4 * GiB)
    sizes = [MiB << 2 * k for k in range(12) if MiB << 2 * k <= top]
    reps = {n: 3 if args.quick else max(5, min(50, 320 * MiB // n)) for n in sizes}
    rank, times = comm.Get_rank(), {"raw": {}, "ours": {}, "tp": {}}
    for kind in ("ours", "tp"):
        with Stack(kind, comm) as s:
            for n in sizes if kind == "ours" else [n for n in sizes if n <= args.tp_max_bytes]:
                sleep_barrier(comm)  # rank 1 waits here, asleep, while rank 0 calls it
                if kind == "ours":
                    times["raw"][n] = raw_mpi(comm, n, reps[n])
                    gc.collect()
                if rank == 0:
                    times[kind][n] = rpc_echo(s.rpc, n, reps[n], kind)
                gc.collect()
    rows = []
    for kind, target, anchor in (
        ("raw", (">=", 0.7), "raw MPI Send+Recv"),
        ("tp", None, "TensorPipe"),
    ):
        for n in times[kind] if rank == 0 else ():
            ours, other = (2 * n / times[k][n] / 1e9 for k in ("ours", kind))
            rows.append(
                row(f"rpc_sync echo {label(n)}: throughput", ours, other, anchor, "GB/s", target)
            )
    finish("bandwidth", rows, comm, args, round_trip_s=times)


if __name__ == "__main__":
    main()
