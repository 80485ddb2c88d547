r"""Distributed data parallelism combined with the RPC framework (PyTorch's DDP + RPC tutorial).

Run with (trainers on ranks 0 and 1, master on rank 2, parameter server on rank 3)::

    mpiexec -n 4 python -m mpi4py examples/ddp_rpc.py [--epochs N] [--replicated-module]

The program of the tutorial, over MPI. Four workers:

* ``ps`` (rank 3) holds the sparse part, an ``nn.EmbeddingBag`` table, and only answers RPCs;
* ``master`` (rank 2) creates the table on ``ps`` as a
  :class:`~lightning_distgrad.nn.RemoteModule` and drives the training loop on both trainers
  with ``rpc_async(trainer, _run_trainer, ...)``;
* ``trainer0`` and ``trainer1`` (ranks 0, 1) each build a :class:`HybridModel`: the remote
  embedding, then a dense ``nn.Linear(16, 8)`` replicated on both trainers, wrapped in torch's
  ``DistributedDataParallel`` over a gloo process group of the two trainers, as in the
  tutorial: DDP averages its gradients over the trainers, in the distributed autograd context,
  during the backward pass. ``--replicated-module`` wraps it in a
  :class:`~lightning_distgrad.nn.ReplicatedModule` over the trainers' MPI communicator instead
  (no process group), whose ``sync_gradients(context_id)``, called after the backward pass and
  before the optimizer step, averages the same gradients.

Each trainer runs 100 epochs (``--epochs``) of 10 random batches (``get_next_batch``: bags of
random indices, random targets among 8 classes), each in a distributed autograd context:
forward, ``CrossEntropyLoss``, ``dist_autograd.backward`` and a
``DistributedOptimizer(optim.SGD, remote_parameters + [RRef(p) for p in fc.parameters()],
lr=0.05)`` step, which updates the dense layer on the trainer and the table on ``ps``. Since the
targets are random, the loss goes down to about ln(8) = 2.08 (the best a model can do) from the
much larger loss of the random initial table.

Reproducible: the initial parameters and each trainer's batches are seeded, and by default the
trainers step in lockstep (a barrier on their communicator after each optimizer step, so every
forward pass sees both trainers' previous updates of the table; the trainers also compare their
dense layers there). The final parameters then equal those of :func:`reference`, the same math on
one process with plain ``torch.autograd`` and ``torch.optim.SGD`` (up to rounding).
``--no-lockstep`` runs as the tutorial does (each trainer's table updates land whenever they
land; not reproducible).

Flags: ``--epochs N`` (default 100), ``--batches-per-epoch`` (10), ``--lr`` (0.05), ``--seed``
(0), ``--no-lockstep``, ``--replicated-module``, ``--dump FILE`` (losses and final parameters as
JSON, by the master).
"""

from __future__ import annotations

import argparse
import random
import socket
import sys

import torch
import torch.distributed as dist
from _example_utils import polite_barrier, say, tensors_to_lists, write_json
from mpi4py import MPI
from torch import nn, optim
from torch.nn.parallel import DistributedDataParallel as DDP

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

    1) The dense part is an ``nn.Linear`` replicated on all trainers, wrapped in
       DistributedDataParallel over ``process_group`` (None: the default group), or, with
       ``replicated_module=True``, in a ReplicatedModule over the MPI communicator ``trainers``.
    2) The sparse part is a RemoteModule holding an ``nn.EmbeddingBag`` on the parameter server.
    """

    def __init__(
        self,
        remote_emb_module: RemoteModule,
        trainers: MPI.Intracomm,
        seed: int = SEED,
        replicated_module: bool = False,
        process_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        self.remote_emb_module = remote_emb_module
        fc = seeded_linear(EMBEDDING_DIM, NUM_CLASSES, seed)
        if replicated_module:
            self.fc = ReplicatedModule(fc, trainers)
        else:
            self.fc = DDP(fc, process_group=process_group)

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        emb_lookup = self.remote_emb_module.forward(indices, offsets)
        return self.fc(emb_lookup)


# ---------------------------------------------------------------------------
# The trainers' loop (runs on trainer0 and trainer1, started by the master over RPC)

# The trainers' MPI communicator and DDP's process group (None: the default group); set on
# the trainers before the master starts them.
_trainers_comm: MPI.Intracomm | None = None
_ddp_group: dist.ProcessGroup | None = None


def replicas_equal(trainers: MPI.Intracomm, module: nn.Module) -> bool:
    """Whether every trainer's ``module`` holds exactly the same parameters (a collective)."""
    mine = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    return all(torch.equal(mine, theirs) for theirs in trainers.allgather(mine))


