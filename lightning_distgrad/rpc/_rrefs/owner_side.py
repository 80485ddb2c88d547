"""The owner's side of RRefs: the functions that RPCs to an RRef's owner run there.

``rpc.remote`` runs :func:`_create_owner_value` on the owner; ``to_here`` runs
:func:`_rref_fetch`, a proxy's call :func:`_rref_typeof_on_owner` then
:func:`_invoke_on_rref`, a user's ``backward`` :func:`_rref_backward`. Each answers once the
value it needs is set: a request for a value may overtake the request that creates it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..._compat import CFuture
from .._calls import dispatch
from .._calls.errors import async_wrong_type_error, is_async_function, print_user_error, set_error
from ..functions import async_execution
from .bookkeeping import require_context


def fail(future: torch.futures.Future, error: BaseException) -> None:
    """Complete ``future`` with ``error``, without its traceback: the frames it holds
    reference ``future`` and the RRef, a cycle through the C++ future that would keep the
    value on its owner forever."""
    set_error(future, error.with_traceback(None))


@async_execution
def _create_owner_value(rref_id, func: Callable, args: tuple, kwargs: dict) -> torch.futures.Future:
    context = require_context()
    entry = context.entry(rref_id)
    done: torch.futures.Future = torch.futures.Future()

    def finish(value: Any = None, error: BaseException | None = None) -> None:
        if error is None:
            entry.future.set_result(value)
            done.set_result(None)
        else:
            # The stored error must not reference entry or done: drop the traceback
            # entry of the frame that caught it (this function or on_done), which
            # does; a cycle through C++ futures is never collected. The function's
            # own frames stay.
            tb = error.__traceback__
            error = error.with_traceback(tb.tb_next if tb is not None else None)
            set_error(entry.future, error)
            set_error(done, error)
        context.value_set(entry)

    try:
        result = func(*args, **kwargs)
    except BaseException as e:
        if isinstance(e, Exception) and not dispatch.is_builtin(func):
            print_user_error(e, dispatch.require_agent().info)  # as a call's callee does
        finish(error=e)
        return done
    if is_async_function(func) and not isinstance(result, CFuture):
        # Not raised here: the RRef's value fails, and to_here() raises it, as torch's.
        finish(error=async_wrong_type_error(result))
        return done
    # CFuture: ``then()``/``collect_all()`` return the C base class.
    if is_async_function(func):

        def on_done(f: torch.futures.Future) -> None:
            try:
                finish(f.wait())
            except BaseException as e:
                finish(error=e)

        result.add_done_callback(on_done)
    else:
        finish(result)
    return done


@async_execution
def _rref_fetch(rref_id) -> torch.futures.Future:
    return require_context().entry(rref_id).future


@async_execution
def _rref_typeof_on_owner(rref_id) -> torch.futures.Future:  # torch's name, as profiled
    # Answered when the value is set: a serving thread does not wait for a creation
    # that is still running. A failed creation answers with its own error.
    value = require_context().entry(rref_id).future
    value_type: torch.futures.Future = torch.futures.Future()

    def answer(f: torch.futures.Future) -> None:
        try:
            value_type.set_result(type(f.wait()))
        except BaseException as e:
            fail(value_type, e)

    value.add_done_callback(answer)
    return value_type


@async_execution
def _invoke_on_rref(rref: Any, name: str, args: tuple, kwargs: dict) -> torch.futures.Future:
    value = rref.local_value()
    method = getattr(value, name)
    if is_async_function(getattr(type(value), name, None)):
        return method(*args, **kwargs)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(method(*args, **kwargs))
    return fut


def _rref_backward(rref: Any, ctx_id: int, retain_graph: bool) -> None:
    rref.backward(ctx_id, retain_graph)
