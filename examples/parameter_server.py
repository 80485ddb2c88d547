r"""Trainers and a parameter server: the model's layers live on the server as RemoteModules.

Run with (ranks 0 and 1 train, rank 2 is the parameter server)::

    mpiexec -n 3 python -m mpi4py examples/parameter_server.py [--steps N]

Any number of ranks >= 2 works: the last rank is the parameter server ``ps``, the others
are trainers ``trainer0``, ``trainer1``, ... The model is a two-layer regression network
whose two ``nn.Linear`` layers live on the server; a trainer holds only
:class:`~lightning_distgrad.nn.RemoteModule` handles to them (fetched from the server, as
in torch's parameter-server tutorial) and applies the ``tanh`` in between locally::

    out = layer2(tanh(layer1(x)))          # layer1 and layer2 run on ps

Each trainer draws its own synthetic batches (inputs ~ N(0, 1), targets from a fixed random
"teacher" network), and every step runs a forward pass in a distributed autograd context,
``dist_autograd.backward`` on the MSE loss (gradients flow back to the server's layers) and
``DistributedOptimizer.step`` (SGD on the server). The trainers step in lockstep: a barrier
on the trainers' communicator before the optimizer step (so no layer changes while another
trainer's backward pass still needs its saved weights) and one after it (so every forward
pass sees all updates of the previous step). The server thus applies, at every step, each
trainer's SGD update once, and the parameters after N steps are those of :func:`reference`,
the same math on one process with plain ``torch.autograd`` and ``torch.optim.SGD`` (up to
the rounding of the order in which the server applies the trainers' updates).

Flags: ``--steps N`` (default 60), ``--lr`` (default 0.05), ``--seed`` (default 0),
``--dump FILE`` (losses of every trainer and the final parameters, JSON, written by
trainer 0).
"""

from __future__ import annotations

import sys
import threading

import torch
from _example_utils import polite_barrier, say, steps_parser, tensors_to_lists, write_json
from mpi4py import MPI
from torch import nn, optim

import lightning_distgrad.autograd as dist_autograd
from lightning_distgrad import rpc
from lightning_distgrad.nn import RemoteModule
from lightning_distgrad.optim import DistributedOptimizer

IN, HIDDEN, OUT, BATCH = 10, 32, 2, 32
STEPS, LR, SEED = 60, 0.05, 0
PRINT_EVERY = 10


class SeededLinear(nn.Linear):
    """``nn.Linear`` with torch's default initialisation drawn from a seeded generator."""

    def __init__(self, in_features: int, out_features: int, seed: int):
        super().__init__(in_features, out_features)
        generator = torch.Generator().manual_seed(seed)
        bound = 1 / in_features**0.5
        with torch.no_grad():
            self.weight.uniform_(-bound, bound, generator=generator)
            self.bias.uniform_(-bound, bound, generator=generator)


def make_layers(seed: int = SEED) -> list[nn.Module]:
    return [SeededLinear(IN, HIDDEN, seed + 1), SeededLinear(HIDDEN, OUT, seed + 2)]


class Teacher:
    """The fixed random network that produces the targets."""

    def __init__(self, seed: int = SEED):
        generator = torch.Generator().manual_seed(seed + 100)
        self.w1 = torch.randn(IN, HIDDEN, generator=generator) / IN**0.5
        self.w2 = torch.randn(HIDDEN, OUT, generator=generator) / HIDDEN**0.5

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w1) @ self.w2


def batches(trainer: int, seed: int = SEED):
    """Trainer ``trainer``'s endless stream of ``(x, y)`` batches."""
    teacher = Teacher(seed)
    generator = torch.Generator().manual_seed(seed * 1000 + 200 + trainer)
    while True:
        x = torch.randn(BATCH, IN, generator=generator)
        yield x, teacher(x)


class Net(nn.Module):
    """The trainer's view of the model: both layers are on the parameter server."""

    def __init__(self, layer1: nn.Module, layer2: nn.Module):
        super().__init__()
        self.layer1, self.layer2 = layer1, layer2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(torch.tanh(self.layer1(x)))


# ---------------------------------------------------------------------------
# On the parameter server

_layers: dict[int, list[nn.Module]] = {}
_layers_lock = threading.Lock()


def get_layer_rrefs(seed: int) -> list[rpc.RRef]:
    """RRefs to the server's layers, created by the first trainer that asks (runs on ps)."""
    with _layers_lock:
        if seed not in _layers:
            _layers[seed] = make_layers(seed)
        return [rpc.RRef(layer) for layer in _layers[seed]]


