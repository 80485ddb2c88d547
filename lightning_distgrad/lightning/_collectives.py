"""Lightning's collectives (reduce, barrier, broadcast, all_gather) over the trainers' communicator.

The communicator holds the trainer ranks only: serving ranks never join Lightning's collectives.
It is private to the strategy (a ``Split`` of the world, never the RPC agent's duplicates), so its
traffic cannot match anyone else's. Every wait polls a non-blocking request and naps between
polls (``lightning_distgrad._backoff``): a rank never spins while it waits.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from .._backoff import wait_all

__all__ = ["AllGather", "TrainerCollectives", "reduce_op_name"]

# Reductions that numpy/MPI cannot do in these dtypes run in float32 (then cast back).
_UPCAST = (torch.bfloat16, torch.float16, torch.complex32)
_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "product": MPI.PROD, "prod": MPI.PROD}


def reduce_op_name(reduce_op: Any) -> str:
    """``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"product"`` for a str or ``ReduceOp``."""
    if reduce_op is None:
        return "mean"
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
        name = {"avg": "mean", "prod": "product"}.get(name, name)
        if name in ("sum", "mean", "max", "min", "product"):
            return name
    else:
        from torch.distributed import ReduceOp

        for name, attr in (
            ("sum", "SUM"),
            ("mean", "AVG"),
            ("max", "MAX"),
            ("min", "MIN"),
            ("product", "PRODUCT"),
        ):
            if reduce_op == getattr(ReduceOp, attr):
                return name
    raise ValueError(
        f"Unsupported reduce_op={reduce_op!r}. HINT: use 'sum', 'mean', 'max', 'min' or"
        " 'product' (or the matching torch.distributed.ReduceOp)."
    )


class TrainerCollectives:
    """Collectives over ``comm`` (the trainers); the object owns ``comm`` and frees it."""

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()

    # --- control --------------------------------------------------------------------------------

    def barrier(self) -> None:
        if self.size > 1:
            wait_all(self.comm.Ibarrier())

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank: one small allreduce, which no rank leaves before
        every rank has entered it (so it also serves as a barrier)."""
        if self.size == 1:
            return bool(flag)
        mine = np.array([1 if flag else 0], dtype=np.int32)
        result = np.empty_like(mine)
        wait_all(self.comm.Iallreduce(mine, result, op=MPI.MAX))
        return bool(result[0])

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.size == 1:
            return obj
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == src else b""
        length = np.array([len(data)], dtype=np.int64)
        wait_all(self.comm.Ibcast(length, root=src))
        buf = (
            np.frombuffer(data, dtype=np.uint8).copy()
            if self.rank == src
            else (np.empty(int(length[0]), dtype=np.uint8))
        )
        wait_all(self.comm.Ibcast(buf, root=src))
        return obj if self.rank == src else pickle.loads(buf.tobytes())

    def allgather_object(self, obj: Any) -> list[Any]:
        return self._gather_object(obj, root=None)

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` on ``root`` (``None`` elsewhere)."""
        return self._gather_object(obj, root=root)

    def _gather_object(self, obj: Any, root: int | None) -> list[Any] | None:
        if self.size == 1:
            return [obj]
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
        mine = np.array([data.size], dtype=np.int64)
        lengths = np.empty(self.size, dtype=np.int64)
        if root is None:
            wait_all(self.comm.Iallgather(mine, lengths))
        else:
            wait_all(self.comm.Igather(mine, lengths if self.rank == root else None, root=root))
        receiving = root is None or self.rank == root
        out = np.empty(int(lengths.sum()), dtype=np.uint8) if receiving else None
        displs = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if receiving else None
        recv = [out, (lengths, displs), MPI.BYTE] if receiving else None
        if root is None:
            wait_all(self.comm.Iallgatherv(data, recv))
        else:
            wait_all(self.comm.Igatherv(data, recv, root=root))
        if not receiving:
            return None
        return [
            pickle.loads(out[d : d + n].tobytes())
            for d, n in zip(displs.tolist(), lengths.tolist(), strict=True)
        ]

    # --- tensors --------------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """A new tensor: ``op`` over the ranks of ``tensor`` (``"mean"`` divides the sum).

        The mean of an integer tensor is a floating tensor; the sum of a bool tensor counts.
        """
        work = tensor.detach().to("cpu").contiguous()
        if op == "mean" and not work.is_floating_point():
            work = work.to(torch.get_default_dtype())
        elif work.dtype in _UPCAST:
            work = work.float()
        elif work.dtype == torch.bool:
            work = work.to(torch.int64)
        if self.size > 1:
            array = work.numpy()
            result = np.empty_like(array)
            wait_all(self.comm.Iallreduce(array, result, op=_OPS["sum" if op == "mean" else op]))
            work = torch.from_numpy(result)
        else:
            work = work.clone()
        if op == "mean":
            work = work / self.size
            dtype = tensor.dtype if tensor.is_floating_point() else work.dtype
        elif tensor.dtype == torch.bool and op == "sum":
            dtype = torch.int64
        else:
            dtype = tensor.dtype
        return work.to(device=tensor.device, dtype=dtype)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """A ``(world, *tensor.shape)`` tensor of every rank's ``tensor`` (same shapes)."""
        work = tensor.detach().to("cpu").contiguous()
        if work.dtype in _UPCAST:
            work = work.float()
        elif work.dtype == torch.bool:
            work = work.to(torch.uint8)
        if self.size > 1:
            array = work.numpy()
            result = np.empty((self.size, *array.shape), dtype=array.dtype)
            wait_all(self.comm.Iallgather(array, result))
            work = torch.from_numpy(result)
        else:
            work = work.unsqueeze(0).clone()
        return work.to(device=tensor.device, dtype=tensor.dtype)

    def free(self) -> None:
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()


class AllGather(torch.autograd.Function):
    """``all_gather`` whose backward sums each rank's slice of the gradient over the ranks."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, collectives: TrainerCollectives) -> torch.Tensor:
        ctx.collectives = collectives
        return collectives.all_gather(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        collectives = ctx.collectives
        return collectives.all_reduce(grad, "sum")[collectives.rank], None
