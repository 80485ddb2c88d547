"""Backend type and options, shaped like torch's TensorPipe options."""

from __future__ import annotations

import enum
import os
from typing import Any

import torch

from ._calls.dispatch import check_timeout

__all__ = [
    "BackendType",
    "MPIRpcBackendOptions",
    "TensorPipeRpcBackendOptions",
    "RpcBackendOptions",
    "DEFAULT_RPC_TIMEOUT_SEC",
    "DEFAULT_NUM_WORKER_THREADS",
]

DEFAULT_RPC_TIMEOUT_SEC = 60.0
DEFAULT_NUM_WORKER_THREADS = 16
#: Largest message a worker accepts by default: this machine's physical memory.
DEFAULT_MAX_MESSAGE_BYTES = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class BackendType(enum.Enum):
    """RPC backends. ``TENSORPIPE`` is an alias of ``MPI`` so ported code runs unchanged.

    Example::

        >>> BackendType.TENSORPIPE is BackendType.MPI
        True
    """

    MPI = "MPI"
    TENSORPIPE = "MPI"


def _to_device(d: Any) -> torch.device:
    return torch.device(d) if not isinstance(d, int) else torch.device("cuda", d)


class RpcBackendOptions:
    r"""The base class of RPC agents' options, as torch's: an RPC timeout and an init method.

    ``init_rpc`` takes :class:`MPIRpcBackendOptions` (``TensorPipeRpcBackendOptions``);
    options of another subclass are refused with torch's error.

    Example::

        >>> RpcBackendOptions().rpc_timeout
        60.0
    """

    def __init__(
        self, rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC, init_method: str | None = None
    ):
        try:
            self.rpc_timeout = check_timeout(rpc_timeout, "rpc_timeout", unset_ok=False)
        except TypeError as e:  # torch's words for a constructor argument of a wrong type
            raise TypeError(
                f"{type(self).__name__}: incompatible constructor arguments: {e}"
            ) from None
        self.init_method = init_method


class MPIRpcBackendOptions(RpcBackendOptions):
    r"""Options of the MPI agent.

    Args:
        num_worker_threads (int): threads that run incoming requests (default 16).
        rpc_timeout (float): default timeout of RPCs in seconds; 0 means none (default 60).
        comm (mpi4py.MPI.Comm): the communicator whose ranks are the workers
            (default ``MPI.COMM_WORLD``); the agent works on private duplicates.
        device_maps (dict): ``{worker_name: {local_device: remote_device}}`` for CUDA
            tensors, as ``TensorPipeRpcBackendOptions.device_maps``.
        devices (list): accepted for compatibility.
        max_message_bytes (int): the largest message (frame plus tensors) this
            worker accepts; a bigger one is refused with an error naming this
            option (default: the machine's physical memory).
        init_method, _transports, _channels: accepted and ignored, so options
            written for TensorPipe work unchanged (MPI provides rendezvous).

    Example::
        >>> opts = MPIRpcBackendOptions(rpc_timeout=20)
        >>> opts.set_device_map("worker1", {0: 1})
        >>> opts.device_maps["worker1"]
        {device(type='cuda', index=0): device(type='cuda', index=1)}
    """

    def __init__(
        self,
        *,
        num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
        comm: Any = None,
        device_maps: dict | None = None,
        devices: list | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        init_method: str | None = None,
        _transports: Any = None,
        _channels: Any = None,
    ):
        if num_worker_threads < 1:
            raise ValueError(f"num_worker_threads must be at least 1, got {num_worker_threads}")
        if (
            isinstance(max_message_bytes, bool)
            or not isinstance(max_message_bytes, int)
            or (max_message_bytes < 1)
        ):
            raise ValueError(f"max_message_bytes must be a positive int, got {max_message_bytes!r}")
        self.max_message_bytes = max_message_bytes
        self.num_worker_threads = num_worker_threads
        super().__init__(rpc_timeout, init_method)
        self.comm = comm
        self.devices = [_to_device(d) for d in devices or []]
        self.device_maps: dict[str, dict[torch.device, torch.device]] = {}
        for to, mapping in (device_maps or {}).items():
            self.set_device_map(to, mapping)

    def set_device_map(self, to: str, device_map: dict) -> None:
        """Map this worker's devices to ``to``'s devices for tensors sent there (1-to-1)."""
        mapping = dict(self.device_maps.get(to, {}))
        for k, v in device_map.items():
            k, v = _to_device(k), _to_device(v)
            for other_k, other_v in mapping.items():
                if other_v == v and other_k != k:
                    raise ValueError(
                        f"`set_device_map` only supports 1-to-1 mapping, trying to map {other_k} "
                        f"and {k} to {v}"
                    )
            mapping[k] = v
        self.device_maps[to] = mapping


TensorPipeRpcBackendOptions = MPIRpcBackendOptions
