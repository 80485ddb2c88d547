"""``@async_execution``: remote functions that answer through a Future."""

from __future__ import annotations

import functools
from collections.abc import Callable

__all__ = ["async_execution"]


def async_execution(fn: Callable) -> Callable:
    r"""Mark ``fn`` as returning a ``torch.futures.Future``; the callee answers when it completes.

    The RPC worker thread is free while the future is pending, so a function
    can wait for nested RPCs without tying up a thread. With ``@staticmethod``
    or ``@classmethod`` this decorator must be the inner one.

    Example::
        Run with ``mpiexec -n 2 python -m mpi4py example.py``:

        >>> # xdoctest: +SKIP
        >>> import torch
        >>> import lightning_distgrad.rpc as rpc
        >>> @rpc.functions.async_execution
        ... def async_add(to, x, y):
        ...     return rpc.rpc_async(to, torch.add, (x, y)).then(lambda f: f.wait() + 1)
        >>> # On worker 0:
        >>> rpc.init_rpc()
        >>> rpc.rpc_sync("worker1", async_add, ("worker0", torch.ones(2), 1))
        tensor([3., 3.])
        >>> rpc.shutdown()
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    wrapper._wrapped_async_rpc_function = fn  # type: ignore[attr-defined]
    return wrapper
