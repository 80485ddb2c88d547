r"""The distributed autograd design note's end-to-end example, trained for a few steps.

Run with::

    mpiexec -n 2 python -m mpi4py examples/dist_autograd_simple.py [--steps N]

As in the design note, each worker creates two tensors on the other worker with
``rpc.remote(dst, random_tensor)``, fetches them with ``to_here()`` inside a distributed
autograd context, runs ``dist_autograd.backward`` on a loss built from them and trains them
with ``DistributedOptimizer(optim.SGD, [rref1, rref2, ...], lr=0.05)``. To make it a training
loop whose loss goes down, the tensors are created once (they are the parameters), every
step runs in a fresh context, and the loss is a squared error with a reachable minimum::

    loss = ((rref1.to_here() * w + rref2.to_here() - target) ** 2).sum()

where ``w`` is a local parameter (optimised through ``RRef(w)`` by the same
DistributedOptimizer) and ``target`` a fixed local tensor. Both workers do this at the same
time, each training its own problem whose remote tensors live on the other worker (worker
``r`` uses worker ``(r + 1) % world_size``). Everything is seeded, so the parameters after N
steps are the same as those of :func:`reference`, the identical math on one process with
plain ``torch.autograd`` and ``torch.optim.SGD``.

Flags: ``--steps N`` (default 30), ``--lr`` (default 0.05), ``--seed`` (default 0),
``--dump FILE`` (every rank's losses and final parameters as JSON, written by rank 0).
"""

from __future__ import annotations

import sys

import torch
from _example_utils import say, steps_parser, tensors_to_lists, write_json
from mpi4py import MPI
from torch import optim

import lightning_distgrad.autograd as dist_autograd
from lightning_distgrad import rpc
from lightning_distgrad.optim import DistributedOptimizer

STEPS, LR, SEED = 30, 0.05, 0
SHAPE = (3, 3)


def random_tensor(seed: int) -> torch.Tensor:
    """The design note's ``random_tensor``, seeded (it runs on the destination worker)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(SHAPE, generator=generator).requires_grad_()


def initial_values(rank: int, seed: int = SEED) -> dict[str, torch.Tensor]:
    """Worker ``rank``'s problem: initial ``t1``, ``t2`` (remote), ``w`` and ``target`` (local)."""
    base = 1000 * seed + 10 * rank
    generator = torch.Generator().manual_seed(base + 7)
    w = torch.rand(SHAPE, generator=generator)
    target = 2 * torch.rand(SHAPE, generator=generator)
    return {
        "t1": random_tensor(base + 1).detach(),
        "t2": random_tensor(base + 2).detach(),
        "w": w,
        "target": target,
    }


def loss_fn(
    t1: torch.Tensor, t2: torch.Tensor, w: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    return ((t1 * w + t2 - target) ** 2).sum()


def train(
    steps: int = STEPS,
    lr: float = LR,
    seed: int = SEED,
    dst: str | None = None,
    verbose: bool = True,
) -> dict:
    """Train this worker's problem; its remote tensors live on ``dst``.

    Call after ``rpc.init_rpc`` on every worker (they train at the same time). ``dst``
    defaults to the next worker, ``worker{(rank + 1) % world_size}``.

    Returns:
        dict: ``losses`` (one per step, before the update) and ``params`` (``t1``, ``t2``,
        ``w`` after the last step).
    """
    me = rpc.get_worker_info()
    rank = me.id
    if dst is None:
        dst = f"worker{(rank + 1) % MPI.COMM_WORLD.Get_size()}"
    base = 1000 * seed + 10 * rank
    init = initial_values(rank, seed)
    w = init["w"].clone().requires_grad_()
    target = init["target"]

    # Parameters on the other worker (created there by ``random_tensor``) and a local one.
    rref1 = rpc.remote(dst, random_tensor, args=(base + 1,))
    rref2 = rpc.remote(dst, random_tensor, args=(base + 2,))
    dist_optim = DistributedOptimizer(optim.SGD, [rref1, rref2, rpc.RRef(w)], lr=lr)

    losses = []
    for step in range(steps):
        with dist_autograd.context() as context_id:
            # Forward pass: fetching the remote tensors records send/recv functions.
            loss = loss_fn(rref1.to_here(), rref2.to_here(), w, target)
            # Backward pass: gradients reach the tensors on ``dst`` and ``w`` here.
            dist_autograd.backward(context_id, [loss])
            # One SGD step on every owner, with this context's gradients.
            dist_optim.step(context_id)
        losses.append(loss.item())
        if verbose:
            say(f"{me.name} step {step:3d} loss {loss.item():.6f}")

    params = {
        "t1": rref1.to_here().detach().clone(),
        "t2": rref2.to_here().detach().clone(),
        "w": w.detach().clone(),
    }
    return {"losses": losses, "params": params}


def reference(rank: int, steps: int = STEPS, lr: float = LR, seed: int = SEED) -> dict:
    """Worker ``rank``'s training on one process: plain autograd and ``torch.optim.SGD``."""
    init = initial_values(rank, seed)
    t1, t2, w = (init[k].clone().requires_grad_() for k in ("t1", "t2", "w"))
    opt = optim.SGD([t1, t2, w], lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(t1, t2, w, init["target"])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = {"t1": t1.detach().clone(), "t2": t2.detach().clone(), "w": w.detach().clone()}
    return {"losses": losses, "params": params}


def to_json(result: dict) -> dict:
    """:func:`train`'s result as JSON-serialisable lists (for ``--dump``)."""
    return {"losses": result["losses"], "params": tensors_to_lists(result["params"])}


def main(argv: list[str] | None = None) -> int:
    args = steps_parser(
        __doc__,
        STEPS,
        LR,
        SEED,
        dump_help="write every rank's losses and parameters (JSON) here",
    ).parse_args(argv)
    comm = MPI.COMM_WORLD
    if comm.Get_size() < 2:
        print(
            "run with at least 2 ranks: mpiexec -n 2 python -m mpi4py "
            "examples/dist_autograd_simple.py",
            file=sys.stderr,
        )
        return 2
    rpc.init_rpc(f"worker{comm.Get_rank()}")
    result = train(args.steps, args.lr, args.seed, verbose=not args.quiet)
    rpc.shutdown()  # waits for the other worker, which still uses our tensors
    losses = result["losses"]
    say(
        f"worker{comm.Get_rank()}: loss {losses[0]:.6f} -> {losses[-1]:.6f} "
        f"after {len(losses)} steps"
    )
    everyone = comm.gather(to_json(result), root=0)
    if args.dump and comm.Get_rank() == 0:
        write_json(args.dump, {"args": vars(args), "ranks": everyone})
    return 0


if __name__ == "__main__":
    sys.exit(main())
