"""Errors of RPCs: timeouts, remote exceptions, and futures that fail without leaking."""

from __future__ import annotations

import copy
import sys
import traceback
from typing import Any

import torch

from ..._compat import set_unwrap_func


def timeout_error(timeout: float, dst: Any = None) -> RuntimeError:
    """torch's timeout error (ported code matches its leading text), naming the
    destination worker ``dst`` if given.

    Example::
        >>> from lightning_distgrad.rpc import WorkerInfo
        >>> str(timeout_error(1e-6, WorkerInfo("worker1", 1)))[:45]
        'RPC ran for more than set timeout (0.001 ms) '
        >>> str(timeout_error(0.5, WorkerInfo("worker1", 1))).endswith("(call to worker1, rank 1)")
        True
    """
    ms = timeout * 1000
    # A sub-millisecond timeout must not read as 0 ms, which would mean "no timeout".
    shown = f"{ms:.3f}".rstrip("0").rstrip(".") if ms >= 1 else f"{ms:.3g}"
    where = f" (call to {dst.name}, rank {dst.id})" if dst is not None else ""
    return RuntimeError(
        f"RPC ran for more than set timeout ({shown} ms) and will now be marked with an error"
        + where
    )


def is_async_function(func: Any) -> bool:
    return getattr(func, "_wrapped_async_rpc_function", None) is not None


def remote_error(exc: BaseException, where: Any) -> tuple[type, str]:
    """What travels of an exception raised on worker ``where``: its type and text."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return type(exc), _unescaped(f"On {where}:\n{exc!r}\n{text}")


def _unescaped(text: str) -> str:
    r"""``text`` with backslash escapes undone, as torch shows a remote error: the ``repr``
    of its exception reads ``ValueError('a\nb')`` with a real line break. Other characters
    stay as they are; a text with a malformed escape stays whole.

    Example::

        >>> _unescaped("ValueError('naïve €\\n x')")
        "ValueError('naïve €\n x')"
    """
    try:
        return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError:
        return text


def rebuild_error(exc_type: type, msg: str) -> BaseException:
    try:
        return exc_type(msg)
    except Exception as e:  # types whose constructor does not take one string
        return RuntimeError(
            f"Failed to create original exception type. Error msg was {e!r}. "
            f"Original exception on remote side was {msg}"
        )


def _raise_copy(exc: BaseException):
    """Unwrap function of :func:`set_error` futures: raise a fresh copy of ``exc``."""
    try:
        fresh = copy.copy(exc)
    except Exception:  # a type that cannot be rebuilt from its args
        fresh = RuntimeError(f"{type(exc).__name__}: {exc}")
    fresh.__cause__, fresh.__context__ = exc.__cause__, exc.__context__
    raise fresh.with_traceback(exc.__traceback__)


def set_error(future: torch.futures.Future, exc: BaseException) -> None:
    """Complete ``future`` with ``exc``; every ``wait()`` raises a fresh copy of it.

    ``Future.set_exception`` would raise the stored object itself, whose traceback
    then references the waiting frames, which reference the future: a cycle through
    C++ that Python's gc cannot see, keeping the caller's tensors and RRefs alive.
    ``exc``'s traceback must not reference ``future``.
    """
    set_unwrap_func(future, _raise_copy)
    future.set_result(exc)


_NOT_IMPORTABLE_HINT = (
    "Default RPC pickler does not serialize function code. Ensure that UDFs are defined on "
    "both caller and callee modules: remote functions, and the classes of their arguments, "
    "must be importable under the same module path on every rank. Define them at module level "
    "in a module that every rank imports, not under `if rank == 0:` or "
    "`if __name__ == '__main__':`."
)


def not_importable(exc: ImportError | AttributeError) -> RuntimeError:
    """The error of a request whose function or argument class the callee could not import
    (``exc``, raised while unpickling it): a ``RuntimeError``, as torch raises, with the hint.

    Example::

        >>> err = not_importable(AttributeError("Can't get attribute 'f' on <module 'm'>"))
        >>> type(err).__name__, "pickler does not serialize function code" in str(err)
        ('RuntimeError', True)
    """
    return RuntimeError(f"{type(exc).__name__}: {exc}. {_NOT_IMPORTABLE_HINT}")


def async_wrong_type_error(result: Any) -> RuntimeError:
    """torch's error for an ``@async_execution`` function that returned ``result``, no Future.

    Example::

        >>> str(async_wrong_type_error(1))[:62]
        'Functions decorated with @rpc.async_function must return a tor'
    """
    return RuntimeError(
        "Functions decorated with @rpc.async_function must return a "
        f"torch.futures.Future object, but got {type(result)}"
    )


def print_user_error(exc: Exception, where: Any) -> None:
    """Print the error that a user function raised on this callee to its ``sys.stderr``,
    as torch's callee does (its caller gets the same text): the callee's log shows
    which of its calls failed. ``where``: this worker's ``WorkerInfo``.
    """
    print(remote_error(exc, where)[1], file=sys.stderr)
