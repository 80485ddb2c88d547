"""Parameter server: requests/s of 1..N-1 trainers against one server, ours vs TensorPipe.

Rank 0 holds a small model; for k = 1 .. N-1, trainers 1..k repeat a step (``rpc_sync`` the
parameters, gradients of a batch of 16, ``rpc_sync`` them back for an SGD step under a lock)
while the other ranks sleep; the figure is the median of 3 blocks. A push must change the
parameters by exactly -LR x gradients."""

import statistics
import threading

import torch
from _harness import TP, Stack, parse, row, run, sample, sleep_barrier
from torch import nn

LR = 0.01
#: Blocks of steps per number of trainers; the figure is their median (single blocks of one
#: job moved by a third on a 2-core VM shared by 8 ranks).
BLOCKS = 3
_lock = threading.Lock()
_params: list[torch.Tensor] = []  # on the server


def get_params() -> list[torch.Tensor]:
    """Runs on the server: a copy of the parameters."""
    with _lock:
        return [p.clone() for p in _params]


def push_grads(grads: list[torch.Tensor]) -> None:
    """Runs on the server: one SGD step with ``grads``."""
    with _lock:
        for p, g in zip(_params, grads, strict=True):
            p.add_(g, alpha=-LR)


def step(rpc, net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Fetch the parameters, compute gradients, push them; returns the gradients."""
    with torch.no_grad():
        for p, v in zip(net.parameters(), rpc.rpc_sync("worker0", get_params), strict=True):
            p.copy_(v)
    grads = torch.autograd.grad(nn.functional.cross_entropy(net(x), y), list(net.parameters()))
    rpc.rpc_sync("worker0", push_grads, (grads,))
    return grads


def session(kind: str, comm, steps: int, warmup: int) -> dict[int, float]:
    """Requests/s per number of trainers (on rank 0)."""
    rank, out = comm.Get_rank(), {}
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    _params[:] = [p.detach().clone() for p in net.parameters()]  # the server's copy
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
    with Stack(kind, comm) as s:
        if rank == 1:  # alone: the server's update is exactly SGD with the gradients sent
            before = s.rpc.rpc_sync("worker0", get_params)
            grads = step(s.rpc, net, x, y)
            for b, gr, a in zip(before, grads, s.rpc.rpc_sync("worker0", get_params), strict=True):
                torch.testing.assert_close(a, b - LR * gr, msg=lambda m: f"{kind}: {m}")
        for k in range(1, comm.Get_size()):
            active = 1 <= rank <= k
            rates = []
            for _ in range(BLOCKS):
                sleep_barrier(comm)
                for _ in range(warmup if active else 0):
                    step(s.rpc, net, x, y)
                comm.Barrier()
                times = sample(lambda: step(s.rpc, net, x, y), steps, warmup=0) if active else [0.0]
                sleep_barrier(comm)  # the server's main thread must not spin while its agent works
                elapsed = comm.gather(sum(times), root=0)
                rates.append(2 * k * steps / max(elapsed) if rank == 0 else 0.0)
            out[k] = statistics.median(rates) if rank == 0 else None
    return out


def measure(comm, args) -> tuple[list[dict] | None, dict]:
    steps, warmup = (20, 3) if args.quick else (200, 20)
    ours, tp = (session(kind, comm, steps, warmup) for kind in ("ours", "tp"))
    rows = [row(f"{k} trainer(s), requests/s", ours[k], tp[k], TP, "req/s") for k in ours]
    return rows, {"requests_per_s": {"ours": ours, "tp": tp}}


if __name__ == "__main__":
    run("param_server", None, measure, parse(__doc__))
