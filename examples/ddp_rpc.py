r"""Distributed data parallelism combined with the RPC framework (PyTorch's DDP + RPC tutorial).

Run with (trainers on ranks 0 and 1, master on rank 2, parameter server on rank 3)::

    mpiexec -n 4 python -m mpi4py examples/ddp_rpc.py [--epochs N]

The program of the tutorial, over MPI. Four workers:

* ``ps`` (rank 3) holds the sparse part, an ``nn.EmbeddingBag`` table, and only answers RPCs;
* ``master`` (rank 2) creates the table on ``ps`` as a
  :class:`~lightning_distgrad.nn.RemoteModule` and drives the training loop on both trainers
  with ``rpc_async(trainer, _run_trainer, ...)``;
* ``trainer0`` and ``trainer1`` (ranks 0, 1) each build a :class:`HybridModel`: the remote
  embedding, then a dense ``nn.Linear(16, 8)`` replicated on both trainers. The tutorial wraps
  the dense layer in DDP; here it is a :class:`~lightning_distgrad.nn.ReplicatedModule` over the
  trainers' communicator, whose ``sync_gradients(context_id)`` (called after the backward pass,
  before the optimizer step) averages its gradients over the trainers, as DDP does.

Each trainer runs 100 epochs (``--epochs``) of 10 random batches (``get_next_batch``: bags of
random indices, random targets among 8 classes), each in a distributed autograd context:
forward, ``CrossEntropyLoss``, ``dist_autograd.backward``, ``sync_gradients``, and a
``DistributedOptimizer(optim.SGD, remote_parameters + [RRef(p) for p in fc.parameters()],
lr=0.05)`` step, which updates the dense layer on the trainer and the table on ``ps``. Since the
targets are random, the loss goes down to about ln(8) = 2.08 (the best a model can do) from the
much larger loss of the random initial table.

Reproducible: the initial parameters and each trainer's batches are seeded, and by default the
trainers step in lockstep (a barrier on their communicator after each optimizer step, so every
forward pass sees both trainers' previous updates of the table). The final parameters then
equal those of :func:`reference`, the same math on one process with plain ``torch.autograd``
and ``torch.optim.SGD`` (up to rounding). ``--no-lockstep`` runs as the tutorial does (each
trainer's table updates land whenever they land; not reproducible).

Flags: ``--epochs N`` (default 100), ``--batches-per-epoch`` (10), ``--lr`` (0.05), ``--seed``
(0), ``--no-lockstep``, ``--dump FILE`` (losses and final parameters as JSON, by the master).
"""

from __future__ import annotations

import argparse
import random
import sys

import torch
from _example_utils import polite_barrier, say, tensors_to_lists, write_json
from mpi4py import MPI
from torch import nn, optim

import lightning_distgrad.autograd as dist_autograd
from lightning_distgrad import rpc
from lightning_distgrad.nn import RemoteModule, ReplicatedModule
from lightning_distgrad.optim import DistributedOptimizer

NUM_EMBEDDINGS, EMBEDDING_DIM, NUM_CLASSES = 100, 16, 8
EPOCHS, BATCHES_PER_EPOCH, LR, SEED = 100, 10, 0.05, 0
TRAINERS, MASTER, PS = (0, 1), 2, 3
WORLD_SIZE = 4


# ---------------------------------------------------------------------------
# Model and data


class SeededEmbeddingBag(nn.EmbeddingBag):
    """``nn.EmbeddingBag`` whose initial table (N(0, 1), torch's default) is drawn from ``seed``."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, mode: str = "sum", seed: int = SEED
    ):
        super().__init__(num_embeddings, embedding_dim, mode=mode)
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            self.weight.normal_(generator=generator)


def seeded_linear(in_features: int, out_features: int, seed: int = SEED) -> nn.Linear:
    """``nn.Linear`` with torch's default initialisation drawn from ``seed``."""
    fc = nn.Linear(in_features, out_features)
    generator = torch.Generator().manual_seed(seed + 2)
    bound = 1 / in_features**0.5
    with torch.no_grad():
        fc.weight.uniform_(-bound, bound, generator=generator)
        fc.bias.uniform_(-bound, bound, generator=generator)
    return fc


def get_next_batch(rank: int, seed: int = SEED, batches: int = BATCHES_PER_EPOCH):
    """The tutorial's batch generator, seeded per trainer; call once per trainer and reuse.

    Returns a function yielding one epoch of ``batches`` ``(indices, offsets, target)``.
    """
    rng = random.Random(seed * 1000 + rank)
    generator = torch.Generator().manual_seed(seed * 1000 + 500 + rank)

    def epoch():
        for _ in range(batches):
            num_indices = rng.randint(20, 50)
            indices = torch.randint(0, NUM_EMBEDDINGS, (num_indices,), generator=generator)
            # Generate offsets.
            offsets = []
            start = 0
            batch_size = 0
            while start < num_indices:
                offsets.append(start)
                start += rng.randint(1, 10)
                batch_size += 1
            offsets_tensor = torch.LongTensor(offsets)
            target = torch.randint(0, NUM_CLASSES, (batch_size,), generator=generator)
            yield indices, offsets_tensor, target

    return epoch


