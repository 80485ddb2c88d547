"""RRef proxies: ``rref.rpc_sync().method(...)`` and friends run a method on the owner."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .._calls import dispatch
from .._calls.waiting import UserFuture
from .owner_side import _invoke_on_rref, fail


def _check_method(value_type: type, name: str) -> None:
    """torch's proxies look the method up on the value's type before calling it: a
    missing one raises ``AttributeError`` here, on the caller."""
    getattr(value_type, name)


class Proxy:
    """``rref.rpc_sync().method(...)`` and friends: run a method on the owner.

    As torch's proxies, a call first learns the value's type (``RRef._get_type``,
    within the call's timeout, so a value still being created times the call out),
    and raises ``AttributeError`` for a method the type lacks; ``rpc_async`` does
    both without blocking and reports them through its future.
    """

    def __init__(self, rref: Any, mode: str, timeout: float):
        timeout = dispatch.check_timeout(
            timeout
        )  # at rref.rpc_sync(timeout), not at the method call
        self._rref = rref
        self._mode = mode
        self._timeout = timeout

    def __getattr__(self, name: str) -> Callable:
        rref, mode, timeout = self._rref, self._mode, self._timeout

        def call(*args, **kwargs):
            packed = (rref, name, args, kwargs)
            if mode == "async":
                return _proxy_async(rref, name, packed, timeout)
            _check_method(rref._get_type(timeout), name)
            if mode == "remote":
                create = type(rref)._create_remote  # the RRef class: no import of it here
                return create(rref.owner(), _invoke_on_rref, packed, None, timeout)
            fut = dispatch.invoke(
                rref.owner(), _invoke_on_rref, packed, None, timeout, user_visible=False
            )
            return dispatch.wait(fut)

        return call


def _proxy_async(rref: Any, name: str, packed: tuple, timeout: float) -> torch.futures.Future:
    """``rref.rpc_async().name(...)``: the call's future, sent once the type is known."""
    type_future = rref._get_type(timeout, blocking=False)

    def send() -> torch.futures.Future:
        _check_method(type_future.wait(), name)
        return dispatch.invoke(rref.owner(), _invoke_on_rref, packed, None, timeout)

    if type_future.done():  # the type was known: send from the caller's thread, as rpc_async
        try:
            return send()
        except BaseException as e:
            failed: torch.futures.Future = torch.futures.Future()
            fail(failed, e)
            return failed
    result = UserFuture(dispatch.require_agent().waiting)

    def on_type(_: torch.futures.Future) -> None:
        try:
            call = send()
        except BaseException as e:
            fail(result, e)
            return
        call.add_done_callback(functools.partial(_copy_outcome, result))

    type_future.add_done_callback(on_type)
    return result


def _copy_outcome(into: torch.futures.Future, done: torch.futures.Future) -> None:
    try:
        into.set_result(done.wait())
    except BaseException as e:
        fail(into, e)