# ---------------------------------------------------------------------------
# On a trainer


def train(
    trainers: MPI.Intracomm,
    steps: int = STEPS,
    lr: float = LR,
    seed: int = SEED,
    ps: str = "ps",
    verbose: bool = True,
) -> dict:
    """Run trainer ``trainers.Get_rank()``'s loop; every trainer calls it (after ``init_rpc``).

    Args:
        trainers: the trainers' communicator (the server is not in it).
        ps: the parameter server's worker name.

    Returns:
        dict: this trainer's ``losses`` (one per step, before the update) and, on every
        trainer, the server's final ``params`` (``layer1.weight``, ... as tensors).
    """
    me = trainers.Get_rank()
    rrefs = rpc.rpc_sync(ps, get_layer_rrefs, args=(seed,))
    layers = [RemoteModule.init_from_module_rref(ps, rref) for rref in rrefs]
    model = Net(*layers)
    opt = DistributedOptimizer(
        optim.SGD, [p for layer in layers for p in layer.remote_parameters()], lr=lr
    )
    data = batches(me, seed)

    losses = []
    for step in range(steps):
        x, y = next(data)
        with dist_autograd.context() as context_id:
            loss = nn.functional.mse_loss(model(x), y)
            dist_autograd.backward(context_id, [loss])
            polite_barrier(trainers)  # every trainer's backward pass is done
            opt.step(context_id)
        polite_barrier(trainers)  # every trainer's update is applied
        losses.append(loss.item())
        if verbose and (step % PRINT_EVERY == 0 or step == steps - 1):
            say(f"trainer{me} step {step:4d} loss {loss.item():.6f}")

    params = {}
    for i, layer in enumerate(layers, start=1):
        for name, value in layer.remote_state_dict().items():
            params[f"layer{i}.{name}"] = value
    return {"losses": losses, "params": params}


def reference(num_trainers: int, steps: int = STEPS, lr: float = LR, seed: int = SEED) -> dict:
    """The same training on one process: every trainer's gradient at the same parameters,
    then one ``torch.optim.SGD`` step per trainer (in trainer order)."""
    layers = make_layers(seed)
    model = nn.Sequential(layers[0], nn.Tanh(), layers[1])
    params = list(model.parameters())
    opt = optim.SGD(params, lr=lr)
    streams = [batches(t, seed) for t in range(num_trainers)]
    losses: list[list[float]] = [[] for _ in range(num_trainers)]
    for _ in range(steps):
        grads = []
        for t, stream in enumerate(streams):
            x, y = next(stream)
            loss = nn.functional.mse_loss(model(x), y)
            grads.append(torch.autograd.grad(loss, params))
            losses[t].append(loss.item())
        for g in grads:
            for p, gp in zip(params, g, strict=True):
                p.grad = gp
            opt.step()
    final = {}
    for i, layer in enumerate(layers, start=1):
        for name, value in layer.state_dict().items():
            final[f"layer{i}.{name}"] = value.clone()
    return {"losses": losses, "params": final}


def main(argv: list[str] | None = None) -> int:
    args = steps_parser(
        __doc__,
        STEPS,
        LR,
        SEED,
        dump_help="write the losses and final parameters (JSON) here",
    ).parse_args(argv)
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if size < 2:
        print(
            "run with at least 2 ranks: mpiexec -n 3 python -m mpi4py examples/parameter_server.py",
            file=sys.stderr,
        )
        return 2
    is_trainer = rank < size - 1
    trainers = world.Split(0 if is_trainer else MPI.UNDEFINED, rank)
    rpc.init_rpc(f"trainer{rank}" if is_trainer else "ps")
    if is_trainer:
        result = train(trainers, args.steps, args.lr, args.seed, verbose=not args.quiet)
        losses = result["losses"]
        say(f"trainer{rank}: loss {losses[0]:.6f} -> {losses[-1]:.6f} after {len(losses)} steps")
        all_losses = trainers.gather(losses, root=0)
        if args.dump and rank == 0:
            write_json(
                args.dump,
                {
                    "args": vars(args),
                    "losses": all_losses,
                    "params": tensors_to_lists(result["params"]),
                },
            )
        trainers.Free()
    # The server only answers RPCs; shutdown returns once every rank is done.
    rpc.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
