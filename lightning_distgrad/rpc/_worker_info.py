"""The name and rank of a worker."""

from __future__ import annotations


class WorkerInfo:
    """The name and id (rank) of one worker, as in ``torch.distributed.rpc``.

    Example::

        >>> # xdoctest: +SKIP
        >>> rpc.get_worker_info("worker1")      # after init_rpc, under mpiexec -n 2
        WorkerInfo(id=1, name=worker1)
        >>> rpc.get_worker_info().id            # this worker's rank
        0
    """

    __slots__ = ("name", "id")

    def __init__(self, name: str, id: int):  # noqa: A002 - torch's signature
        self.name = name
        self.id = id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WorkerInfo) and (self.name, self.id) == (other.name, other.id)

    def __hash__(self) -> int:
        return hash((self.name, self.id))

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"

    def __reduce__(self):
        return (WorkerInfo, (self.name, self.id))
