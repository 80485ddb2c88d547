"""The transport: frames and tensor bytes between the ranks of a communicator, over MPI.

The bottom layer of ``lightning_distgrad.rpc``; it imports nothing of the layers above it
(calls, RRefs, the public API). What those may use is named here; the modules behind it:

* ``engine``: the progress engine (:class:`Transport`): who polls MPI, naps, timers, the
  order in which arrived frames are handed over.
* ``frames`` and ``tensor_bytes``: the wire format, and the validation of what arrives.
* ``sending``, ``receiving``: posting messages and driving them to completion.
* ``direct_writes``: big tensors written by the sender into a receiver's buffer on one node;
  ``receive_buffers``: the pool those and other big receives land in.
* ``doorbell``: waking a napping peer on the node; ``cuda``: CUDA tensors (IPC or staged);
  ``sparse``: sparse tensors as their dense components.
* ``rendezvous``: the collective exchange of ``init_rpc``; ``fail_stop``: a failed, signalled
  or lost rank ends the job; ``message_log``: what a merged profiler timeline reads.
"""

from .engine import Transport
from .fail_stop import PeerWatch, abort_mpi_job, end_job_on_sigterm, node_peers
from .frames import CALL_KINDS, Frame, FrameLimits, Kind, MalformedFrame, local_devices
from .message_log import MessageLog, active_log, set_log
from .rendezvous import agree, exchange
from .sparse import LAYOUTS as SPARSE_LAYOUTS
from .sparse import tensor_nbytes
from .tensor_bytes import DTYPE_TABLE

__all__ = [
    "CALL_KINDS",
    "DTYPE_TABLE",
    "SPARSE_LAYOUTS",
    "Frame",
    "FrameLimits",
    "Kind",
    "MalformedFrame",
    "MessageLog",
    "PeerWatch",
    "Transport",
    "abort_mpi_job",
    "active_log",
    "agree",
    "end_job_on_sigterm",
    "exchange",
    "local_devices",
    "node_peers",
    "set_log",
    "tensor_nbytes",
]
