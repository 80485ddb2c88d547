"""The receiving side of the transport: frames probed, validated, and their tensor bytes.

Called only under the transport's lock. A frame is decoded and validated before
any buffer is allocated for it; its tensor bytes are received into fresh (or
pooled) tensors, by MPI or written by their sender (pushed, see ``direct_writes``); a
transfer that does not complete by its deadline is cancelled and its buffers
dropped (those promised to a pushing sender once its DONE came). Tensors mapped to a
GPU are copied there (from an IPC export at once, from their host bytes once they
arrived) and the frame waits until the copies finished (see ``cuda``). Whatever
completes, or fails, is appended to the
``ready`` queue the transport hands over: ``(source, frame, tensors)``, or a
:class:`MalformedFrame` with its ``source`` set.
"""

from __future__ import annotations

import collections
import contextlib
import time

from mpi4py import MPI

from .cuda import DeviceCopies, finished
from .direct_writes import PushReceive, push_tags
from .frames import Frame, FrameLimits, MalformedFrame, decode_frame
from .message_log import active_log
from .receive_buffers import ReceiveBufferPool
from .tensor_bytes import PUSHED, allocate_tensor, chunks, meta_dtype, tensor_bytes_view


class _Incoming:
    """A frame whose tensor bytes are still arriving (or that waits behind one that is)."""

    __slots__ = (
        "source",
        "frame",
        "tensors",
        "requests",
        "sizes",
        "push",
        "deadline",
        "uploads",
        "copies",
    )

    def __init__(self, source, frame, tensors, requests, sizes, push, deadline, uploads, copies):
        self.source = source
        self.frame = frame
        self.tensors = tensors
        self.requests = requests  # MPI receives of tensor bytes, then ``push``'s requests
        self.sizes = sizes  # bytes expected by each MPI receive
        self.push = push  # PushReceive of the pushed tensors, or None
        self.deadline = deadline
        self.uploads = uploads  # indices of tensors whose host bytes go to a GPU once here
        self.copies = copies  # GPU copies queued (``cuda.Copy``)


_COMPLETE = object()


