"""Local layers over an RPC result: the root's iteration and backward, ours vs TensorPipe.

Rank 0 computes ``mlp(rpc_sync("worker1", torch.add, (x, x))).sum()`` for MLPs of linear
layers and ``Tanh`` (``SHAPES``), and runs the distributed backward pass: the root's own pass
walks every local layer, while the callee runs one operator. Each figure is a median over
rounds; a round starts each stack once for every shape (the order alternating). The backward's
second anchor is plain local autograd on the same values. The last gradients of each stack
must match local autograd's."""

import time
from statistics import median

import torch
from _harness import TP, Stack, parse, row, run, sample
from torch import nn

#: (layers, width) of the MLPs: deep and narrow (Python per node shows), shallow and wide.
SHAPES = ((4, 16), (32, 16), (8, 256))
BATCH = 8
PLAN = (300, 30)  # timed and warm-up iterations per round (quick: 1/10)


def model(layers: int, width: int) -> tuple[torch.Tensor, nn.Module]:
    torch.manual_seed(0)
    mlp = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())])
    return torch.randn(BATCH, width, requires_grad=True), mlp


def time_stack(s: Stack, layers: int, width: int, reps: int, warmup: int) -> dict[str, list]:
    """Seconds per iteration and per backward call of one stack; checks the last gradients."""
    x, mlp = model(layers, width)
    leaves = [x, *mlp.parameters()]
    out: dict = {"iteration": [], "backward": []}
    last: dict = {}

    def iteration() -> None:
        with s.autograd.context() as ctx:
            start = time.perf_counter()
            loss = mlp(s.rpc.rpc_sync("worker1", torch.add, (x, x))).sum()
            began = time.perf_counter()
            s.autograd.backward(ctx, [loss])
            grads = s.autograd.get_gradients(ctx)
            end = time.perf_counter()
        out["iteration"].append(end - start)
        out["backward"].append(end - began)
        last["grads"] = [grads[t] for t in leaves]

    sample(iteration, warmup, warmup=0)
    for kept in out.values():
        kept.clear()
    sample(iteration, reps, warmup=0)
    expected = torch.autograd.grad(mlp(torch.add(x, x)).sum(), leaves)
    for got, e in zip(last["grads"], expected, strict=True):
        torch.testing.assert_close(got, e, msg=lambda m: f"{s.kind}: {m}")
    return out


def local_backward(layers: int, width: int, reps: int) -> list[float]:
    """Seconds per ``loss.backward()`` of the same model in plain local autograd."""
    x, mlp = model(layers, width)
    times = []

    def step() -> None:
        loss = mlp(torch.add(x, x)).sum()
        start = time.perf_counter()
        loss.backward()
        times.append(time.perf_counter() - start)

    sample(step, reps, warmup=0)
    return times


def measure(comm, args) -> tuple[list[dict], dict]:
    reps, warmup = (PLAN[0] // 10, PLAN[1] // 10) if args.quick else PLAN
    shapes = SHAPES if comm.Get_rank() == 0 else ()
    times = {
        (kind, shape): {"iteration": [], "backward": []}
        for kind in ("ours", "tp")
        for shape in shapes
    }
    local: dict = {shape: [] for shape in shapes}
    for r in range(1 if args.quick else 2):
        for kind in ("ours", "tp")[:: 1 if r % 2 == 0 else -1]:
            with Stack(kind, comm) as s:
                for shape in shapes:
                    for what, t in time_stack(s, *shape, reps, warmup).items():
                        times[kind, shape][what] += t
        for shape in shapes:
            local[shape] += local_backward(*shape, reps)
    rows = []
    for layers, width in shapes:
        ours, tp = times["ours", (layers, width)], times["tp", (layers, width)]
        name = f"{layers} x Linear({width}) over an RPC result"
        it = (median(ours["iteration"]), median(tp["iteration"]))
        rows.append(row(f"{name}, iteration", *it, TP, "s"))
        back = (median(ours["backward"]), median(local[layers, width]))
        rows.append(row(f"{name}, backward", *back, "local autograd", "s"))
    return rows, {}


if __name__ == "__main__":
    run("local_layers", 2, measure, parse(__doc__))
