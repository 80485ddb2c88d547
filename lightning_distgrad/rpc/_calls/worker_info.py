"""The name and rank of a worker, and what makes a worker name valid."""

from __future__ import annotations

import re
from typing import Any

#: torch's rule for worker names (``WorkerInfo``'s C++ checks, same texts).
_NAME_RE = re.compile(r"^[A-Za-z0-9_:\-]*$")
MAX_NAME_LEN = 128


def name_problem(name: Any) -> str | None:
    """Why ``name`` is not a valid worker name, in torch's words, or None if it is.

    Example::

        >>> name_problem("trainer:0") is None
        True
        >>> name_problem("abc*")
        'Worker name must match ^[A-Za-z0-9-_:]*$. (Got abc*)'
    """
    if not isinstance(name, str):
        return f"worker name must be a str, got {type(name).__name__}"
    if not name:
        return "Worker name must be non-empty"
    if len(name) >= MAX_NAME_LEN:
        return f"Worker name must be shorter than {MAX_NAME_LEN} characters (got {len(name)})"
    if not _NAME_RE.match(name):
        return f"Worker name must match ^[A-Za-z0-9-_:]*$. (Got {name})"
    return None


class WorkerInfo:
    """The name and id (rank) of one worker, as in ``torch.distributed.rpc``.

    A malformed name raises ``RuntimeError``, as torch's does.

    Example::

        >>> # xdoctest: +SKIP
        >>> rpc.get_worker_info("worker1")      # after init_rpc, under mpiexec -n 2
        WorkerInfo(id=1, name=worker1)
        >>> rpc.get_worker_info().id            # this worker's rank
        0
        >>> rpc.WorkerInfo("abc*", 0)           # RuntimeError: Worker name must match ...
    """

    __slots__ = ("name", "id")

    def __init__(self, name: str, id: int):  # noqa: A002 - torch's signature
        problem = name_problem(name)
        if problem is not None:
            raise RuntimeError(problem)
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
