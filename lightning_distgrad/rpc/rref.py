"""Remote references: ``RRef`` and the owner-side reference counting.

The owner keeps a value alive while any user reference (a *fork*) exists
anywhere. Forks are registered with the owner before they can be deleted:

* the owner registers a fork it hands out at once (early registration);
* a user sending an RRef to its owner lists the new fork in the message frame,
  and the owner registers it on arrival, in order, before any later delete
  from that user is applied;
* a user sending an RRef to a third worker first sends the owner an
  ``add_fork`` control frame, again ahead of its own later delete; a delete
  that overtakes its registration (it came from the third worker) leaves a
  tombstone that cancels the registration.

So a user that hands an RRef on and drops its own copy at once never makes the
owner drop the value too early, and the owner drops it when the last fork is
deleted.

Frames from different workers arrive in no particular order, so a request for
the value (``to_here`` from a user the creator handed the RRef to) may reach
the owner before the ``remote()`` that creates it. A request that waits for a
value keeps the owner's entry alive until the value is set, so the creation
finds that entry and sets the value the request waits for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from ._calls import autograd_hooks, dispatch
from ._calls.errors import timeout_error
from ._calls.payload import current_pickling_context, current_unpickling_context
from ._calls.spans import run_recorded
from ._calls.worker_info import WorkerInfo
from ._rrefs.bookkeeping import (
    ForkChange,
    OwnerEntry,
    RRefContext,
    UserState,
    current_context,
    guid_str,
    require_context,
)
from ._rrefs.owner_side import (
    _create_owner_value,
    _rref_backward,
    _rref_fetch,
    _rref_typeof_on_owner,
)
from ._rrefs.proxies import Proxy
from ._transport import Kind

__all__ = ["RRef"]

T = TypeVar("T")


def _rebuild_rref(owner: WorkerInfo, rref_id, fork_id, confirmed: bool) -> RRef:
    context = require_context()
    if owner.id == context.worker_id:
        return RRef._from_entry(context.consume_fork(rref_id, fork_id))
    state = UserState(owner, rref_id, fork_id, confirmed)
    if not confirmed:  # handed on by a user: the owner confirms it once registered
        confirmation = context.await_confirmation(state)
        unpickling = current_unpickling_context()
        if confirmation is not None and unpickling is not None:
            unpickling.confirmations.append(confirmation)  # the request runs once confirmed
    return RRef._from_user(state)


def _done_future(value: Any) -> torch.futures.Future:
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(value)
    return done


class RRef(Generic[T]):
    r"""A reference to a value that lives on one worker (its *owner*).

    ``RRef(value)`` makes a local reference; :func:`lightning_distgrad.rpc.remote`
    returns references to values created on other workers. An RRef can be passed
    in RPC arguments and results; the owner keeps the value until the last
    reference anywhere is deleted.

    Example::
        Run with ``mpiexec -n 2 python -m mpi4py example.py``:

        >>> # xdoctest: +SKIP
        >>> import torch
        >>> import lightning_distgrad.rpc as rpc
        >>> # On worker 0:
        >>> rpc.init_rpc()
        >>> rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 3))
        >>> rref.to_here()
        tensor([4., 4.])
        >>> rref.rpc_sync().size()
        torch.Size([2])
        >>> rpc.shutdown()
    """

    __slots__ = ("_entry", "_user", "_creation", "_context", "__weakref__")

    def __init__(self, value: T, type_hint: Any = None):
        dispatch.require_agent(dispatch.AGENT_NOT_SET)
        context = require_context()
        entry = context.new_entry()
        entry.future.set_result(value)
        self._entry: OwnerEntry | None = entry
        self._user: UserState | None = None
        self._creation: torch.futures.Future | None = None
        self._context: RRefContext = context

    @classmethod
    def _from_entry(cls, entry: OwnerEntry, creation=None) -> RRef:
        rref = cls.__new__(cls)
        rref._entry, rref._user, rref._creation = entry, None, creation
        rref._context = require_context()
        return rref

    @classmethod
    def _from_user(cls, state: UserState) -> RRef:
        rref = cls.__new__(cls)
        rref._entry, rref._user, rref._creation = None, state, state.creation
        rref._context = require_context()
        rref._context.track_user(rref)
        return rref

    def _live_context(self) -> RRefContext:
        """The bookkeeping of this RRef's RPC session, which must still be running: ids
        start again with each ``init_rpc``, so in a later session this RRef's ids would
        name other values."""
        context = require_context()
        if context is not self._context:
            raise RuntimeError(
                f"{self} belongs to an RPC session that has been shut down: an RRef cannot "
                "be used after rpc.shutdown(), even once init_rpc has started RPC again"
            )
        return context

    # -- identity ---------------------------------------------------------------

    def is_owner(self) -> bool:
        """Whether this worker owns the value."""
        return self._entry is not None

    def owner(self) -> WorkerInfo:
        """The ``WorkerInfo`` of the owner."""
        if self._user is not None:
            return self._user.owner
        return dispatch.require_agent().info

    def owner_name(self) -> str:
        """The name of the owner."""
        return self.owner().name

    def confirmed_by_owner(self) -> bool:
        """Whether the owner is known to hold this reference (always True on the owner)."""
        if self._user is None:
            return True
        creation = self._creation
        if not self._user.confirmed and creation is not None and creation.done():
            try:
                creation.wait()
                self._user.confirmed = True
            except Exception:
                pass
        return self._user.confirmed

    def _rref_id(self):
        return self._entry.rref_id if self._entry is not None else self._user.rref_id

    def __repr__(self) -> str:
        if self._user is None:
            return f"OwnerRRef({guid_str(self._rref_id())})"
        return (
            f"UserRRef(RRefId = {guid_str(self._user.rref_id)}, "
            f"ForkId = {guid_str(self._user.fork_id)})"
        )

    # -- values -----------------------------------------------------------------

    def local_value(self) -> T:
        """The value itself; only on the owner."""
        if self._user is not None:
            me = dispatch.require_agent().info
            raise RuntimeError(
                f"For UserRRef(rref_id={guid_str(self._user.rref_id)}, "
                f"fork_id={guid_str(self._user.fork_id)}), can't call localValue() on user "
                f"{me}. Call it on owner {self._user.owner}"
            )
        return self._entry.future.wait()

    def to_here(self, timeout: float = dispatch.UNSET_RPC_TIMEOUT) -> T:
        """The value: itself on the owner, a copy fetched from the owner elsewhere.

        Inside a distributed autograd context the fetch is recorded, so
        gradients flow back to the owner's value.
        """
        timeout = dispatch.check_timeout(timeout)
        if self._user is None:
            return self._entry.future.wait()
        if self._user.deleted:
            raise RuntimeError(
                f"{self} has been deleted. Cannot call to_here() on it after deletion."
            )
        self._live_context()
        return run_recorded(self._to_here_span, self._fetch, timeout)

    def _to_here_span(self) -> tuple[str, None]:
        caller, owner = dispatch.require_agent().info.name, self._user.owner.name
        return f"to_here#({caller})->({owner})", None  # torch's name

    def _fetch(self, timeout: float) -> T:
        """The value, from its owner (a user's ``to_here``)."""
        # The creation's answer first: a creation that failed before it ran (its
        # request could not be read on the owner) leaves nothing there to fetch.
        self._raise_if_creation_failed(timeout)
        value = dispatch.wait(
            dispatch.invoke(
                self._user.owner,
                _rref_fetch,
                (self._user.rref_id,),
                None,
                timeout,
                user_visible=False,
                profile="sync",
            )
        )
        self._user.confirmed = True
        return value

    def _raise_if_creation_failed(self, timeout: float) -> None:
        creation = self._creation
        if creation is None:
            return
        agent = dispatch.require_agent()
        if timeout == dispatch.UNSET_RPC_TIMEOUT:
            timeout = agent.timeout
        if not agent.waiting.wait(creation, timeout):
            raise timeout_error(timeout, self.owner())
        try:
            creation.wait()
        except RuntimeError as e:
            if "RPC ran for more than" in str(e):
                owner = self.owner()
                raise RuntimeError(
                    "RRef creation via rpc.remote() timed out, and it is possible that the "
                    f"RRef on the owner node does not exist. (owner: {owner.name}, "
                    f"rank {owner.id})"
                ) from e
            raise

    def _get_future(self) -> torch.futures.Future:
        """The future of the ``remote()`` call that created this RRef."""
        if self._creation is None:
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(None)
            return done
        return self._creation

    def _get_profiling_future(self) -> torch.futures.Future:
        """The future of the ``remote()`` call that created this RRef, completed once a
        profiler recording that call has recorded its end (torch's RRef method)."""
        return self._get_future()

    def _get_type(self, timeout: float = dispatch.UNSET_RPC_TIMEOUT, blocking: bool = True):
        """The type of the value (a future of it with ``blocking=False``), as torch's.

        On a user it is asked of the owner, which answers once the value is set, within
        ``timeout``; the answer is kept (``blocking=False`` returns the same future each
        time), a failed one is not.
        """
        timeout = dispatch.check_timeout(timeout)
        if self._user is None:
            value_type = type(self._entry.future.wait())
            return value_type if blocking else _done_future(value_type)
        self._live_context()
        state = self._user
        future = state.type_future
        if future is None:
            future = dispatch.invoke(
                state.owner,
                _rref_typeof_on_owner,
                (state.rref_id,),
                None,
                timeout,
                user_visible=not blocking,
                profile="async",
            )
            state.type_future = future

            def forget_failure(f: torch.futures.Future) -> None:
                try:
                    f.wait()
                except Exception:  # a later call asks again (the value may exist by then)
                    if state.type_future is f:
                        state.type_future = None

            future.add_done_callback(forget_failure)
        return dispatch.wait(future) if blocking else future

    # -- proxies ----------------------------------------------------------------

    def rpc_sync(self, timeout: float = dispatch.UNSET_RPC_TIMEOUT) -> Any:
        """A proxy whose method calls run on the owner with ``rpc_sync``."""
        return Proxy(self, "sync", timeout)

    def rpc_async(self, timeout: float = dispatch.UNSET_RPC_TIMEOUT) -> Any:
        """A proxy whose method calls run on the owner with ``rpc_async``."""
        return Proxy(self, "async", timeout)

    def remote(self, timeout: float = dispatch.UNSET_RPC_TIMEOUT) -> Any:
        """A proxy whose method calls run on the owner with ``remote``."""
        return Proxy(self, "remote", timeout)

    # -- autograd ---------------------------------------------------------------

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Run backward from the value (a scalar tensor), on its owner.

        With ``dist_autograd_ctx_id=-1`` on the owner this is a local
        ``torch.autograd.backward``; otherwise a distributed backward pass in
        that context.
        """
        if self._user is not None:
            if dist_autograd_ctx_id == -1:
                raise RuntimeError("User RRefs require 'dist_autograd_ctx_id' to be specified")
            self._live_context()
            dispatch.wait(
                dispatch.invoke(
                    self._user.owner,
                    _rref_backward,
                    (self, dist_autograd_ctx_id, retain_graph),
                    None,
                    dispatch.UNSET_RPC_TIMEOUT,
                    user_visible=False,
                )
            )
            return
        value = self._entry.future.wait()
        if not isinstance(value, torch.Tensor):
            raise RuntimeError("RRef should contain a tensor for .backward()")
        if dist_autograd_ctx_id == -1:
            torch.autograd.backward([value], retain_graph=retain_graph)
        else:
            autograd_hooks.get().backward(dist_autograd_ctx_id, [value], retain_graph)

    @classmethod
    def _create_remote(cls, to: Any, func: Callable, args, kwargs, timeout: float) -> RRef:
        """``rpc.remote``: run ``func`` on ``to`` and return a reference to its result."""
        timeout = dispatch.check_timeout(timeout)
        agent = dispatch.require_agent()
        dst = dispatch.resolve(agent, to)
        if not callable(func):
            raise TypeError("function should be callable.")
        context = require_context()
        rref_id = context.new_guid()
        packed = (rref_id, func, tuple(args or ()), dict(kwargs or {}))
        force = not dispatch.is_builtin(func)
        local = dst.id == agent.info.id
        entry = context.new_entry(rref_id) if local else None
        fork_id = None if local else context.new_guid()
        creation = dispatch.invoke(
            dst,
            _create_owner_value,
            packed,
            None,
            timeout,
            user_visible=False,
            force_autograd=force,
            arrival_forks=None if local else [(rref_id, fork_id)],
            profile="remote",
            profiled_func=func,
        )
        if local:
            return cls._from_entry(entry, creation)
        return cls._from_user(UserState(dst, rref_id, fork_id, False, creation))

    # -- pickling and lifetime ----------------------------------------------------

    def __reduce__(self):
        pctx = current_pickling_context()
        if pctx is None:
            raise RuntimeError(
                "Can not pickle rref in python pickler, rref can only be pickled when using RPC"
            )
        agent = dispatch.require_agent()
        context = self._live_context()
        fork_id = context.new_guid()
        owner = self.owner()
        # A fork is registered only once its message is certain to be sent
        # (pctx.on_send runs after the whole message pickled): a fork in a
        # message that fails to pickle must leave nothing on the owner.
        if self._user is None:
            entry = self._entry  # the closure keeps it alive until registered
            pctx.on_send.append(lambda: context.add_fork(entry.rref_id, fork_id))  # early
            return (_rebuild_rref, (owner, entry.rref_id, fork_id, True))
        if self._user.deleted:
            raise RuntimeError("Cannot call fork an UserRRef after deletion.")
        rref_id = self._user.rref_id
        if pctx.dst_id == owner.id:
            pctx.arrival_forks.append((rref_id, fork_id))
        else:
            pctx.on_send.append(
                lambda: agent.send_one_way(
                    owner.id, Kind.RREF_FORK, ForkChange(rref_id, fork_id, True, pctx.dst_id)
                )
            )
        return (_rebuild_rref, (owner, rref_id, fork_id, False))

    def _delete(self, agent, soon: bool = False) -> None:
        """Tell the owner this user reference is gone; ``soon``: from the polling thread
        (``__del__`` may run inside the transport's lock, during a collection)."""
        state = self._user
        if state is None or state.deleted:
            return
        state.deleted = True
        send = functools.partial(
            agent.send_one_way,
            state.owner.id,
            Kind.RREF_FORK,
            ForkChange(state.rref_id, state.fork_id, False),
        )
        if soon:
            agent.transport.call_soon(send)
        else:
            send()

    def __del__(self) -> None:
        # getattr: ``RRef(value)`` before init_rpc raises in __init__, before
        # _user is set, and __del__ still runs on the half-built object.
        user = getattr(self, "_user", None)
        if user is None or user.deleted:
            return
        agent = dispatch.current_agent()
        # Only into its own session: a later one's owners know nothing of this fork.
        if agent is not None and current_context() is self._context:
            try:
                self._delete(agent, soon=True)
            except Exception:  # interpreter teardown: nothing left to tell
                pass
