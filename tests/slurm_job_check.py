"""Tiny MPI program run by tests/test_slurm.py inside a Slurm job.

Needs only mpi4py + torch. Each rank reports its rank/size and where it runs;
an allreduce of a torch tensor through mpi4py buffers proves the ranks really
form one MPI world (a broken PMI setup yields N singletons of size 1 instead).
Rank 0 prints ``SLURM_CHECK world=<size> sum=<1+2+...+size>`` (each rank adds rank+1).

With SLURM_CHECK_FAIL_RANK=<r> set, rank r raises before the allreduce; under
``python -m mpi4py`` that must abort the whole job instead of hanging.

Launch: ``mpiexec -n 2 python -m mpi4py tests/slurm_job_check.py``
"""

import os
import socket
import sys

import torch
from mpi4py import MPI


def main() -> int:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    print(
        f"rank {rank}/{size} host={socket.gethostname()} "
        f"slurm_procid={os.environ.get('SLURM_PROCID', '-')} "
        f"affinity={sorted(os.sched_getaffinity(0))}",
        flush=True,
    )

    # Used by tests/test_slurm.py to check that a failing rank ends the job.
    if os.environ.get("SLURM_CHECK_FAIL_RANK") == str(rank):
        raise RuntimeError(f"SLURM_CHECK_FAIL_RANK={rank}: deliberate failure")

    # torch tensors expose the buffer protocol via numpy; no torch.distributed.
    send = torch.tensor([rank + 1], dtype=torch.int64)
    recv = torch.zeros(1, dtype=torch.int64)
    comm.Allreduce(send.numpy(), recv.numpy(), op=MPI.SUM)

    expected = size * (size + 1) // 2
    if recv.item() != expected:
        print(f"rank {rank}: allreduce gave {recv.item()}, expected {expected}", flush=True)
        return 1
    comm.Barrier()
    if rank == 0:
        print(f"SLURM_CHECK world={size} sum={recv.item()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