class HybridModel(nn.Module):
    r"""The tutorial's model: a sparse part and a dense part.

    1) The dense part is an ``nn.Linear`` replicated on all trainers (a ReplicatedModule over
       ``trainers``, where the tutorial uses DistributedDataParallel).
    2) The sparse part is a RemoteModule holding an ``nn.EmbeddingBag`` on the parameter server.
    """

    def __init__(self, remote_emb_module: RemoteModule, trainers: MPI.Intracomm, seed: int = SEED):
        super().__init__()
        self.remote_emb_module = remote_emb_module
        self.fc = ReplicatedModule(seeded_linear(EMBEDDING_DIM, NUM_CLASSES, seed), trainers)

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        emb_lookup = self.remote_emb_module.forward(indices, offsets)
        return self.fc(emb_lookup)


# ---------------------------------------------------------------------------
# The trainers' loop (runs on trainer0 and trainer1, started by the master over RPC)

_trainers_comm: MPI.Intracomm | None = None


def _run_trainer(
    remote_emb_module: RemoteModule,
    rank: int,
    epochs: int = EPOCHS,
    batches: int = BATCHES_PER_EPOCH,
    lr: float = LR,
    seed: int = SEED,
    lockstep: bool = True,
    verbose: bool = True,
) -> dict:
    r"""Each trainer runs a forward pass which involves an embedding lookup on the parameter
    server and running ``nn.Linear`` locally. During the backward pass, distributed autograd
    propagates the gradients to the parameter server; ``sync_gradients`` then averages the
    dense part's gradients over the trainers (DDP's allreduce).

    Returns this trainer's per-step ``losses`` and the dense layer's final ``fc`` parameters.
    """
    trainers = _trainers_comm
    assert trainers is not None, "_run_trainer runs on a trainer only"
    model = HybridModel(remote_emb_module, trainers, seed)

    # Retrieve all model parameters as rrefs for DistributedOptimizer: the embedding
    # table's (on ps), and the local dense layer's. (model.parameters() would include
    # remote_emb_module.parameters(), which RemoteModule does not support.)
    model_parameter_rrefs = model.remote_emb_module.remote_parameters()
    for param in model.fc.parameters():
        model_parameter_rrefs.append(rpc.RRef(param))
    opt = DistributedOptimizer(optim.SGD, model_parameter_rrefs, lr=lr)
    criterion = nn.CrossEntropyLoss()

    next_epoch = get_next_batch(rank, seed, batches)
    losses = []
    for epoch in range(epochs):
        for indices, offsets, target in next_epoch():
            with dist_autograd.context() as context_id:
                output = model(indices, offsets)
                loss = criterion(output, target)
                # Run distributed backward pass.
                dist_autograd.backward(context_id, [loss])
                # Average the dense part's gradients over the trainers (DDP's job).
                model.fc.sync_gradients(context_id)
                # Run distributed optimizer: the table on ps, the dense layer here.
                opt.step(context_id)
                # No need to zero gradients: each iteration has its own context.
            if lockstep:
                polite_barrier(trainers)
            losses.append(loss.item())
        if verbose:
            mean = sum(losses[-batches:]) / batches
            say(f"trainer{rank} epoch {epoch:3d} mean loss {mean:.4f}")
    return {
        "losses": losses,
        "fc": {k: v.detach().clone() for k, v in model.fc.module.state_dict().items()},
    }


def run_master(
    epochs: int = EPOCHS,
    batches: int = BATCHES_PER_EPOCH,
    lr: float = LR,
    seed: int = SEED,
    lockstep: bool = True,
    verbose: bool = True,
    ps: str = "ps",
    trainer_names: tuple[str, ...] = ("trainer0", "trainer1"),
) -> dict:
    """The master's part: create the table on ``ps``, train on both trainers, collect results.

    ``ps`` and ``trainer_names`` are the workers' names (the trainers must have set their
    communicator, see :func:`run_worker`).

    Returns ``losses`` (one list per trainer), the final ``params`` (``emb.weight``,
    ``fc.weight``, ``fc.bias``) and ``fc_equal`` (the trainers' dense layers are identical).
    """
    remote_emb_module = RemoteModule(
        ps,
        SeededEmbeddingBag,
        args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
        kwargs={"mode": "sum", "seed": seed},
    )
    # Run the training loop on trainers.
    futs = []
    for trainer_rank, trainer_name in zip(TRAINERS, trainer_names, strict=True):
        # No RPC timeout: the whole training runs in this call (the default is 60 s).
        fut = rpc.rpc_async(
            trainer_name,
            _run_trainer,
            args=(remote_emb_module, trainer_rank, epochs, batches, lr, seed, lockstep, verbose),
            timeout=0,
        )
        futs.append(fut)
    # Wait for all training to finish.
    results = [fut.wait() for fut in futs]
    params = {"emb.weight": remote_emb_module.remote_state_dict()["weight"]}
    params.update({f"fc.{k}": v for k, v in results[0]["fc"].items()})
    return {
        "losses": [r["losses"] for r in results],
        "params": params,
        "fc_equal": all(
            torch.equal(results[0]["fc"][k], r["fc"][k]) for r in results for k in r["fc"]
        ),
    }


