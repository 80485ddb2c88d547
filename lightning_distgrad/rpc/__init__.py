"""RPC over MPI with the API of ``torch.distributed.rpc``.

Port a program by replacing ``import torch.distributed.rpc as rpc`` with
``import lightning_distgrad.rpc as rpc`` and launching it with
``mpiexec -n N python -m mpi4py program.py``.
"""

from . import constants, functions
from ._calls import futures as _futures
from ._calls.dispatch import UNSET_RPC_TIMEOUT
from ._calls.server_profiler import (
    _disable_server_process_global_profiler,
    _enable_server_process_global_profiler,
    _server_process_global_profile,
)
from ._calls.worker_info import WorkerInfo
from .api import (
    _get_current_rpc_agent,
    _get_debug_info,
    _rref_context_get_debug_info,
    _set_rpc_timeout,
    get_rpc_timeout,
    get_worker_info,
    init_rpc,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from .options import (
    BackendType,
    MPIRpcBackendOptions,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
)
from .rref import RRef

# torch.futures.wait_all/collect_all end at a failed RPC future of ours, as at torch's.
_futures.install()

__all__ = [
    "init_rpc",
    "shutdown",
    "rpc_sync",
    "rpc_async",
    "remote",
    "get_worker_info",
    "get_rpc_timeout",
    "WorkerInfo",
    "RRef",
    "BackendType",
    "MPIRpcBackendOptions",
    "TensorPipeRpcBackendOptions",
    "RpcBackendOptions",
    "functions",
    "constants",
    "UNSET_RPC_TIMEOUT",
    "_set_rpc_timeout",
    "_get_current_rpc_agent",
    "_get_debug_info",
    "_rref_context_get_debug_info",
    "_server_process_global_profile",
    "_enable_server_process_global_profiler",
    "_disable_server_process_global_profiler",
]
