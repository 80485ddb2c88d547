"""The distributed autograd design note's iteration: ours vs TensorPipe, per iteration.

Rank 0 times ``iteration`` at 3x3 and 1024x1024, both stacks started afresh each round (the
order alternating); its first and last timed gradients must match local autograd's.
``--jobs K``: the median of K jobs' medians and the spread (slowest job over fastest)."""

from statistics import median

import torch
from _harness import TP, Stack, drive, parse, row, run, sample

TARGETS = {3: None, 1024: ("<=", 0.7)}  # on ours / TensorPipe
SPREAD_TARGET = 1.5  # slowest / fastest job median at 1024x1024
PLAN = {3: (800, 80), 1024: (50, 5)}  # timed and warm-up iterations per round (quick: 1/8, 1/4)


def inputs(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234 + n)
    return [torch.rand((n, n), generator=g).requires_grad_() for _ in range(2)]


def iteration(rpc, dist_autograd, t1: torch.Tensor, t2: torch.Tensor, **backward) -> dict:
    """One iteration of the note; its gradients. ``backward``: options of ``backward``."""
    with dist_autograd.context() as ctx:
        t3 = rpc.rpc_sync("worker1", torch.add, (t1, t2))
        t4 = rpc.rpc_sync("worker1", torch.mul, (t1, t2))
        dist_autograd.backward(ctx, [(t3 * t4).sum()], **backward)
        return dist_autograd.get_gradients(ctx)


def check(grads: dict, t1: torch.Tensor, t2: torch.Tensor, what: str) -> None:
    """The note's gradients against plain local autograd's on the same values."""
    a, b = t1.detach().requires_grad_(), t2.detach().requires_grad_()
    expected = torch.autograd.grad(((a + b) * (a * b)).sum(), [a, b])
    if len(grads) != 2:
        raise AssertionError(f"{what}: {len(grads)} gradients, expected those of t1 and t2")
    for t, e in zip((t1, t2), expected, strict=True):
        torch.testing.assert_close(grads[t], e, msg=lambda m: f"{what}: {m}")


def time_size(s: Stack, n: int, reps: int, warmup: int) -> list[float]:
    """Rank 0: ``reps`` timed iterations at ``n`` x ``n``, their gradients checked."""
    t1, t2 = inputs(n)
    check(iteration(s.rpc, s.autograd, t1, t2), t1, t2, f"{s.kind} {n}x{n}")
    last: dict = {}
    step = lambda: last.update(grads=iteration(s.rpc, s.autograd, t1, t2))  # noqa: E731
    sample(step, warmup, warmup=0, min_s=0.3)  # a waking agent runs slower for a while
    times = sample(step, reps, warmup=0)
    check(last["grads"], t1, t2, f"{s.kind} {n}x{n}, last timed iteration")
    return times


def measure(comm, args) -> tuple[list[dict] | None, dict]:
    """One MPI job: each stack's median iteration per size."""
    plan = {n: (r // 8, w // 4) for n, (r, w) in PLAN.items()} if args.quick else PLAN
    times: dict = {"ours": {n: [] for n in plan}, "tp": {n: [] for n in plan}}
    for r in range(1 if args.quick else 2):
        for kind in ("ours", "tp")[:: 1 if r % 2 == 0 else -1]:
            with Stack(kind, comm) as s:
                for n, (reps, warmup) in plan.items() if comm.Get_rank() == 0 else ():
                    times[kind][n] += time_size(s, n, reps, warmup)
    medians = {k: {n: median(v) for n, v in d.items() if v} for k, d in times.items()}
    ours, tp = medians["ours"], medians["tp"]
    rows = [row(f"iteration {n}x{n}", ours[n], tp[n], TP, "s", TARGETS[n]) for n in ours]
    return rows, {"medians": medians}


def combine(docs: list[dict]) -> tuple[list[dict], dict]:
    """The median and spread of the jobs' medians."""
    rows, k = [], len(docs)
    for n in docs[0]["medians"]["ours"]:
        ours, tp = ([d["medians"][stack][n] for d in docs] for stack in ("ours", "tp"))
        name, target = f"iteration {n}x{n}", TARGETS[int(n)]
        spread = ("<=", SPREAD_TARGET) if n == "1024" else None
        lo, hi = min(ours), max(ours)
        rows.append(row(f"{name}, median of {k} jobs", median(ours), median(tp), TP, "s", target))
        rows.append(row(f"{name}, slowest job (ours)", hi, lo, "fastest", "s", spread))
    return rows, {"jobs": k, "job_medians": [d["medians"] for d in docs]}


if __name__ == "__main__":
    args = parse(__doc__, jobs={"type": int, "help": "run K jobs, report their median"})
    jobs = {str(j): 2 for j in range(args.jobs or 0)}
    drive("design_note", args, jobs, combine) if jobs else run("design_note", 2, measure, args)
