"""Per-process RRef bookkeeping: owned values, the forks users hold, live user RRefs.

Fork messages from different workers reach an owner in any order: a fork's
delete may overtake its registration (then the registration is dropped on
arrival), and a request for a value may overtake the request that creates it
(then the owner keeps the awaited entry until the value is set).

A user that hands its RRef to another worker (the *child*) tells the owner
first; the owner, once it has registered the child's fork, confirms it to the
child (an RREF_CONFIRM frame). As in torch, a request whose arguments hold such
forks runs once the owner has confirmed them (unpickling such a fork adds its
confirmation to the request's ``UnpicklingContext``, which the serving side waits for),
so ``confirmed_by_owner()`` is True inside the function.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, NamedTuple

import torch

from .._calls import dispatch
from .._calls.one_way import register_one_way
from .._calls.worker_info import WorkerInfo
from .._transport import Kind


def guid_str(guid: tuple[int, int]) -> str:
    return f"GloballyUniqueId(created_on={guid[0]}, local_id={guid[1]})"


class OwnerEntry:
    """The owner's record of one value: its future and its live forks."""

    __slots__ = ("rref_id", "future", "forks", "__weakref__")

    def __init__(self, rref_id: tuple[int, int]):
        self.rref_id = rref_id
        self.future: torch.futures.Future = torch.futures.Future()
        self.forks: set[tuple[int, int]] = set()


class UserState:
    """What a user reference knows about its remote value."""

    __slots__ = (
        "owner",
        "rref_id",
        "fork_id",
        "creation",
        "confirmed",
        "deleted",
        "type_future",
    )

    def __init__(
        self,
        owner: WorkerInfo,
        rref_id,
        fork_id,
        confirmed: bool,
        creation: torch.futures.Future | None = None,
    ):
        self.owner = owner
        self.rref_id = rref_id
        self.fork_id = fork_id
        self.creation = creation
        self.confirmed = confirmed
        self.deleted = False
        self.type_future: torch.futures.Future | None = None  # of the value's type