def reference(
    epochs: int = EPOCHS, batches: int = BATCHES_PER_EPOCH, lr: float = LR, seed: int = SEED
) -> dict:
    """The same training on one process, plain ``torch.autograd`` and ``torch.optim.SGD``.

    Every step: each trainer's loss and gradients at the same parameters; the dense layer's
    gradients are averaged over the trainers (ReplicatedModule / DDP), the table gets both
    trainers' gradients (each trainer's optimizer steps it on ``ps``).
    """
    emb = SeededEmbeddingBag(NUM_EMBEDDINGS, EMBEDDING_DIM, mode="sum", seed=seed)
    fc = seeded_linear(EMBEDDING_DIM, NUM_CLASSES, seed)
    criterion = nn.CrossEntropyLoss()
    params = [emb.weight, fc.weight, fc.bias]
    opt = optim.SGD(params, lr=lr)
    epochs_of = [get_next_batch(rank, seed, batches) for rank in TRAINERS]
    losses: list[list[float]] = [[] for _ in TRAINERS]
    n = len(TRAINERS)
    for _ in range(epochs):
        for step_batches in zip(*(e() for e in epochs_of), strict=True):
            grads = []
            for t, (indices, offsets, target) in enumerate(step_batches):
                loss = criterion(fc(emb(indices, offsets)), target)
                grads.append(torch.autograd.grad(loss, params))
                losses[t].append(loss.item())
            fc_grads = [sum(g[i] for g in grads) / n for i in (1, 2)]
            for g in grads:  # one table update per trainer, then the shared dense update
                emb.weight.grad = g[0]
                fc.weight.grad = fc.bias.grad = None
                opt.step()
            emb.weight.grad = None
            fc.weight.grad, fc.bias.grad = fc_grads
            opt.step()
    final = {
        "emb.weight": emb.weight.detach().clone(),
        "fc.weight": fc.weight.detach().clone(),
        "fc.bias": fc.bias.detach().clone(),
    }
    return {"losses": losses, "params": final}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--batches-per-epoch", type=int, default=BATCHES_PER_EPOCH)
    parser.add_argument("--lr", type=float, default=LR)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument(
        "--no-lockstep",
        dest="lockstep",
        action="store_false",
        help="no barrier between the trainers' steps (as the tutorial; not reproducible)",
    )
    parser.add_argument("--dump", help="write the losses and final parameters (JSON) here")
    parser.add_argument("--quiet", action="store_true", help="print only the summary")
    return parser.parse_args(argv)


def run_worker(args: argparse.Namespace) -> dict | None:
    """Initialise RPC with this rank's role, run it, shut down. The master returns results."""
    global _trainers_comm
    rank = MPI.COMM_WORLD.Get_rank()
    # The trainers' communicator (DDP's process group); a collective on every rank.
    trainers = MPI.COMM_WORLD.Split(0 if rank in TRAINERS else MPI.UNDEFINED, rank)
    result = None
    if rank == MASTER:
        rpc.init_rpc("master")
        result = run_master(
            args.epochs,
            args.batches_per_epoch,
            args.lr,
            args.seed,
            args.lockstep,
            verbose=not args.quiet,
        )
    elif rank in TRAINERS:
        _trainers_comm = trainers
        rpc.init_rpc(f"trainer{rank}")
        # Trainer just waits for RPCs from master.
    else:
        rpc.init_rpc("ps")
        # Parameter server does nothing: it only answers RPCs from the trainers and master.
    # Block until all RPCs finish.
    rpc.shutdown()
    if trainers != MPI.COMM_NULL:
        _trainers_comm = None
        trainers.Free()
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if MPI.COMM_WORLD.Get_size() != WORLD_SIZE:
        print(
            "run with 4 ranks: mpiexec -n 4 python -m mpi4py examples/ddp_rpc.py", file=sys.stderr
        )
        return 2
    result = run_worker(args)
    if result is not None:
        for t, losses in enumerate(result["losses"]):
            b = args.batches_per_epoch
            say(
                f"trainer{t}: mean loss of the first epoch {sum(losses[:b]) / b:.4f}, "
                f"of the last epoch {sum(losses[-b:]) / b:.4f} ({len(losses)} steps)"
            )
        say(f"master: dense layer identical on both trainers: {result['fc_equal']}")
        if args.dump:
            write_json(
                args.dump,
                {
                    "args": vars(args),
                    "losses": result["losses"],
                    "fc_equal": result["fc_equal"],
                    "params": tensors_to_lists(result["params"]),
                },
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
