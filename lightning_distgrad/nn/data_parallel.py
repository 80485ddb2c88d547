"""``ReplicatedModule``: data parallelism for the replicated part of a hybrid model.

In a hybrid model (seed: an ``EmbeddingBag`` on a parameter server reached
through a :class:`~lightning_distgrad.nn.RemoteModule`, a dense layer
replicated on every trainer) the gradients of the replicated layer land in
the distributed autograd context, not in ``.grad``. torch's
``DistributedDataParallel`` averages them there, over a ``torch.distributed``
process group; :class:`ReplicatedModule` does the same over an MPI
communicator, with no process group to set up:

* at construction it checks that every trainer wraps the same architecture and
  broadcasts the parameters and buffers of the first trainer;
* :meth:`ReplicatedModule.sync_gradients` replaces, after ``backward`` and
  before ``DistributedOptimizer.step``, this trainer's gradients *in the
  context* by their mean over the trainers (one non-blocking allreduce per
  bucket of parameters of one dtype, all in flight at once).

Every trainer then applies the same mean gradient to the same parameters, so
the replicas stay bit-identical.

Why an explicit call rather than backward hooks: the hooks of a distributed
pass run on whichever thread receives the gradients, do not know their
context, and may run in a different order on different trainers, while MPI
collectives must be issued in the same order everywhere. A hook can also not
return a gradient whose allreduce has not finished yet. One call after the
backward pass is simple, deterministic, and costs one allreduce per bucket.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from .. import autograd as dist_autograd
from .. import rpc
from .._backoff import wait_all

__all__ = ["ReplicatedModule"]

#: Parameters are reduced in buckets of at most this many bytes (one allreduce each).
DEFAULT_BUCKET_CAP_MB = 25.0
#: Byte offsets of tensors packed for a broadcast are aligned to this.
_ALIGN = 16
#: Dtypes reduced in float32 (MPI has no portable 16-bit float type).
_UPCAST = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


# ---------------------------------------------------------------------------
# MPI helpers


def _as_buffer(t: torch.Tensor) -> np.ndarray:
    return t.numpy()


def _pack_bytes(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """All of ``tensors``' bytes in one aligned uint8 buffer, and their offsets."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    flat = torch.zeros(total, dtype=torch.uint8)
    for t, off in zip(tensors, offsets, strict=True):
        n = t.numel() * t.element_size()
        flat[off : off + n] = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return flat, offsets


