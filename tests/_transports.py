"""Transports built by hand for the tests of the progress engine, which start or poll them
themselves (no agent around them).

Example::

    >>> from mpi4py import MPI
    >>> transport = make_transport(MPI.COMM_SELF)  # doctest: +SKIP
    >>> transport.free()  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_distgrad.rpc._transport import FrameLimits, Transport, local_devices


def make_transport(comm, on_frame: Callable = lambda source, frame, tensors: None) -> Transport:
    """A transport whose progress thread is not started (tests poll it by hand)."""
    return Transport(
        comm,
        on_frame,
        lambda source, error: None,
        limits=FrameLimits(1 << 30, local_devices()),
        transfer_timeout=60.0,
    )
