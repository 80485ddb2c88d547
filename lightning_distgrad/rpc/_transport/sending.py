"""The sending side of the transport: frames and tensor bytes posted, pushes written.

Called only under the transport's lock, except :meth:`Sender.write`. A message
is one frame on ``ctrl`` and its tensor bytes on ``data``, all with the next tag
of its destination, so the receiver matches them by exact (source, tag); tensors
that its destination lets this rank write are pushed instead (see ``direct_writes``).
A message's source buffers stay referenced until every send of it completed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from mpi4py import MPI

from .cuda import Exporter, describe_cuda_tensor, ipc_peers
from .direct_writes import PushSend, push_tags, should_push, writable_peers
from .frames import Frame
from .message_log import active_log
from .tensor_bytes import PUSHED, chunks, describe_host_tensor, tensor_bytes_view


class Sender:
    """Posts messages to the ranks of ``ctrl`` and drives them to completion."""

    def __init__(
        self,
        ctrl: MPI.Comm,
        data: MPI.Comm,
        push: MPI.Comm,
        transfer_timeout: float,
        tag_mod: int,
        cuda_ranks: frozenset[int],
    ):
        self.ctrl, self.data, self.push = ctrl, data, push
        self.transfer_timeout = transfer_timeout
        self.tag_mod = tag_mod
        size = ctrl.Get_size()
        self.push_pids = writable_peers(ctrl)  # peers whose buffers this rank writes
        # Peers that import our CUDA tensors over CUDA IPC (``cuda_ranks`` is the same on
        # every rank, so all or none take part in the probe).
        self.ipc_peers = ipc_peers(ctrl, cuda_ranks) if cuda_ranks else frozenset()
        self._exporter = Exporter()
        self.next_seq = [0] * size
        self.frames_sent = 0
        self.sent_to = [[0, 0] for _ in range(size)]  # per peer: frames, bytes
        # Per message: (MPI requests, what they send from, PushSend or None).
        self.sends: list[tuple[list[MPI.Request], object, PushSend | None]] = []
        self.writes: list[PushSend] = []  # cleared pushes, for the polling thread

    def split(
        self,
        dst: int,
        frame: Frame,
        tensors: list[torch.Tensor],
        devices: list[str] | None,
        owned: Callable[[torch.Tensor], bool],
    ) -> tuple[bytes, list, list]:
        """(frame bytes, tensors sent by MPI, tensors pushed) of a message to ``dst``.

        ``devices``: each tensor's device on ``dst``; None: all are CPU tensors that land on
        the CPU. Takes no lock. ``owned(t)``: whether ``t`` is a receive buffer (pulled).
        """
        buffers, pushed, metas = [], [], []
        push = dst in self.push_pids
        if devices is None:  # CPU tensors landing on the CPU: no device work
            described = map(describe_host_tensor, tensors)
        else:
            exporter = self._exporter if dst in self.ipc_peers else None
            described = (
                describe_host_tensor(t, d) if t.is_cpu else describe_cuda_tensor(t, d, exporter)
                for t, d in zip(tensors, devices, strict=True)
            )
        for meta, data in described:
            if data is not None:
                if push and should_push(data.nbytes, owned(data)):
                    meta = (*meta[:3], PUSHED, meta[4])
                    pushed.append(data)
                else:
                    buffers.append(data)
            metas.append(meta)
        return frame.dumps(tuple(metas)), buffers, pushed

    def post(self, dst: int, raw: bytes, buffers: list, kind: str, pushed: list) -> None:
        """Post one message's frame bytes, then each buffer's bytes; set up its push."""
        seq = self.next_seq[dst]
        self.next_seq[dst] = seq + 1
        tag = seq % self.tag_mod
        self.frames_sent += 1
        nbytes = len(raw) + sum(t.nbytes for t in buffers) + sum(t.nbytes for t in pushed)
        sent = self.sent_to[dst]
        sent[0] += 1
        sent[1] += nbytes
        log = active_log()
        if log is not None:
            log.sent(kind, dst, tag, nbytes)
        requests = [self.ctrl.Isend([raw, MPI.BYTE], dst, tag)]
        for t in buffers:
            for chunk in chunks(tensor_bytes_view(t)):
                requests.append(self.data.Isend([chunk, MPI.BYTE], dst, tag))
        push = None
        if pushed:
            push = PushSend(
                self.push,
                dst,
                self.push_pids[dst],
                [tensor_bytes_view(t) for t in pushed],
                push_tags(tag, self.tag_mod),
                time.monotonic() + self.transfer_timeout,
            )
        self.sends.append((requests, (raw, buffers), push))

    def poll(self) -> bool:
        """Drop completed messages and queue cleared pushes; True if any completed."""
        if not self.sends:
            return False
        pending = [s for s in self.sends if not self._sent(s)]
        progressed = len(pending) != len(self.sends)
        self.sends = pending
        return progressed

    def take_writes(self) -> list[PushSend]:
        writes, self.writes = self.writes, []
        return writes

    def _sent(self, entry: tuple) -> bool:
        """Whether a message's sends (and its push) are over; queues cleared pushes."""
        requests, _, push = entry
        if push is not None:
            step = push.step(time.monotonic())
            if step == "write":
                self.writes.append(push)
            if step != "over":
                return False
        return MPI.Request.Testall(requests)
