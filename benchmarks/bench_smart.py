"""SMART against strict (FAST-contract) backward passes, and against a local model.

Run (3 ranks: rank 0 drives, ranks 1 and 2 hold the experts)::

    mpiexec -n 3 python -m mpi4py benchmarks/bench_smart.py [--iters 300]

Measured in one run, the variants interleaved iteration by iteration (ABAB):

* ``note``: the design note's iteration (3x3 tensors, two RPCs to worker1, backward,
  get_gradients), from context enter to exit: SMART vs strict.
* ``moe-all``: a routed model of four experts (two on each of ranks 1 and 2, a 16x16
  weight each), batch of 32 tokens of width 16, top-1 routing forced to give every
  expert tokens; every expert is called with the whole batch and its routed rows are
  used. SMART vs strict vs the same model in one process with plain autograd.
* ``moe-partial``: the same model with two experts left without tokens each step
  (their RPC results unused): SMART vs the local model (strict cannot run it).

Prints per-iteration medians (microseconds) and the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from _common import quiet_barrier  # noqa: E402
from mpi4py import MPI  # noqa: E402

import lightning_distgrad.autograd as dist_autograd  # noqa: E402
from lightning_distgrad import rpc  # noqa: E402

WIDTH, TOKENS, EXPERTS = 16, 32, 4


def expert(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w)


def moe_loss(gate, ws, x, allowed, call):
    logits = (x @ gate).masked_fill(~allowed, float("-inf"))
    probs, top = logits.softmax(-1).max(-1)
    outs = [call(i, x, w) for i, w in enumerate(ws)]
    y = torch.zeros(TOKENS, WIDTH)
    for i in top.unique().tolist():
        rows = (top == i).nonzero().squeeze(1)
        y = y.index_add(0, rows, outs[i][rows] * probs[rows, None])
    return y.pow(2).sum()


def note_iteration(t1, t2, strict: bool) -> None:
    with dist_autograd.context() as ctx:
        t3 = rpc.rpc_sync("worker1", torch.add, (t1, t2))
        t4 = rpc.rpc_sync("worker1", torch.mul, (t1, t2))
        dist_autograd.backward(ctx, [(t3 * t4).sum()], strict=strict)
        dist_autograd.get_gradients(ctx)


def moe_iteration(gate, ws, x, allowed, strict: bool) -> None:
    with dist_autograd.context() as ctx:
        loss = moe_loss(
            gate, ws, x, allowed, lambda i, x, w: rpc.rpc_sync(f"worker{1 + i % 2}", expert, (x, w))
        )
        dist_autograd.backward(ctx, [loss], strict=strict)
        dist_autograd.get_gradients(ctx)


def local_iteration(gate, ws, x, allowed) -> None:
    loss = moe_loss(gate, ws, x, allowed, lambda i, x, w: expert(x, w))
    torch.autograd.grad(loss, [gate, *ws], allow_unused=True)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(iters: int) -> None:
    torch.manual_seed(0)
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    gate = torch.rand(WIDTH, EXPERTS, requires_grad=True)
    ws = [torch.rand(WIDTH, WIDTH, requires_grad=True) for _ in range(EXPERTS)]
    x = torch.rand(TOKENS, WIDTH)
    everyone = torch.ones(EXPERTS, dtype=torch.bool)
    # Forced routing for moe-all: a large bias puts a quarter of the tokens on each expert.
    x_all = x.clone()
    x_all[:, :EXPERTS] += torch.eye(EXPERTS).repeat(TOKENS // EXPERTS, 1) * 100
    gate_all = torch.zeros(WIDTH, EXPERTS)
    gate_all[:EXPERTS] = torch.eye(EXPERTS)
    gate_all.requires_grad_(True)
    half = torch.tensor([True, False, True, False])
    cases = {
        "note": {
            "smart": lambda: note_iteration(t1, t2, False),
            "strict": lambda: note_iteration(t1, t2, True),
        },
        "moe-all": {
            "smart": lambda: moe_iteration(gate_all, ws, x_all, everyone, False),
            "strict": lambda: moe_iteration(gate_all, ws, x_all, everyone, True),
            "local": lambda: local_iteration(gate_all, ws, x_all, everyone),
        },
        "moe-partial": {
            "smart": lambda: moe_iteration(gate, ws, x, half, False),
            "local": lambda: local_iteration(gate, ws, x, half),
        },
    }
    for name, variants in cases.items():
        samples: dict[str, list[float]] = {v: [] for v in variants}
        for fn in variants.values():  # warm-up
            for _ in range(20):
                fn()
        for i in range(iters):
            order = list(variants.items())
            if i % 2:
                order.reverse()
            for v, fn in order:
                samples[v].append(timed(fn))
        med = {v: statistics.median(s) for v, s in samples.items()}
        line = "  ".join(f"{v} {m * 1e6:8.1f} us" for v, m in med.items())
        ratios = []
        if "strict" in med:
            ratios.append(f"smart/strict {med['smart'] / med['strict']:.3f}")
        if "local" in med:
            ratios.append(f"smart/local {med['smart'] / med['local']:.2f}")
        print(f"{name:12s} {line}  |  {'  '.join(ratios)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 3:
        raise SystemExit("run with mpiexec -n 3")
    torch.set_num_threads(1)
    rpc.init_rpc()
    quiet_barrier(comm)
    if comm.Get_rank() == 0:
        print(f"bench_smart: {args.iters} iterations per variant, medians", flush=True)
        run(args.iters)
    quiet_barrier(comm)
    rpc.shutdown()


if __name__ == "__main__":
    main()
