"""One-way message kinds: a typed body, tensors, and nobody answers.

The modules that own a kind register its handler here at import time (RRef
bookkeeping, distributed autograd); the agent routes frames by kind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from .._transport import Kind


class OneWay(NamedTuple):
    """How a one-way kind is received (see :func:`register_one_way`)."""

    body_type: type
    handler: Callable[[int, Any, list], None]
    serve: bool
    waiter_key: Callable[[Any], Any] | None


HANDLERS: dict[Kind, OneWay] = {}


def register_one_way(
    kind: Kind,
    body_type: type,
    handler: Callable[[int, Any, list], None],
    *,
    serve: bool = False,
    waiter_key: Callable[[Any], Any] | None = None,
) -> None:
    """Route frames of ``kind`` to ``handler(source, body, tensors)``.

    ``body_type`` is a NamedTuple; the body travels as a plain tuple and is rebuilt
    (and its field count checked) on arrival. Not served: applied on arrival, in
    order, on the polling thread; it must not block. Served: run like a request; one
    whose ``waiter_key(body)`` a thread waits for (``Waiting.wait``) runs on
    that thread.
    """
    HANDLERS[kind] = OneWay(body_type, handler, serve, waiter_key)
