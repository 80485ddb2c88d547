"""Overlap: a backward pass whose RPC branch runs beside a local tower, ours vs TensorPipe.

Rank 0 computes ``mlp(x) + tower(x)``: ``mlp`` (two 512-wide linear layers) runs on worker1
through an RPC, ``tower`` (four of them) locally. The gradient of the RPC's result leaves for
worker1 as soon as it is known, so worker1's backward runs while rank 0's tower does. Each
iteration is timed with both stacks started afresh each round (the order alternating); the
first and last timed gradients must match local autograd's."""

from statistics import median

import torch
from _harness import TP, Stack, parse, row, run, sample
from torch import nn

WIDTH, BATCH, TOWER = 512, 256, 4
PLAN = (60, 10)  # timed and warm-up iterations per round (quick: 1/4)
_remote_mlp: nn.Module | None = None


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))


def remote_mlp(x: torch.Tensor) -> torch.Tensor:
    """On worker1: the branch's two layers, built once."""
    global _remote_mlp
    if _remote_mlp is None:
        _remote_mlp = mlp()
    return _remote_mlp(x)


def model() -> tuple[torch.Tensor, nn.Module]:
    torch.manual_seed(1)
    tower = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(TOWER)])
    return torch.randn(BATCH, WIDTH, requires_grad=True), tower


def iteration(rpc, dist_autograd, x: torch.Tensor, tower: nn.Module) -> list[torch.Tensor]:
    """One iteration; the gradients of ``x`` and the tower's parameters."""
    with dist_autograd.context() as ctx:
        z = rpc.rpc_sync("worker1", remote_mlp, (x,)) + tower(x)
        dist_autograd.backward(ctx, [z.sum()])
        grads = dist_autograd.get_gradients(ctx)
        return [grads[t] for t in (x, *tower.parameters())]


def check(grads: list[torch.Tensor], x: torch.Tensor, tower: nn.Module, what: str) -> None:
    """The gradients against plain local autograd's on the same values."""
    leaves = [x, *tower.parameters()]
    expected = torch.autograd.grad((mlp()(x) + tower(x)).sum(), leaves)
    for got, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, e, msg=lambda m: f"{what}: {m}")


def time_stack(s: Stack, reps: int, warmup: int) -> list[float]:
    x, tower = model()
    check(iteration(s.rpc, s.autograd, x, tower), x, tower, s.kind)
    last: dict = {}
    step = lambda: last.update(grads=iteration(s.rpc, s.autograd, x, tower))  # noqa: E731
    sample(step, warmup, warmup=0)
    times = sample(step, reps, warmup=0)
    check(last["grads"], x, tower, f"{s.kind}, last timed iteration")
    return times


def measure(comm, args) -> tuple[list[dict], dict]:
    reps, warmup = (PLAN[0] // 4, PLAN[1] // 4) if args.quick else PLAN
    times: dict = {"ours": [], "tp": []}
    for r in range(1 if args.quick else 2):
        for kind in ("ours", "tp")[:: 1 if r % 2 == 0 else -1]:
            with Stack(kind, comm) as s:
                if comm.Get_rank() == 0:
                    times[kind] += time_stack(s, reps, warmup)
    if comm.Get_rank() != 0:
        return [], {}
    ours, tp = median(times["ours"]), median(times["tp"])
    return [row("iteration, RPC branch beside a local tower", ours, tp, TP, "s")], {}


if __name__ == "__main__":
    run("overlap", 2, measure, parse(__doc__))
