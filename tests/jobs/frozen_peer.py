"""Job script: the last rank freezes (SIGSTOP) once every call was answered.

``python -m mpi4py frozen_peer.py timed CALL_TIMEOUT SHUTDOWN_TIMEOUT``: rank 0's call to the
frozen rank times out, and every healthy rank's ``shutdown(timeout=...)`` raises, naming it;
then rank 0 ends the job (the only way to end it with a stopped rank).

``python -m mpi4py frozen_peer.py default PING_TIMEOUT``: a shutdown without a timeout waits
for workers that answer; the frozen one leaves its predecessor's liveness ping unanswered for
the RPC timeout (``PING_TIMEOUT``), which ends the job naming it.

``tests/test_rpc_process.py`` runs it at 2 and 4 ranks, ``tests/test_many_ranks.py`` at 16.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from mpi4py import MPI

import lightning_distgrad.rpc as rpc
from lightning_distgrad.rpc._transport import abort_mpi_job


def freeze_last_rank(comm: MPI.Comm, timeout: float = 60.0) -> tuple[int, int]:
    """Start RPC, have every agent answer a call, stop the last rank; (this rank, the last)."""
    rpc.init_rpc(rpc_backend_options=rpc.MPIRpcBackendOptions(rpc_timeout=timeout))
    me, last = comm.Get_rank(), comm.Get_size() - 1
    rpc.rpc_sync((me + 1) % comm.Get_size(), torch.add, (torch.ones(1), 1))
    comm.Barrier()  # every call was answered before the last rank stops
    if me == last:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: answers nothing from now on
    time.sleep(0.5)
    return me, last


def timed(comm: MPI.Comm, call_timeout: float, shutdown_timeout: float) -> None:
    me, last = freeze_last_rank(comm)
    if me == 0:
        try:
            rpc.rpc_sync(last, torch.add, (torch.ones(1), 1), timeout=call_timeout)
        except RuntimeError as e:
            print(f"call failed: {e}", flush=True)
    start = time.monotonic()
    try:
        rpc.shutdown(timeout=shutdown_timeout)
    except RuntimeError as e:
        print(f"rank {me} shutdown raised after {time.monotonic() - start:.2f} s: {e}", flush=True)
    healthy = range(1, last)
    if me in healthy:
        comm.send("printed", dest=0)
    if me == 0:
        for rank in healthy:
            comm.recv(source=rank)  # their lines are out
        # Waits until the launcher has read rank 0's own line.
        abort_mpi_job("", 3)
    time.sleep(600)


def default(comm: MPI.Comm, ping_timeout: float) -> None:
    me, _ = freeze_last_rank(comm, timeout=ping_timeout)
    rpc.shutdown()
    print(f"rank {me} shutdown returned", flush=True)


if __name__ == "__main__":
    mode, *seconds = sys.argv[1:]
    {"timed": timed, "default": default}[mode](MPI.COMM_WORLD, *map(float, seconds))
