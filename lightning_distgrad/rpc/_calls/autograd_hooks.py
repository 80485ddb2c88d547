"""The seam between RPC and distributed autograd.

RPC must not import autograd (imports flow autograd -> rpc), yet every message
may carry an autograd context. ``lightning_distgrad.autograd`` installs its
implementation of :class:`AutogradHooks` at import; until then RPC carries no
contexts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class AutogradHooks:
    """No-op hooks: what RPC does when distributed autograd is not loaded."""

    def on_init(self, worker_id: int) -> None:
        """Called by ``init_rpc`` before the agent accepts messages."""

    def on_shutdown(self) -> None:
        """Called by ``shutdown`` after the agent stopped."""

    def outgoing(
        self,
        dst_id: int,
        tensors: list[torch.Tensor],
        force: bool,
        ctx_id: int | None = None,
        *,
        operator: bool = False,
        call_id: int | None = None,
    ) -> Any:
        """Record a send function for a message to ``dst_id``; returns its metadata or None.

        ``ctx_id`` is given for responses (the request's context, and ``call_id`` the
        request's) and None for requests (the calling thread's current context);
        ``operator``: the request calls a torch operator.
        """
        return None

    def incoming(
        self, meta: Any, src_id: int, tensors: list[torch.Tensor], call_id: int | None = None
    ) -> list[torch.Tensor]:
        """Attach a recv function to received ``tensors``; returns the tensors to use.
        ``call_id``: the request's, for a request."""
        return tensors

    def context_of(self, meta: Any) -> int | None:
        """The autograd context id carried by ``meta`` (None if none)."""
        return None

    def current_context(self) -> int | None:
        """The calling thread's current autograd context id (None if none)."""
        return None

    def call_in(self, ctx_id: int | None, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` (a request) with ``ctx_id`` as this thread's current context."""
        return fn(*args)

    def debug_info(self) -> dict[str, int]:
        """Distributed autograd's figures for ``rpc._get_debug_info`` (none when not loaded)."""
        return {}

    def backward(self, ctx_id: int, roots: list[torch.Tensor], retain_graph: bool) -> None:
        raise RuntimeError("lightning_distgrad.autograd is not loaded")


def with_grad(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with grad mode on; enters ``torch.enable_grad()`` only when it is
    off (per message, the context manager cost as much as the work it wrapped)."""
    if torch.is_grad_enabled():
        return fn(*args)
    with torch.enable_grad():
        return fn(*args)


_hooks: AutogradHooks = AutogradHooks()


def get() -> AutogradHooks:
    return _hooks


def install(hooks: AutogradHooks) -> None:
    global _hooks
    _hooks = hooks