def _run_trainer(
    remote_emb_module: RemoteModule,
    rank: int,
    epochs: int = EPOCHS,
    batches: int = BATCHES_PER_EPOCH,
    lr: float = LR,
    seed: int = SEED,
    lockstep: bool = True,
    verbose: bool = True,
    replicated_module: bool = False,
) -> dict:
    r"""Each trainer runs a forward pass which involves an embedding lookup on the parameter
    server and running ``nn.Linear`` locally. During the backward pass, DDP averages the dense
    part's gradients over the trainers, and distributed autograd propagates the gradients to the
    parameter server (with ``replicated_module``, ``sync_gradients`` averages them after it).

    Returns this trainer's per-step ``losses``, whether the trainers' dense layers were equal
    after each step (``equal_each_step``, in lockstep only) and its final ``fc`` parameters.
    """
    trainers = _trainers_comm
    assert trainers is not None, "_run_trainer runs on a trainer only"
    model = HybridModel(remote_emb_module, trainers, seed, replicated_module, _ddp_group)

    # Retrieve all model parameters as rrefs for DistributedOptimizer: the embedding
    # table's (on ps), and the local dense layer's. (model.parameters() would include
    # remote_emb_module.parameters(), which RemoteModule does not support.)
    model_parameter_rrefs = model.remote_emb_module.remote_parameters()
    for param in model.fc.parameters():
        model_parameter_rrefs.append(rpc.RRef(param))
    opt = DistributedOptimizer(optim.SGD, model_parameter_rrefs, lr=lr)
    criterion = nn.CrossEntropyLoss()

    next_epoch = get_next_batch(rank, seed, batches)
    losses, equal_each_step = [], []
    for epoch in range(epochs):
        for indices, offsets, target in next_epoch():
            with dist_autograd.context() as context_id:
                output = model(indices, offsets)
                loss = criterion(output, target)
                # Run distributed backward pass.
                dist_autograd.backward(context_id, [loss])
                if replicated_module:  # average the dense part's gradients (DDP did it above)
                    model.fc.sync_gradients(context_id)
                # Run distributed optimizer: the table on ps, the dense layer here.
                opt.step(context_id)
                # No need to zero gradients: each iteration has its own context.
            if lockstep:
                polite_barrier(trainers)
                equal_each_step.append(replicas_equal(trainers, model.fc))
            losses.append(loss.item())
        if verbose:
            mean = sum(losses[-batches:]) / batches
            say(f"trainer{rank} epoch {epoch:3d} mean loss {mean:.4f}")
    return {
        "losses": losses,
        "equal_each_step": equal_each_step,
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
    replicated_module: bool = False,
) -> dict:
    """The master's part: create the table on ``ps``, train on both trainers, collect results.

    ``ps`` and ``trainer_names`` are the workers' names (the trainers must have set their
    communicator and, for DDP, their process group, see :func:`run_worker`).

    Returns ``losses`` (one list per trainer), the final ``params`` (``emb.weight``,
    ``fc.weight``, ``fc.bias``), ``fc_equal`` (the trainers' dense layers are identical at the
    end) and ``equal_each_step`` (they were after each step; empty without lockstep).
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
            args=(
                remote_emb_module,
                trainer_rank,
                epochs,
                batches,
                lr,
                seed,
                lockstep,
                verbose,
                replicated_module,
            ),
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
        "equal_each_step": results[0]["equal_each_step"],
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
    parser.add_argument(
        "--replicated-module",
        action="store_true",
        help="replicate the dense layer with lightning_distgrad.nn.ReplicatedModule, not DDP",
    )
    parser.add_argument("--dump", help="write the losses and final parameters (JSON) here")
    parser.add_argument("--quiet", action="store_true", help="print only the summary")
    return parser.parse_args(argv)


def trainers_tcp_store(trainers: MPI.Intracomm) -> dist.TCPStore:
    """The rendezvous of the trainers' process group: a TCPStore on the first trainer's host,
    on a port the OS picks, whose address the others learn over MPI (the tutorial's
    ``init_method="tcp://localhost:29500"`` works too, on one node and a free port)."""
    size = trainers.Get_size()
    if trainers.Get_rank() == 0:
        store = dist.TCPStore(socket.gethostname(), 0, size, is_master=True, wait_for_workers=False)
        trainers.bcast((socket.gethostname(), store.port), root=0)
        return store
    host, port = trainers.bcast(None, root=0)
    return dist.TCPStore(host, port, size, is_master=False)


def run_worker(args: argparse.Namespace) -> dict | None:
    """Initialise RPC with this rank's role, run it, shut down. The master returns results."""
    global _trainers_comm
    rank = MPI.COMM_WORLD.Get_rank()
    # The trainers' communicator; a collective on every rank.
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
            replicated_module=args.replicated_module,
        )
    elif rank in TRAINERS:
        _trainers_comm = trainers
        if not args.replicated_module:
            # Initialize process group for Distributed DataParallel on trainers.
            store = trainers_tcp_store(trainers)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=len(TRAINERS))
        rpc.init_rpc(f"trainer{rank}")
        # Trainer just waits for RPCs from master.
    else:
        rpc.init_rpc("ps")
        # Parameter server does nothing: it only answers RPCs from the trainers and master.
    # Block until all RPCs finish.
    rpc.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
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
        if args.lockstep:
            say(f"master: identical after every step: {all(result['equal_each_step'])}")
        if args.dump:
            write_json(
                args.dump,
                {
                    "args": vars(args),
                    "losses": result["losses"],
                    "fc_equal": result["fc_equal"],
                    "equal_each_step": result["equal_each_step"],
                    "params": tensors_to_lists(result["params"]),
                },
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