def _unpack_bytes(flat: torch.Tensor, offsets: list[int], tensors: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for t, off in zip(tensors, offsets, strict=True):
            n = t.numel() * t.element_size()
            t.copy_(flat[off : off + n].view(t.dtype).view(t.shape))


def _broadcast(comm: MPI.Intracomm, tensors: list[torch.Tensor], root: int) -> None:
    """Overwrite ``tensors`` with the root's values (one broadcast)."""
    if not tensors:
        return
    flat, offsets = _pack_bytes(tensors)
    wait_all(comm.Ibcast([_as_buffer(flat), MPI.BYTE], root))
    if comm.Get_rank() != root:
        _unpack_bytes(flat, offsets, tensors)


def _signature(module: nn.Module) -> list[tuple[str, str, tuple[int, ...], str]]:
    return [
        ("parameter", n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()
    ] + [("buffer", n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()]


def _check_same_structure(comm: MPI.Intracomm, module: nn.Module) -> None:
    """Raise the same ValueError on every rank unless all ranks wrap the same architecture."""
    signature = _signature(module)
    digest = np.frombuffer(hashlib.sha256(repr(signature).encode()).digest(), dtype=np.uint8)
    everyone = np.empty((comm.Get_size(), digest.size), dtype=np.uint8)
    wait_all(comm.Iallgather([digest, MPI.BYTE], [everyone, MPI.BYTE]))
    if (everyone == everyone[0]).all():
        return
    signatures = comm.allgather(signature)  # error path only: say what differs
    other = next(r for r, sig in enumerate(signatures) if sig != signatures[0])
    mine, theirs = next(
        (a, b) for a, b in itertools.zip_longest(signatures[0], signatures[other]) if a != b
    )
    raise ValueError(
        "ReplicatedModule: the trainers wrap different modules (parameter and buffer names, "
        f"shapes and dtypes must match). First difference: rank 0 of the communicator has "
        f"{mine}, rank {other} has {theirs}."
    )


# ---------------------------------------------------------------------------
# Gradients in a context


def _context_grads(context_id: int, params: list[nn.Parameter]) -> list[torch.Tensor | None]:
    grads = dist_autograd.get_gradients(context_id)
    return [grads.get(p) for p in params]


def _replace_context_grads(
    context_id: int, params: list[nn.Parameter], grads: list[torch.Tensor | None]
) -> None:
    dist_autograd._retrieve_context(context_id).set_gradients(zip(params, grads, strict=True))


def _plan_buckets(
    params: list[nn.Parameter], chosen: list[int], cap: int
) -> list[tuple[torch.dtype, list[int]]]:
    """Group parameters ``chosen`` by reduction dtype, in order, in buckets of <= ``cap`` bytes."""
    buckets: list[tuple[torch.dtype, list[int]]] = []
    open_buckets: dict[torch.dtype, tuple[list[int], int]] = {}
    for i in chosen:
        dtype = _UPCAST.get(params[i].dtype, params[i].dtype)
        nbytes = params[i].numel() * dtype.itemsize
        group, size = open_buckets.get(dtype, ([], 0))
        if group and size + nbytes > cap:
            buckets.append((dtype, group))
            group, size = [], 0
        group.append(i)
        open_buckets[dtype] = (group, size + nbytes)
    buckets.extend((dtype, group) for dtype, (group, _) in open_buckets.items())
    return buckets


def _dense_or_zeros(grad: torch.Tensor | None, param: nn.Parameter) -> torch.Tensor:
    if grad is None:
        return torch.zeros_like(param)
    return grad.to_dense() if grad.is_sparse else grad


def _average_dense(
    comm: MPI.Intracomm,
    grads: list[torch.Tensor | None],
    params: list[nn.Parameter],
    chosen: list[int],
    bucket_cap: int,
) -> dict[int, torch.Tensor]:
    """Mean over ``comm`` of the gradients of parameters ``chosen`` (missing ones count as 0).

    One in-place ``Iallreduce`` per bucket, all in flight at once; through host memory.
    """
    buckets = _plan_buckets(params, chosen, bucket_cap)
    flats = [
        torch.cat(
            [
                _dense_or_zeros(grads[i], params[i]).detach().reshape(-1).to("cpu", dtype)
                for i in group
            ]
        )
        for dtype, group in buckets
    ]
    wait_all(*[comm.Iallreduce(MPI.IN_PLACE, _as_buffer(flat), MPI.SUM) for flat in flats])
    size = comm.Get_size()
    averaged: dict[int, torch.Tensor] = {}
    for (_, group), flat in zip(buckets, flats, strict=True):
        flat.div_(size)
        offset = 0
        for i in group:
            n = params[i].numel()
            averaged[i] = (
                flat[offset : offset + n]
                .view(params[i].shape)
                .to(params[i].device, params[i].dtype)
            )
            offset += n
    return averaged


def _average_sparse(
    comm: MPI.Intracomm, grad: torch.Tensor | None, param: nn.Parameter
) -> torch.Tensor:
    """Mean over ``comm`` of one parameter's sparse gradients (gathered, then coalesced)."""
    if grad is None:
        grad = torch.sparse_coo_tensor(
            torch.empty((1, 0), dtype=torch.long),
            torch.empty((0, *param.shape[1:]), dtype=param.dtype),
            param.shape,
            check_invariants=False,
        )
    elif not grad.is_sparse or grad.sparse_dim() != 1:  # row-sparse everywhere, as embeddings
        grad = grad.to_dense().to_sparse(1)
    grad = grad.coalesce()
    parts = comm.allgather((grad.indices(), grad.values()))
    indices = torch.cat([i for i, _ in parts], dim=1)
    values = torch.cat([v for _, v in parts]) / comm.Get_size()
    return torch.sparse_coo_tensor(indices, values, param.shape, check_invariants=False).coalesce()


# ---------------------------------------------------------------------------


class ReplicatedModule(nn.Module):
    r"""A module replicated on every trainer, kept identical by averaging its gradients.

    The data-parallel part of a hybrid model trained with distributed autograd,
    over MPI (torch's ``DistributedDataParallel`` does the same over a
    ``torch.distributed`` process group). Construct it on every rank of
    ``comm`` (a collective); it checks that all ranks wrap the same
    architecture and copies the parameters and buffers of ``comm``'s rank
    ``src`` to the others. Then, in each iteration, every trainer calls
    :meth:`sync_gradients` after ``dist_autograd.backward`` and before
    ``DistributedOptimizer.step``: it replaces the trainer's gradients of the
    wrapped parameters in the context by their mean over ``comm``.

    A parameter that got no gradient on some trainers counts as a zero
    gradient there; one that got no gradient on any trainer keeps none (the
    optimizer leaves it unchanged). Sparse gradients (``nn.Embedding(...,
    sparse=True)``) are gathered and stay sparse. Gradients are reduced in
    their own dtype, float16 and bfloat16 in float32, through host memory.
    Buffers (batch-norm statistics) are broadcast from ``src`` at every
    forward, as DDP does, unless ``broadcast_buffers=False``: a module with
    buffers is then a collective at forward too, so every trainer must run the
    same number of forwards.

    Args:
        module (nn.Module): the replicated module (same architecture on every trainer).
        comm (mpi4py.MPI.Intracomm, optional): the trainers' communicator
            (default ``MPI.COMM_WORLD``). When only some ranks are trainers,
            split one off on every rank, e.g.
            ``MPI.COMM_WORLD.Split(0 if is_trainer else MPI.UNDEFINED)``, and
            build the ReplicatedModule on the trainers only. A private duplicate is used.
        src (int): the rank in ``comm`` whose initial values everyone gets (default 0).
        broadcast_buffers (bool): broadcast buffers from ``src`` at each forward.
        bucket_cap_mb (float): gradients are reduced in buckets of at most this
            many MiB (default 25), all in flight at once.

    Raises:
        ValueError: ``comm`` is ``MPI.COMM_NULL`` or not an intracommunicator,
            or the trainers wrap different architectures (raised on every trainer).
        RuntimeError: MPI was not initialised with ``MPI_THREAD_MULTIPLE`` (the
            RPC agent's thread calls MPI at the same time).

    Example::
        The hybrid model of torch's DDP + RPC tutorial, ranks 0 and 1 training,
        the embedding table on rank 2. Run with ``mpiexec -n 3 python -m mpi4py example.py``:

        >>> # xdoctest: +SKIP
        >>> import torch
        >>> from mpi4py import MPI
        >>> import lightning_distgrad.autograd as dist_autograd
        >>> import lightning_distgrad.rpc as rpc
        >>> from lightning_distgrad.nn import RemoteModule, ReplicatedModule
        >>> from lightning_distgrad.optim import DistributedOptimizer
        >>> rpc.init_rpc()
        >>> rank = MPI.COMM_WORLD.Get_rank()
        >>> trainers = MPI.COMM_WORLD.Split(0 if rank < 2 else MPI.UNDEFINED)
        >>> # On ranks 0 and 1:
        >>> emb = RemoteModule("worker2", torch.nn.EmbeddingBag, args=(100, 16),
        ...                    kwargs={"mode": "sum"})
        >>> fc = ReplicatedModule(torch.nn.Linear(16, 8), trainers)
        >>> opt = DistributedOptimizer(torch.optim.SGD,
        ...                            emb.remote_parameters() + fc.parameter_rrefs(), lr=0.05)
        >>> with dist_autograd.context() as context_id:
        ...     out = fc(emb(torch.randint(0, 100, (20,)), torch.tensor([0, 10])))
        ...     loss = torch.nn.functional.cross_entropy(out, torch.tensor([1, 5]))
        ...     dist_autograd.backward(context_id, [loss])
        ...     fc.sync_gradients(context_id)
        ...     opt.step(context_id)
        >>> # On every rank:
        >>> rpc.shutdown()
    """

    def __init__(
        self,
        module: nn.Module,
        comm: MPI.Intracomm | None = None,
        *,
        src: int = 0,
        broadcast_buffers: bool = True,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    ):
        super().__init__()
        comm = MPI.COMM_WORLD if comm is None else comm
        if comm == MPI.COMM_NULL or not isinstance(comm, MPI.Intracomm):
            raise ValueError(
                f"ReplicatedModule: comm must be the trainers' intracommunicator, got {comm!r}. "
                "HINT: build the ReplicatedModule only on the ranks of the communicator "
                "(Split gives MPI.COMM_NULL to the other ranks)."
            )
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError(
                "ReplicatedModule needs MPI initialised with MPI_THREAD_MULTIPLE (the RPC "
                f"agent's thread calls MPI at the same time); this process has level "
                f"{MPI.Query_thread()}. HINT: do not lower mpi4py.rc.thread_level."
            )
        if not 0 <= src < comm.Get_size():
            raise ValueError(
                f"ReplicatedModule: src={src} is not a rank of comm (size {comm.Get_size()})"
            )
        self.module = module
        self.src = src
        self.broadcast_buffers = broadcast_buffers
        self.bucket_cap = int(bucket_cap_mb * 1024 * 1024)
        self.comm = comm.Dup()
        _check_same_structure(self.comm, module)
        _broadcast(self.comm, list(module.parameters()) + list(module.buffers()), src)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (after broadcasting its buffers from ``src``, if any).

        Example::
            >>> # xdoctest: +SKIP
            >>> fc = ReplicatedModule(torch.nn.Linear(16, 8), trainers)
            >>> fc(torch.randn(4, 16)).shape
            torch.Size([4, 8])
        """
        if self.broadcast_buffers:
            _broadcast(self.comm, list(self.module.buffers()), self.src)
        return self.module(*args, **kwargs)

    def sync_gradients(self, context_id: int) -> None:
        r"""Replace this trainer's gradients in ``context_id`` by their mean over the trainers.

        A collective over the trainers' communicator: every trainer calls it,
        after ``dist_autograd.backward`` and before ``DistributedOptimizer.step``.
        If it fails on any trainer (an unknown context id, say) it raises on
        every trainer, so none is left waiting. Calling it again in the same
        context (after another backward pass) averages the new contributions;
        the parts already averaged are equal everywhere and stay so.

        Args:
            context_id (int): the distributed autograd context of this iteration.

        Raises:
            RuntimeError: ``Could not find autograd context with id: ...`` here,
                or a failure on another trainer.

        Example::
            >>> # xdoctest: +SKIP
            >>> with dist_autograd.context() as context_id:
            ...     dist_autograd.backward(context_id, [model(batch).sum()])
            ...     model.fc.sync_gradients(context_id)
            ...     opt.step(context_id)
        """
        params = list(self.module.parameters())
        grads, error = self._local_grads(context_id, params)
        present, sparse = self._agree(grads, error)
        dense = [i for i in range(len(params)) if present[i] and not sparse[i]]
        averaged = _average_dense(self.comm, grads, params, dense, self.bucket_cap)
        for i in range(len(params)):
            if present[i] and sparse[i]:
                averaged[i] = _average_sparse(self.comm, grads[i], params[i])
        _replace_context_grads(context_id, params, [averaged.get(i) for i in range(len(params))])

    def parameter_rrefs(self) -> list[rpc.RRef]:
        r"""``RRef(param)`` for every parameter, for a ``DistributedOptimizer``.

        Example::
            >>> # xdoctest: +SKIP
            >>> opt = DistributedOptimizer(torch.optim.Adam, fc.parameter_rrefs(), lr=1e-3)
        """
        return [rpc.RRef(p) for p in self.module.parameters()]

    def _local_grads(
        self,
        context_id: int,
        params: list[nn.Parameter],
    ) -> tuple[list[torch.Tensor | None], BaseException | None]:
        try:
            return _context_grads(context_id, params), None
        except Exception as e:
            return [None] * len(params), e

    def _agree(
        self,
        grads: list[torch.Tensor | None],
        error: BaseException | None,
    ) -> tuple[list[bool], list[bool]]:
        """Which parameters have a (sparse) gradient on any trainer; raise if a trainer failed."""
        n = len(grads)
        flags = np.zeros(1 + 2 * n, dtype=np.int32)
        flags[0] = error is not None
        flags[1 : 1 + n] = [g is not None for g in grads]
        flags[1 + n :] = [g is not None and g.is_sparse for g in grads]
        wait_all(self.comm.Iallreduce(MPI.IN_PLACE, flags, MPI.SUM))
        if error is not None:
            raise error
        if flags[0]:
            raise RuntimeError(
                f"ReplicatedModule.sync_gradients failed on {flags[0]} other trainer(s); see the "
                "error raised there. No gradient was changed."
            )
        return [bool(f) for f in flags[1 : 1 + n]], [bool(f) for f in flags[1 + n :]]
