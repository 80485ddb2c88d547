"""The transport's private communicators, and what becomes of them when it stops.

All are duplicates of the user's communicator, so no one else's traffic can match ours:
``ctrl`` carries frames (probed with ANY_SOURCE), ``data`` carries tensor bytes matched by
exact (source, tag), ``push`` the control messages of pushed tensors (see ``direct_writes``),
``coll`` the shutdown collectives.
"""

from __future__ import annotations

from mpi4py import MPI

#: Communicators of stopped transports that may still receive stale messages (see
#: :meth:`Communicators.free`): kept for the life of the process.
_UNDRAINED: list[MPI.Comm] = []


class Communicators:
    """``ctrl``, ``data``, ``push`` and ``coll`` over the ranks of ``comm`` (a collective);
    ``tag_mod``: message tags wrap around at this bound (MPI's ``TAG_UB`` + 1, at most
    2**20).

    Example::

        >>> comms = Communicators(MPI.COMM_SELF)
        >>> comms.ctrl.Get_size(), comms.tag_mod > 0
        (1, True)
        >>> comms.free(drained=True)
    """

    def __init__(self, comm: MPI.Comm):
        self.ctrl = comm.Dup()
        self.data = comm.Dup()
        self.push = comm.Dup()
        self.coll = comm.Dup()
        self.tag_mod = min((self.ctrl.Get_attr(MPI.TAG_UB) or 32767) + 1, 1 << 20)

    def free(self, drained: bool) -> None:
        """Release the communicators; ``drained``: no frame can still be in flight to or
        from this rank on them (a graceful shutdown made sure of it).

        Otherwise they are kept, never freed: MPI reuses a freed communicator's context
        id for the next ``Dup``, and messages still arriving for the old one (a peer's
        requests after a ``shutdown(graceful=False)``, a timed-out collective) would be
        received by the next ``init_rpc``'s agent as its own.
        """
        comms = (self.ctrl, self.data, self.push, self.coll)
        if drained:
            for comm in comms:
                comm.Free()
        else:
            _UNDRAINED.extend(comms)
