"""The constants of ``torch.distributed.rpc.constants``, with this agent's values.

Example::

    >>> from lightning_distgrad.rpc import constants
    >>> constants.DEFAULT_RPC_TIMEOUT_SEC, constants.UNSET_RPC_TIMEOUT
    (60.0, -1.0)
"""

from __future__ import annotations

from datetime import timedelta

# Re-exported under torch's names (torch's module lists none in __all__ either).
from ._calls.dispatch import UNSET_RPC_TIMEOUT as UNSET_RPC_TIMEOUT
from .options import DEFAULT_NUM_WORKER_THREADS as DEFAULT_NUM_WORKER_THREADS
from .options import DEFAULT_RPC_TIMEOUT_SEC as DEFAULT_RPC_TIMEOUT_SEC

__all__: list[str] = []

#: Accepted for compatibility: MPI provides the rendezvous.
DEFAULT_INIT_METHOD: str = "env://"
#: ``shutdown(timeout=...)``'s default: no limit.
DEFAULT_SHUTDOWN_TIMEOUT: float = 0
#: torch's timeout of the process group its agent creates; none is created here.
DEFAULT_PROCESS_GROUP_TIMEOUT: timedelta = timedelta(milliseconds=2**31 - 1)
