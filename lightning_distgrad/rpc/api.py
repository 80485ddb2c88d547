"""Public RPC API, mirroring ``torch.distributed.rpc``."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._compat import torch_rpc_thread_local
from . import _lifecycle
from ._calls import autograd_hooks, dispatch
from ._calls.agent import Agent
from ._calls.dispatch import UNSET_RPC_TIMEOUT
from ._calls.worker_info import WorkerInfo
from ._rrefs import bookkeeping
from .options import BackendType, MPIRpcBackendOptions, RpcBackendOptions
from .rref import RRef

__all__ = [
    "init_rpc",
    "shutdown",
    "rpc_sync",
    "rpc_async",
    "remote",
    "get_worker_info",
    "get_rpc_timeout",
    "WorkerInfo",
    "RRef",
]


def init_rpc(
    name: str | None = None,
    backend: BackendType | None = None,
    rank: int = -1,
    world_size: int | None = None,
    rpc_backend_options: MPIRpcBackendOptions | None = None,
) -> None:
    r"""Start the RPC agent on this rank; a collective over the communicator.

    Rank and world size come from MPI. Every rank raises the same error if any
    rank passed a malformed or duplicate name, or a rank/world size that
    disagrees with MPI; RPC then stays uninitialised and can be retried.

    Every rank of the communicator must call it: a rank waits at most the RPC
    timeout (``rpc_backend_options.rpc_timeout``, 60 s by default; 0: no limit)
    for the others to arrive, then raises ``RuntimeError`` saying so, instead
    of waiting forever. ``world_size=1`` starts RPC in this process alone
    (its only worker is rank 0; the other ranks need not call ``init_rpc``).

    Args:
        name (str, optional): this worker's name, unique in the job (default ``worker{rank}``).
        backend (BackendType, optional): ``BackendType.MPI`` (``TENSORPIPE`` is an alias).
        rank (int): checked against the MPI rank when given (default -1: take MPI's).
        world_size (int, optional): checked against the MPI size when given; 1: this
            process alone.
        rpc_backend_options (MPIRpcBackendOptions, optional): timeout, threads, communicator.

    Example::
        Run with ``mpiexec -n 2 python -m mpi4py example.py``:

        >>> # xdoctest: +SKIP
        >>> import torch
        >>> import lightning_distgrad.rpc as rpc
        >>> rpc.init_rpc()                       # worker0 on rank 0, worker1 on rank 1
        >>> if rpc.get_worker_info().id == 0:
        ...     print(rpc.rpc_sync("worker1", torch.add, (torch.ones(2), 1)))
        tensor([2., 2.])
        >>> rpc.shutdown()
    """
    if dispatch.current_agent() is not None:
        raise RuntimeError("RPC is already initialized")
    if backend is not None and not isinstance(backend, BackendType):
        raise TypeError("Argument backend must be a member of BackendType")
    options = rpc_backend_options if rpc_backend_options is not None else MPIRpcBackendOptions()
    if not isinstance(options, MPIRpcBackendOptions):
        raise TypeError(_options_type_problem(options, backend))
    _lifecycle.start(name, rank, world_size, options)


def _options_type_problem(options: Any, backend: BackendType | None) -> str:
    """torch's words for ``rpc_backend_options`` of the wrong type: not options at all, or
    options of another agent, with or without a ``backend`` to check them against."""
    ours = " (here MPIRpcBackendOptions, which TensorPipeRpcBackendOptions is an alias of)"
    if not isinstance(options, RpcBackendOptions):
        return f"Argument rpc_backend_options must be an instance of RpcBackendOptions{ours}"
    if backend is None:
        return f"Could not infer backend for options {options}{ours}"
    return (
        f"`rpc_backend_options` must be a `TensorPipeRpcBackendOptions`{ours}. Got {type(options)}"
    )


def shutdown(graceful: bool = True, timeout: float = 0) -> None:
    r"""Stop the agent. Graceful: wait until every rank's outstanding work is done.

    With ``graceful=True`` (a collective) this rank keeps serving until every
    rank has called ``shutdown``; then user RRefs are released, every request
    in the job is answered, and the agent stops. With ``graceful=False`` only
    this rank's agent stops at once.

    A graceful shutdown with a ``timeout`` raises ``RuntimeError`` once it has
    waited that long, naming the workers that did not call ``shutdown``; the
    agent is stopped all the same. Without one it waits for every worker as
    long as they answer: a worker that leaves a liveness ping unanswered for
    the RPC timeout (``get_rpc_timeout()``) is taken as stopped, and the MPI job
    is aborted with its name, since it could not end normally.

    Args:
        graceful (bool): wait for all ranks (default True).
        timeout (float): seconds a graceful shutdown may take; 0 (default): no limit.

    Example::
        >>> # xdoctest: +SKIP
        >>> rpc.init_rpc()
        >>> rpc.shutdown()   # on every rank
    """
    timeout = dispatch.check_timeout(timeout, unset_ok=False)
    _lifecycle.stop(dispatch.require_agent(), graceful, timeout)


def rpc_sync(
    to: str | int | WorkerInfo,
    func: Callable,
    args: tuple | None = None,
    kwargs: dict | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Any:
    r"""Run ``func(*args, **kwargs)`` on worker ``to`` and return its result.

    Args:
        to (str or int or WorkerInfo): the destination worker.
        func (Callable): a torch operator or a module-level Python function.
        args (tuple): positional arguments; tensors and any picklable structures.
        kwargs (dict): keyword arguments.
        timeout (float): seconds; 0 means no timeout, -1 the default (``get_rpc_timeout()``).

    Returns:
        The result. A remote exception is re-raised here with its original type
        and the remote traceback in its message.

    Example::
        Run with ``mpiexec -n 2 python -m mpi4py example.py``:

        >>> # xdoctest: +SKIP
        >>> # On worker 0:
        >>> rpc.init_rpc()
        >>> rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 3))
        tensor([4., 4.])
        >>> rpc.shutdown()
    """
    return dispatch.wait(
        dispatch.invoke(to, func, args, kwargs, timeout, user_visible=False, profile="sync")
    )


def rpc_async(
    to: str | int | WorkerInfo,
    func: Callable,
    args: tuple | None = None,
    kwargs: dict | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> torch.futures.Future:
    r"""Like :func:`rpc_sync` but returns a ``torch.futures.Future`` at once.

    Callbacks added with ``then`` run on the agent's callback threads (or on
    the thread waiting in ``wait()`` if that thread received the response),
    never on its progress thread, and in the autograd context of the caller.

    Example::
        >>> # xdoctest: +SKIP
        >>> # On worker 0:
        >>> fut = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 3))
        >>> fut.wait()
        tensor([4., 4.])
    """
    future = dispatch.invoke(to, func, args, kwargs, timeout, user_visible=True, profile="async")
    # Each ``_wait_all()`` block this thread is in (ours, torch's) waits for it at its end.
    torchs = torch_rpc_thread_local()
    for local in {_thread_local_var, torchs} - {None}:
        collecting = getattr(local, "future_list", None)
        if collecting is not None:
            collecting.append(future)
    return future


#: Where a ``_wait_all()`` block collects this thread's ``rpc_async`` futures: torch's own
#: thread-local when torch's RPC API was imported first, so that its block and ours agree.
_thread_local_var = torch_rpc_thread_local() or threading.local()


@contextlib.contextmanager
def _wait_all() -> Iterator[None]:
    r"""As torch's private ``rpc.api._wait_all``: every ``rpc_async`` future made on this
    thread inside the block is waited for at its end (``torch.futures.wait_all``: the
    first failed call's error is raised).

    Example::

        >>> # xdoctest: +SKIP
        >>> with rpc.api._wait_all():
        ...     fut = rpc.rpc_async("worker1", torch.add, (torch.ones(2), 1))
        >>> fut.done()
        True
    """
    _thread_local_var.future_list = []
    try:
        yield
    finally:
        try:
            torch.futures.wait_all(_thread_local_var.future_list)
        finally:
            del _thread_local_var.future_list


def remote(
    to: str | int | WorkerInfo,
    func: Callable,
    args: tuple | None = None,
    kwargs: dict | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> RRef:
    r"""Run ``func`` on ``to``, keep the result there and return an :class:`RRef` to it.

    Errors and timeouts surface at the next ``to_here()``.

    Example::
        >>> # xdoctest: +SKIP
        >>> # On worker 0:
        >>> rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 3))
        >>> rref.to_here()
        tensor([4., 4.])
    """
    return RRef._create_remote(to, func, args, kwargs, timeout)


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """The ``WorkerInfo`` of ``worker_name``, or of this worker when None.

    Example::
        >>> # xdoctest: +SKIP
        >>> rpc.get_worker_info("worker1")
        WorkerInfo(id=1, name=worker1)
    """
    agent = dispatch.require_agent()
    if worker_name is None:
        return agent.info
    return dispatch.resolve(agent, worker_name)


def get_rpc_timeout() -> float:
    """The default RPC timeout in seconds, as set at ``init_rpc`` or by ``_set_rpc_timeout``.

    Example::

        >>> # xdoctest: +SKIP
        >>> rpc.init_rpc(rpc_backend_options=rpc.MPIRpcBackendOptions(rpc_timeout=20))
        >>> rpc.get_rpc_timeout()
        20.0
    """
    return dispatch.require_agent().timeout


def _set_rpc_timeout(rpc_timeout: float) -> None:
    """Set the default timeout of RPCs issued from now on (seconds; 0 = none).

    Example::
        >>> # xdoctest: +SKIP
        >>> rpc._set_rpc_timeout(5)
        >>> rpc.get_rpc_timeout()
        5.0
    """
    rpc_timeout = dispatch.check_timeout(rpc_timeout, "rpc_timeout", unset_ok=False)
    dispatch.require_agent().timeout = rpc_timeout


def _get_current_rpc_agent() -> Agent:
    return dispatch.require_agent()


def _rref_context_get_debug_info() -> dict[str, int]:
    return bookkeeping.require_context().debug_info()


def _get_debug_info() -> dict[str, Any]:
    """This worker's RRef, agent and distributed autograd figures, as torch's.

    ``peers`` maps each worker's name to the messages and bytes sent to and
    received from it, ``writes_directly``: whether big tensors to it are
    written straight into its memory (same node, permitted), and ``cuda_ipc``: whether
    CUDA tensors to it travel over CUDA IPC (same node, both use device maps, probe
    passed) rather than staged through host memory; ``handler_queue_depth``
    counts requests waiting for a worker thread. ``requests_run_inline`` and
    ``requests_run_on_pool`` count where this worker's requests ran (a short one runs on
    the thread that received it), ``progress_handoffs`` how often a request that waited or
    ran long handed the receiving of messages to another thread.

    Example::
        >>> # xdoctest: +SKIP
        >>> rpc.api._get_debug_info()["peers"]["worker1"]["messages_sent"]
        12
    """
    info: dict[str, Any] = dict(_rref_context_get_debug_info())
    info.update(dispatch.require_agent().debug_info())
    info.update(autograd_hooks.get().debug_info())
    return info
