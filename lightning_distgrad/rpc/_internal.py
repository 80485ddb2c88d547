"""What the rest of the package (autograd, optim, nn, lightning, profiler) uses of RPC's
internals: this module, beside the public ``lightning_distgrad.rpc`` API, and nothing else.

* the current agent, and calls made for the package's own work (:func:`invoke`,
  :func:`wait`, :func:`call_all`);
* the library's own one-way messages (:func:`register_one_way`, :class:`Kind`) and the seam
  through which distributed autograd records every call (:class:`AutogradHooks`);
* profiling: spans, ``record_rpcs``, the message log of a merged timeline, remote events.
"""

from ._calls.autograd_hooks import AutogradHooks, with_grad
from ._calls.autograd_hooks import install as install_autograd_hooks
from ._calls.dispatch import (
    UNSET_RPC_TIMEOUT,
    call_all,
    current_agent,
    invoke,
    require_agent,
    resolve,
    wait,
)
from ._calls.errors import timeout_error
from ._calls.one_way import register_one_way
from ._calls.payload import current_pickling_context
from ._calls.remote_events import collect_remote_events
from ._calls.spans import profiler_enabled, record_rpcs, run_recorded
from ._transport import Kind, MessageLog, active_log, set_log, tensor_nbytes

__all__ = [
    "UNSET_RPC_TIMEOUT",
    "AutogradHooks",
    "Kind",
    "MessageLog",
    "active_log",
    "call_all",
    "collect_remote_events",
    "current_agent",
    "current_pickling_context",
    "install_autograd_hooks",
    "invoke",
    "profiler_enabled",
    "record_rpcs",
    "register_one_way",
    "require_agent",
    "resolve",
    "run_recorded",
    "set_log",
    "tensor_nbytes",
    "timeout_error",
    "wait",
    "with_grad",
]
