"""The current agent and the one private dispatcher behind every public call."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from ..._compat import find_builtin
from .spans import profiling_key, recording_rpcs
from .worker_info import WorkerInfo

if TYPE_CHECKING:
    from .agent import Agent

#: Sentinel meaning "use the agent's default timeout" (torch uses -1.0 too).
UNSET_RPC_TIMEOUT = -1.0

_agent: Agent | None = None
#: True from ``shutdown`` until the next ``init_rpc``: tells "shut down" from "never started".
_shut_down = False


def set_agent(agent: Agent | None) -> None:
    """Make ``agent`` current; None (from ``shutdown``) marks RPC as shut down."""
    global _agent, _shut_down
    _agent = agent
    _shut_down = agent is None


def current_agent() -> Agent | None:
    return _agent


#: torch's text for an RPC object (a local ``RRef``) made before ``init_rpc``.
AGENT_NOT_SET = (
    " Current RPC agent is not set! Did you initialize the RPC framework "
    "(e.g. calling `rpc.init_rpc`)?"
)


def require_agent(more: str = "") -> Agent:
    """The running agent, or the error torch gives before ``init_rpc``/after ``shutdown``,
    followed by ``more`` (torch's text where it differs, as :data:`AGENT_NOT_SET`)."""
    if _agent is None:
        # torch's text stays the prefix after shutdown too: ported code matches on it.
        if _shut_down:
            raise RuntimeError(
                "RPC has not been initialized. Call lightning_distgrad.rpc.init_rpc first. "
                "(RPC has been shut down on this worker; init_rpc can start it again.)" + more
            )
        raise RuntimeError(
            "RPC has not been initialized. Call lightning_distgrad.rpc.init_rpc first." + more
        )
    return _agent


def check_timeout(timeout: Any, name: str = "timeout", *, unset_ok: bool = True) -> float:
    """``timeout`` as float seconds, or an error before anything is sent.

    Allowed: a real number >= 0 (0: no timeout), and with ``unset_ok``
    ``UNSET_RPC_TIMEOUT`` (-1) for the agent's default. Rejected with
    ``ValueError``: other negatives, NaN and infinity; with ``TypeError``
    (as torch's): bools and non-numbers.

    Example::
        >>> check_timeout(2)
        2.0
        >>> check_timeout(-1)   # UNSET_RPC_TIMEOUT
        -1.0
        >>> check_timeout(-5)   # ValueError: timeout must be a number of seconds >= 0 ...
    """
    kind = type(timeout)
    if kind is float or kind is int:  # the common case, checked without isinstance
        if 0 <= timeout < math.inf:  # False for NaN
            return float(timeout)
        if unset_ok and timeout == UNSET_RPC_TIMEOUT:
            return UNSET_RPC_TIMEOUT
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        return check_timeout(float(timeout), name, unset_ok=unset_ok)
    allowed = f"{name} must be a number of seconds >= 0 (0: no timeout)"
    if unset_ok:
        allowed += " or UNSET_RPC_TIMEOUT (-1) for the default"
    got = repr(timeout) if kind is float or kind is int else f"{timeout!r} ({kind.__name__})"
    if kind is float and timeout == math.inf:
        got += "; use 0 for no timeout"
    if kind is float or kind is int:
        raise ValueError(f"{allowed}; got {got}")
    raise TypeError(f"{allowed}; got {got}")


def resolve(agent: Agent, to: Any) -> WorkerInfo:
    """Turn a name, a rank or a ``WorkerInfo`` into a known ``WorkerInfo``."""
    if isinstance(to, WorkerInfo):
        known = agent.by_name.get(to.name)
        if known is None or known.id != to.id:
            raise RuntimeError(
                f"name:{agent.info.name},rank:{agent.info.id} could not find destination "
                f"{to}. Known workers: {sorted(agent.by_name)}"
            )
        return known
    if isinstance(to, str):
        known = agent.by_name.get(to)
        if known is None:
            raise RuntimeError(
                f"name:{agent.info.name},rank:{agent.info.id} could not find destination name "
                f"{to}. Known workers: {sorted(agent.by_name)}"
            )
        return known
    if isinstance(to, int) and not isinstance(to, bool):
        if not 0 <= to < len(agent.infos):
            raise RuntimeError(
                f"name:{agent.info.name},rank:{agent.info.id} could not find destination id "
                f"{to}. Valid ranks are 0..{len(agent.infos) - 1}"
            )
        return agent.infos[to]
    raise ValueError(f"Cannot get WorkerInfo from name {to}")


def is_builtin(func: Any) -> bool:
    """True for torch operators (``torch.add``), which torch RPC treats as builtins."""
    try:
        return find_builtin(func) is not None
    except Exception:
        return False


def invoke(
    to: Any,
    func: Callable,
    args: tuple | list | None,
    kwargs: dict | None,
    timeout: float,
    *,
    user_visible: bool = True,
    force_autograd: bool | None = None,
    arrival_forks: list | None = None,
    profile: str | None = None,
    profiled_func: Callable | None = None,
) -> torch.futures.Future:
    """Validate, then send one request; everything is checked before anything is sent.

    ``profile`` ("sync", "async", "remote"): under an active torch profiler the call is
    recorded as torch's RPC profiling names it, ``rpc_sync#aten::add(worker0 -> worker1)``,
    for ``profiled_func`` (default ``func``), from the send until the response, and the
    profiler lists what the callee recorded of it (see ``spans``).
    """
    timeout = check_timeout(timeout)
    agent = require_agent()
    dst = resolve(agent, to)
    if not callable(func):
        raise TypeError("function should be callable.")
    if timeout == UNSET_RPC_TIMEOUT:
        timeout = agent.timeout
    operator = is_builtin(func)
    name = None
    if profile is not None and recording_rpcs():
        name = profiling_key(profile, profiled_func or func, f"{agent.info.name} -> {dst.name}")
    if force_autograd is None:
        # Python functions always carry the context: their result may need
        # grad even when no argument does (torch's forceGradRecording).
        force_autograd = not operator
    return agent.call(
        dst,
        func,
        tuple(args or ()),
        dict(kwargs or {}),
        float(timeout),
        user_visible=user_visible,
        force_autograd=force_autograd,
        arrival_forks=arrival_forks,
        operator=operator,
        profiled=name,
    )


def wait(future: torch.futures.Future) -> Any:
    """The value of an internal RPC future, once done; the waiting thread drives MPI
    progress meanwhile (see ``waiting``)."""
    agent = _agent
    if agent is not None:
        agent.waiting.wait(future)
    return future.wait()


def call_all(calls: Iterable[tuple]) -> list[Any]:
    """Run ``(worker, func, args[, kwargs])`` calls concurrently; wait for all, then raise.

    Calls to other workers go out first, as RPCs that carry no autograd
    context (an owner that no gradient of the context reached has no context
    to create, and nothing to release later); calls to this worker then run
    inline, while the others are in flight. Every call is waited for before the
    first error is raised; otherwise the results come back in call order.

    Example::
        >>> # xdoctest: +SKIP
        >>> call_all([("worker1", max, (1, 2)), (0, min, (3, 4))])
        [2, 3]
    """
    agent = require_agent()
    calls = list(calls)
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []
    remote, local = {}, []
    for i, (worker, func, args, *kwargs) in enumerate(calls):
        kw = kwargs[0] if kwargs else {}
        if resolve(agent, worker).id == agent.info.id:
            local.append((i, func, args, kw))
        else:
            remote[i] = invoke(
                worker, func, args, kw, UNSET_RPC_TIMEOUT, user_visible=False, force_autograd=False
            )
    for i, func, args, kw in local:
        try:
            results[i] = func(*args, **kw)
        except Exception as e:
            errors.append(e)
    for i, future in remote.items():
        try:
            results[i] = wait(future)
        except Exception as e:
            errors.append(e)
    if errors:
        raise errors[0]
    return results
