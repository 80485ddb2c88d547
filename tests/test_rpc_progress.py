"""The progress loop's polling against a communicator that probes the way MPICH does."""

from __future__ import annotations

from mpi4py import MPI

from lightning_distgrad.rpc._transport import Transport
from lightning_distgrad.rpc._wire import Frame

CONTROL = 2


class _Message:
    def __init__(self, raw: bytes):
        self.raw = raw

    def Recv(self, buf) -> None:  # noqa: N802 - mpi4py's name
        buf[0][:] = self.raw


class _MatchBeforeProgressComm:
    """``Improbe`` as MPICH 5 does it: look for a match, then make progress.

    A frame that arrived while the poller slept reaches the matching queue
    during the first call, which therefore reports nothing; the second call
    finds it.
    """

    def __init__(self, raw: bytes):
        self.in_flight: bytes | None = raw
        self.matchable: bytes | None = None
        self.calls = 0

    def Improbe(self, source: int, tag: int, status: MPI.Status):  # noqa: N802
        self.calls += 1
        if self.matchable is None:
            self.matchable, self.in_flight = self.in_flight, None  # progress
            return None
        raw, self.matchable = self.matchable, None
        status.Set_source(0)
        status.Set_tag(0)
        status.Set_elements(MPI.BYTE, len(raw))
        return _Message(raw)


def test_one_poll_after_a_nap_delivers_a_frame_that_the_first_probe_misses():
    delivered = []
    transport = Transport(MPI.COMM_SELF, lambda source, frame, tensors: delivered.append(frame))
    own_ctrl = transport.ctrl
    late = transport.ctrl = _MatchBeforeProgressComm(Frame(CONTROL, -1, b"", (), "body").dumps())
    try:
        # One wake-up of the progress thread is one call; the frame must not wait
        # for the next one (a whole nap later).
        assert transport._locked_progress_once()
        assert [(f.kind, f.autograd) for f in delivered] == [(CONTROL, "body")]
        # With nothing in flight a poll stops after the second empty probe.
        late.calls = 0
        assert not transport._locked_progress_once()
        assert late.calls == 2
    finally:
        transport.ctrl = own_ctrl
        transport.free()
