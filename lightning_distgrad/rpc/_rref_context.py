"""Per-process RRef bookkeeping: owned values, the forks users hold, live user RRefs.

Fork messages from different workers reach an owner in any order: a fork's
delete may overtake its registration (then the registration is dropped on
arrival), and a request for a value may overtake the request that creates it
(then the owner keeps the awaited entry until the value is set).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import TYPE_CHECKING, NamedTuple

import torch

from . import _core
from ._agent import WorkerInfo
from ._one_way import register_one_way
from ._wire import Kind

if TYPE_CHECKING:
    from .rref import RRef


def _guid_str(guid: tuple[int, int]) -> str:
    return f"GloballyUniqueId(created_on={guid[0]}, local_id={guid[1]})"


class _OwnerEntry:
    """The owner's record of one value: its future and its live forks."""

    __slots__ = ("rref_id", "future", "forks", "__weakref__")

    def __init__(self, rref_id: tuple[int, int]):
        self.rref_id = rref_id
        self.future: torch.futures.Future = torch.futures.Future()
        self.forks: set[tuple[int, int]] = set()


class _UserState:
    """What a user reference knows about its remote value."""

    __slots__ = ("owner", "rref_id", "fork_id", "creation", "confirmed", "deleted", "type")

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
        self.type = None


class RRefContext:
    """Per-process RRef bookkeeping: owned values, their forks, live users."""

    def __init__(self, worker_id: int):
        self.worker_id = worker_id
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.owners: dict[tuple, _OwnerEntry] = {}  # values that have live forks
        self._local: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        # Entries whose value requests wait for (its creation included), until it is set.
        self._awaited: dict[tuple, _OwnerEntry] = {}
        self._early_deletes: set[tuple] = set()
        self._users: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def new_guid(self) -> tuple[int, int]:
        return (self.worker_id, next(self._ids))

    def new_entry(self, rref_id=None) -> _OwnerEntry:
        entry = _OwnerEntry(rref_id or self.new_guid())
        self._local[entry.rref_id] = entry
        return entry

    def entry(self, rref_id) -> _OwnerEntry:
        """The owner entry for ``rref_id``, for a request that waits for its value.

        Created (pending) if unknown yet. Until :meth:`value_set`, a pending entry is
        held here: the creation finds its entry by id, and may come after every
        other reference to the entry is gone (or before any exists).
        """
        with self._lock:
            entry = self.owners.get(rref_id) or self._local.get(rref_id)
            if entry is None:
                entry = _OwnerEntry(rref_id)
                self._local[rref_id] = entry
            if not entry.future.done():
                self._awaited[rref_id] = entry
            return entry

    def value_set(self, entry: _OwnerEntry) -> None:
        """Call once ``entry.future`` is done: no waiting request needs it held."""
        with self._lock:
            self._awaited.pop(entry.rref_id, None)

    def add_fork(self, rref_id, fork_id) -> None:
        key = (rref_id, fork_id)
        with self._lock:
            if key in self._early_deletes:
                self._early_deletes.discard(key)
                return
            entry = self.owners.get(rref_id) or self._local.get(rref_id)
            if entry is None:
                entry = _OwnerEntry(rref_id)
                self._local[rref_id] = entry
            entry.forks.add(fork_id)
            self.owners[rref_id] = entry

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

    def consume_fork(self, rref_id, fork_id) -> _OwnerEntry:
        """Turn a fork that came back to its owner into the owner's own reference."""
        with self._lock:
            entry = self.owners.get(rref_id)
            if entry is None or fork_id not in entry.forks:
                raise RuntimeError(
                    f"RRef {_guid_str(rref_id)} with fork {_guid_str(fork_id)} is unknown on its "
                    "owner: it was deleted before it arrived"
                )
            entry.forks.discard(fork_id)
            if not entry.forks:
                del self.owners[rref_id]
            return entry

    def track_user(self, rref: RRef) -> None:
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
            "num_pending_users": sum(not r._user.confirmed for r in users),
            "num_forks": sum(len(e.forks) for e in entries),
        }

    def add_arrival_forks(self, forks: tuple) -> None:
        """Register the forks a frame carries, before it or any later frame runs."""
        for rref_id, fork_id in forks:
            self.add_fork(rref_id, fork_id)


class ForkChange(NamedTuple):
    """RREF_FORK body: a user fork of one of this worker's RRefs was added or deleted."""

    rref_id: tuple
    fork_id: tuple
    added: bool


def _on_fork_change(source: int, body: ForkChange, tensors: list) -> None:
    context = _require_context()
    if body.added:
        context.add_fork(body.rref_id, body.fork_id)
    else:
        context.del_fork(body.rref_id, body.fork_id)


register_one_way(Kind.RREF_FORK, ForkChange, _on_fork_change)


_context: RRefContext | None = None


def init_context(worker_id: int) -> RRefContext:
    global _context
    _context = RRefContext(worker_id)
    return _context


def _require_context() -> RRefContext:
    _core.require_agent()
    assert _context is not None
    return _context