class RRefContext:
    """Per-process RRef bookkeeping: owned values, their forks, live users."""

    def __init__(self, worker_id: int):
        self.worker_id = worker_id
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.owners: dict[tuple, OwnerEntry] = {}  # values that have live forks
        self._local: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        # Entries whose value requests wait for (its creation included), until it is set.
        self._awaited: dict[tuple, OwnerEntry] = {}
        self._early_deletes: set[tuple] = set()
        self._users: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        # Forks received from a user that await the owner's confirmation, by fork id,
        # and confirmations that came before their fork.
        self._unconfirmed: dict[tuple, tuple[UserState, torch.futures.Future]] = {}
        self._confirmed_early: set[tuple] = set()

    def new_guid(self) -> tuple[int, int]:
        return (self.worker_id, next(self._ids))

    def new_entry(self, rref_id=None) -> OwnerEntry:
        entry = OwnerEntry(rref_id or self.new_guid())
        self._local[entry.rref_id] = entry
        return entry

    def entry(self, rref_id) -> OwnerEntry:
        """The owner entry for ``rref_id``, for a request that waits for its value.

        Created (pending) if unknown yet. Until :meth:`value_set`, a pending entry is
        held here: the creation finds its entry by id, and may come after every
        other reference to the entry is gone (or before any exists).
        """
        with self._lock:
            entry = self.owners.get(rref_id) or self._local.get(rref_id)
            if entry is None:
                entry = OwnerEntry(rref_id)
                self._local[rref_id] = entry
            if not entry.future.done():
                self._awaited[rref_id] = entry
            return entry

    def value_set(self, entry: OwnerEntry) -> None:
        """Call once ``entry.future`` is done: no waiting request needs it held."""
        with self._lock:
            self._awaited.pop(entry.rref_id, None)

    def add_fork(self, rref_id, fork_id) -> bool:
        """Register a fork; False if its delete came first (it is gone already)."""
        key = (rref_id, fork_id)
        with self._lock:
            if key in self._early_deletes:
                self._early_deletes.discard(key)
                return False
            entry = self.owners.get(rref_id) or self._local.get(rref_id)
            if entry is None:
                entry = OwnerEntry(rref_id)
                self._local[rref_id] = entry
            entry.forks.add(fork_id)
            self.owners[rref_id] = entry
            return True

    def del_fork(self, rref_id, fork_id) -> None:
        with self._lock:
            entry = self.owners.get(rref_id)
            if entry is None or fork_id not in entry.forks:
                self._early_deletes.add((rref_id, fork_id))
                return
            entry.forks.discard(fork_id)
            if not entry.forks:
                del self.owners[rref_id]
        del entry  # the value may be freed here, outside the lock

    def consume_fork(self, rref_id, fork_id) -> OwnerEntry:
        """Turn a fork that came back to its owner into the owner's own reference."""
        with self._lock:
            entry = self.owners.get(rref_id)
            if entry is None or fork_id not in entry.forks:
                raise RuntimeError(
                    f"RRef {guid_str(rref_id)} with fork {guid_str(fork_id)} is unknown on its "
                    "owner: it was deleted before it arrived"
                )
            entry.forks.discard(fork_id)
            if not entry.forks:
                del self.owners[rref_id]
            return entry

    def await_confirmation(self, state: UserState) -> torch.futures.Future | None:
        """A fork received from a user: the future its owner's confirmation completes
        (None if that came first, and ``state`` is confirmed now)."""
        with self._lock:
            if state.fork_id in self._confirmed_early:
                self._confirmed_early.discard(state.fork_id)
                state.confirmed = True
                return None
            future: torch.futures.Future = torch.futures.Future()
            self._unconfirmed[state.fork_id] = (state, future)
            return future

    def confirm(self, fork_id) -> None:
        """The owner has registered fork ``fork_id`` of this worker."""
        with self._lock:
            pending = self._unconfirmed.pop(fork_id, None)
            if pending is None:
                self._confirmed_early.add(fork_id)
                return
        state, future = pending
        state.confirmed = True
        future.set_result(None)

    def track_user(self, rref: Any) -> None:
        """Keep a weak reference to user RRef ``rref`` until shutdown deletes it."""
        self._users[rref._user.fork_id] = rref

    def delete_all_users(self, agent) -> None:
        """Graceful shutdown: tell owners that every user reference here is gone."""
        for rref in list(self._users.values()):
            rref._delete(agent)

    def debug_info(self) -> dict[str, int]:
        with self._lock:
            entries = list(self.owners.values())
            entries += [e for k, e in self._awaited.items() if k not in self.owners]
        users = list(self._users.values())
        return {
            "num_owner_rrefs": len(entries),
            "num_pending_futures": sum(not e.future.done() for e in entries),
            # As torch's: a user whose creation failed (or timed out) is no longer pending.
            "num_pending_users": sum(_pending_user(r._user) for r in users),
            "num_forks": sum(len(e.forks) for e in entries),
        }

    def add_arrival_forks(self, forks: tuple) -> None:
        """Register the forks a frame carries, before it or any later frame runs."""
        for rref_id, fork_id in forks:
            self.add_fork(rref_id, fork_id)


def _pending_user(state: UserState) -> bool:
    """Whether a user reference still waits for its owner's confirmation."""
    if state.confirmed:
        return False
    creation = state.creation
    if creation is None or not creation.done():
        return True
    try:
        creation.wait()
    except Exception:  # failed: it will never be confirmed
        return False
    state.confirmed = True
    return False


class ForkChange(NamedTuple):
    """RREF_FORK body: a user fork of one of this worker's RRefs was added or deleted;
    ``child``: the worker an added fork was sent to, which the owner confirms it to."""

    rref_id: tuple
    fork_id: tuple
    added: bool
    child: int = -1


class ForkConfirmed(NamedTuple):
    """RREF_CONFIRM body: the owner has registered this fork of the receiver's."""

    fork_id: tuple


def _on_fork_change(source: int, body: ForkChange, tensors: list) -> None:
    context = require_context()
    if not body.added:
        context.del_fork(body.rref_id, body.fork_id)
    elif context.add_fork(body.rref_id, body.fork_id) and body.child >= 0:
        agent = dispatch.require_agent()
        agent.send_one_way(body.child, Kind.RREF_CONFIRM, ForkConfirmed(body.fork_id))


def _on_fork_confirmed(source: int, body: ForkConfirmed, tensors: list) -> None:
    require_context().confirm(body.fork_id)


register_one_way(Kind.RREF_FORK, ForkChange, _on_fork_change)
register_one_way(Kind.RREF_CONFIRM, ForkConfirmed, _on_fork_confirmed)


_context: RRefContext | None = None


def init_context(worker_id: int) -> RRefContext:
    global _context
    _context = RRefContext(worker_id)
    return _context


def current_context() -> RRefContext | None:
    """The running session's bookkeeping (None when RPC is not running)."""
    return _context


def require_context() -> RRefContext:
    dispatch.require_agent()
    assert _context is not None
    return _context
