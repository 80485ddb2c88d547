"""Sparse gradients: a sparse COO tensor that requires grad, through an RPC and back, ours
vs TensorPipe.

Rank 0 sends a sparse 2^20 x 1024 tensor ``s`` (requiring grad) to worker1, which returns
``s * 2`` (sparse, requiring grad); rank 0 differentiates ``torch.sparse.sum`` of it. The
backward pass ships the sparse gradient of the result to worker1 and the sparse gradient of
``s`` back into rank 0's context: four sparse tensors cross per iteration, compute is a
scan of their values. Each iteration is timed with both stacks started afresh each round
(the order alternating), at two sizes; the first and last timed gradients must match local
autograd's."""

from statistics import median

import torch
from _harness import TP, Stack, parse, row, run, sample

ROWS, COLS = 1 << 20, 1024
# Nonzeros of ``s`` (384 KiB and 24 MiB of indices and values), with the timed and warm-up
# iterations per round (quick: 1/4, at least 1).
PLAN = {1 << 14: (40, 5), 1 << 20: (12, 2)}


def forward(s: torch.Tensor) -> torch.Tensor:
    """On worker1 (and locally, for the check)."""
    return s * 2.0


def sparse_input(nnz: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(nnz)
    indices = torch.stack(
        [torch.randint(0, ROWS, (nnz,), generator=g), torch.randint(0, COLS, (nnz,), generator=g)]
    )
    values = torch.randn(nnz, generator=g)
    s = torch.sparse_coo_tensor(indices, values, (ROWS, COLS), check_invariants=False)
    return s.coalesce().requires_grad_()


def iteration(rpc, dist_autograd, s: torch.Tensor) -> torch.Tensor:
    """One iteration; the (sparse) gradient of ``s``."""
    with dist_autograd.context() as ctx:
        y = rpc.rpc_sync("worker1", forward, (s,))
        dist_autograd.backward(ctx, [torch.sparse.sum(y)])
        return dist_autograd.get_gradients(ctx)[s]


def check(grad: torch.Tensor, s: torch.Tensor, what: str) -> None:
    """The gradient against plain local autograd's on the same values."""
    (expected,) = torch.autograd.grad(torch.sparse.sum(forward(s)), [s])
    assert grad.is_sparse, f"{what}: the gradient of a sparse argument must be sparse"
    torch.testing.assert_close(grad.coalesce(), expected.coalesce(), msg=lambda m: f"{what}: {m}")


def time_stack(s: Stack, nnz: int, reps: int, warmup: int) -> list[float]:
    x = sparse_input(nnz)
    check(iteration(s.rpc, s.autograd, x), x, s.kind)
    last: dict = {}
    step = lambda: last.update(grad=iteration(s.rpc, s.autograd, x))  # noqa: E731
    sample(step, warmup, warmup=0)
    times = sample(step, reps, warmup=0)
    check(last["grad"], x, f"{s.kind}, last timed iteration")
    return times


def measure(comm, args) -> tuple[list[dict], dict]:
    times: dict = {(kind, nnz): [] for kind in ("ours", "tp") for nnz in PLAN}
    for r in range(1 if args.quick else 2):
        for kind in ("ours", "tp")[:: 1 if r % 2 == 0 else -1]:
            with Stack(kind, comm) as s:
                if comm.Get_rank() != 0:
                    continue
                for nnz, (reps, warmup) in PLAN.items():
                    if args.quick:
                        reps, warmup = max(1, reps // 4), max(1, warmup // 4)
                    times[(kind, nnz)] += time_stack(s, nnz, reps, warmup)
    if comm.Get_rank() != 0:
        return [], {}
    rows = []
    for nnz in PLAN:
        ours, tp = median(times[("ours", nnz)]), median(times[("tp", nnz)])
        metric = f"iteration, sparse argument and result of {nnz} nonzeros, their gradients"
        rows.append(row(metric, ours, tp, TP, "s"))
    return rows, {}


if __name__ == "__main__":
    run("sparse_grad", 2, measure, parse(__doc__))