class Receiver:
    """Probes ``ctrl`` for frames and receives their tensors on ``data``."""

    def __init__(
        self,
        ctrl: MPI.Comm,
        data: MPI.Comm,
        push: MPI.Comm,
        limits: FrameLimits,
        transfer_timeout: float,
        tag_mod: int,
    ):
        self.ctrl = ctrl
        self.push = push
        self.tag_mod = tag_mod
        # Per source rank: frames and bytes received (complete, or abandoned).
        self.received_from = [[0, 0] for _ in range(ctrl.Get_size())]
        # Frames that came with the tag their source's transport gives its next frame to
        # this rank (tags count each pair's frames; see ``sending``), and those next tags:
        # what graceful shutdown compares with the frames agents sent.
        self.in_sequence = 0
        self._next_tag = [0] * ctrl.Get_size()
        self.data = data
        self.limits = limits
        self.transfer_timeout = transfer_timeout
        self.incoming: list[_Incoming] = []
        # Receives cancelled at their deadline, until MPI confirms the cancellation.
        self.cancelled: list[MPI.Request] = []
        # Pushes answered (cleared with their buffers, or refused) but not over: tested
        # until their requests complete; until then a sender may write into the buffers.
        self.promised: list[tuple[PushReceive, list]] = []
        # Senders answered since the transport last rang them (they may nap).
        self.answered: list[int] = []
        self._buffers = ReceiveBufferPool()
        self._copies: DeviceCopies | None = None  # made on the first CUDA tensor
        self._status = MPI.Status()
        self._scratch = bytearray(1)

    def poll(self, ready: collections.deque) -> bool:
        """Take new frames, test transfers; True if anything moved."""
        progressed = self._poll_frames(ready)
        if self.incoming:
            progressed |= self._test_transfers(ready)
        if self.cancelled:
            self.cancelled = [r for r in self.cancelled if not _settled(r)]
        if self.promised:
            self.promised = [p for p in self.promised if not _all_settled(p[0].requests)]
        pool = self._buffers
        if pool.pooled_bytes:
            now = time.monotonic()
            if now >= pool.next_trim:
                pool.trim(now)
        return progressed

    def owns(self, t) -> bool:
        """Whether ``t`` is (a view of) a receive buffer (safe from any thread)."""
        return self._buffers.owns(t)

    def frame_waiting(self) -> bool:
        # Twice: MPICH matches before it makes progress (see _poll_frames).
        return bool(
            self.ctrl.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
            or self.ctrl.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
        )

    def _poll_frames(self, ready: collections.deque) -> bool:
        status = self._status
        progressed = False
        probed_again = False
        while True:
            message = self.ctrl.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            if message is None:
                if progressed or probed_again:
                    return progressed
                # MPICH's Improbe looks for a match before it makes progress, not
                # after: a frame that arrived during a nap shows only at the next call.
                probed_again = True
                continue
            progressed = True
            source, tag = status.Get_source(), status.Get_tag()
            raw = bytearray(status.Get_count(MPI.BYTE))
            # An empty frame (only a peer that is no agent sends one) is received into a
            # scratch byte: an empty bytearray handed to MPI here could be left marked as
            # exported, and freeing it then raises SystemError.
            message.Recv([raw, MPI.BYTE] if raw else [self._scratch, 0, MPI.BYTE])
            received = self.received_from[source]
            received[0] += 1
            if tag == self._next_tag[source]:
                self._next_tag[source] = (tag + 1) % self.tag_mod
                self.in_sequence += 1
            received[1] += len(raw)
            try:
                self._receive(source, tag, raw, ready)
            except MalformedFrame as e:
                e.source = source
                ready.append(e)
                if e.frame is not None and _pushes(e.frame):
                    # Its sender waits for an answer before it writes anything.
                    refusal = PushReceive(self.push, source, push_tags(tag, self.tag_mod), None)
                    self.promised.append((refusal, []))
                    self.answered.append(source)

    def _receive(self, source: int, tag: int, raw: bytearray, ready: collections.deque) -> None:
        if len(raw) > self.limits.max_message_bytes:
            raise MalformedFrame(f"a frame of {len(raw)} bytes is above max_message_bytes")
        frame = decode_frame(raw, self.limits)
        log = active_log()
        if log is not None:
            # As the sender counts: the frame, then the tensor bytes that follow it (inline
            # tensors lie within the frame's bytes).
            after = sum(m[2] for m in frame.metas if m[3] is None or m[3] is PUSHED)
            log.received(frame.kind.name, source, tag, len(raw) + after)
        tensors = []
        pulled = []  # views MPI fills, in the order their sender posted them
        pushed = []
        copies = []
        uploads = []
        try:
            for meta in frame.metas:
                if type(meta[3]) is tuple:  # a CUDA IPC export
                    t, copy = self._import(frame, meta)
                    tensors.append(t)
                    copies.append(copy)
                    continue
                if meta[4] != "cpu":
                    uploads.append(len(tensors))
                t = allocate_tensor(meta, self._buffers)
                tensors.append(t)
                if meta[3] is None:  # not inline: the bytes follow on ``data``
                    self.received_from[source][1] += meta[2]
                    pulled.append(tensor_bytes_view(t))
                elif meta[3] is PUSHED:
                    self.received_from[source][1] += meta[2]
                    pushed.append(tensor_bytes_view(t))
        except MemoryError:
            raise MalformedFrame("no memory for its tensors", frame) from None
        push = None
        if pushed:
            push = PushReceive(self.push, source, push_tags(tag, self.tag_mod), pushed)
            self.answered.append(source)
        requests = []
        sizes = []
        for view in pulled:
            for chunk in chunks(view):
                requests.append(self.data.Irecv([chunk, MPI.BYTE], source, tag))
                sizes.append(chunk.size)
        if push is not None:
            requests += push.requests
        # Frames from one source are handed over in the order they came: one whose
        # bytes are still arriving holds back the later ones.
        if requests or uploads or copies or any(item.source == source for item in self.incoming):
            self.incoming.append(
                _Incoming(
                    source,
                    frame,
                    tensors,
                    requests,
                    sizes,
                    push,
                    time.monotonic() + self.transfer_timeout,
                    uploads,
                    copies,
                )
            )
        else:
            ready.append((source, frame, tensors))

    def _device_copies(self) -> DeviceCopies:
        if self._copies is None:
            self._copies = DeviceCopies()
        return self._copies

    def _import(self, frame: Frame, meta: tuple) -> tuple:
        try:
            return self._device_copies().import_ipc(meta[3], meta_dtype(meta), meta[1], meta[4])
        except RuntimeError as e:  # its sender ended, or the export is not one
            raise MalformedFrame(f"its CUDA IPC export could not be opened ({e})", frame) from None

    def _test_transfers(self, ready: collections.deque) -> bool:
        now = time.monotonic()
        progressed = False
        still = []
        waiting: set[int] = set()  # sources with an earlier frame still arriving
        for item in self.incoming:
            problem = None if item.source in waiting else self._transfer_problem(item, now)
            if problem is None:
                waiting.add(item.source)
                still.append(item)
                continue
            progressed = True
            if problem is _COMPLETE:
                ready.append((item.source, item.frame, item.tensors))
            else:
                error = MalformedFrame(problem, item.frame)
                error.source = item.source
                ready.append(error)
        self.incoming = still
        return progressed

    def _transfer_problem(self, item: _Incoming, now: float) -> object | None:
        """None while the bytes arrive or are copied to their GPU; _COMPLETE once all are
        there; else what went wrong (the transfer is then abandoned and its buffers freed)."""
        if item.requests:
            state = self._bytes_state(item, now)
            if state is not _COMPLETE:
                return state
            item.requests, item.sizes, item.push = [], [], None  # checked: not again
        if item.uploads:
            copies = self._device_copies()
            for i in item.uploads:
                item.tensors[i], copy = copies.upload(item.tensors[i], item.frame.metas[i][4])
                item.copies.append(copy)
            item.uploads = []
        if item.copies:
            if not finished(item.copies):
                return None  # a GPU copy ends by itself: no deadline
            for copy in item.copies:
                copy.release()
            item.copies = []
        return _COMPLETE

    def _bytes_state(self, item: _Incoming, now: float) -> object | None:
        """None while the MPI receives and the push run; _COMPLETE once they did; else
        what went wrong."""
        statuses = [MPI.Status() for _ in item.requests]
        try:
            if not MPI.Request.Testall(item.requests, statuses):
                if now < item.deadline:
                    return None
                self._abandon_item(item)
                return (
                    f"its tensor bytes did not arrive within {self.transfer_timeout:g} s; "
                    "the transfer was abandoned"
                )
        except MPI.Exception as e:
            self._abandon_item(item)
            return f"its tensor bytes could not be received ({e.Get_error_string()})"
        received = [s.Get_count(MPI.BYTE) for s in statuses[: len(item.sizes)]]
        if received != item.sizes:
            return f"it declared {sum(item.sizes)} tensor bytes but {sum(received)} arrived"
        if item.push is not None:
            return item.push.problem() or _COMPLETE
        return _COMPLETE

    def _abandon_item(self, item: _Incoming) -> None:
        """Cancel its MPI receives; pushed buffers stay promised until DONE comes."""
        self._abandon(item.requests[: len(item.sizes)])
        if item.push is not None:
            self.promised.append((item.push, item.tensors))

    def _abandon(self, requests: list[MPI.Request]) -> None:
        """Cancel receives; they are tested until MPI confirms (never waited for)."""
        for request in requests:
            if request != MPI.REQUEST_NULL:
                with contextlib.suppress(MPI.Exception):
                    request.Cancel()
                if not _settled(request):
                    self.cancelled.append(request)


def _pushes(frame: Frame) -> bool:
    """Whether a frame marks any tensor as pushed (its metas may be malformed)."""
    metas = frame.metas if type(frame.metas) is tuple else ()
    return any(type(m) is tuple and len(m) == 5 and m[3] is PUSHED for m in metas)


def _all_settled(requests: list[MPI.Request]) -> bool:
    try:
        return MPI.Request.Testall(requests)
    except MPI.Exception:
        return True


def _settled(request: MPI.Request) -> bool:
    try:
        return request.Test()
    except MPI.Exception:
        return True
