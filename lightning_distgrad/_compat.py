"""The private torch, Lightning and Python APIs the package uses.

Every private name the package relies on is resolved here and nowhere else, each with a comment
naming the public API it waits for (or that none exists) and the releases where it differs.
Where one of them changes in a new release, this module is the one place to adapt. torch's
names are resolved at import, Lightning's are checked by :func:`check_lightning_hooks`; a
missing one raises ``ImportError`` naming it. The releases it supports are in ``_versions``,
which checks the installed torch first.

torch's own RPC is optional: on a torch build without it (Windows builds, builds without
TensorPipe: ``torch.distributed.rpc.is_available()`` is False) the package works in full.
``TORCH_PRIVATE_NAMES`` says which names depend on torch's RPC; each of those has a
fallback with the same effect, and no other name may depend on it.

Lightning's names are imported on first use (``from lightning_distgrad._compat import
Launcher``), never at package import: RPC-only programs do not load Lightning.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ._versions import SUPPORTED_LIGHTNING, check_torch_version, describe

__all__ = ["check_lightning_hooks"]

# Resolved after the version check: below the floor, that error names the cause.
check_torch_version()


def _private(module: str, name: str) -> Any:
    """``module.name`` (``module`` may end in attributes, as ``torch._C._functions``), or an
    ``ImportError`` that names it if this installation lacks it."""
    parts = module.split(".")
    try:
        for cut in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
            try:
                value = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                if cut == 1:
                    raise
        for part in [*parts[cut:], name]:
            value = getattr(value, part)
        return value
    except (ImportError, AttributeError):
        raise ImportError(
            f"lightning_distgrad needs the private {module}.{name}, which the installed"
            f" {parts[0]} lacks. HINT: install a {parts[0]} release that lightning_distgrad"
            " supports (SUPPORTED_TORCH and SUPPORTED_LIGHTNING in lightning_distgrad._versions)."
        ) from None


def _private_if_torch_rpc(module: str, name: str) -> Any:
    """``module.name`` where torch's RPC set it up, else None (the caller's fallback)."""
    try:
        return _private(module, name)
    except ImportError:
        return None


# --- torch ---------------------------------------------------------------------------------------
# Each name below is spelled and behaves the same from torch 2.5 to 2.14, unless its comment
# names the releases where it differs; tests/test_compat.py checks each one against plain torch
# on the floor, the newest and the releases between that CI runs. None depends on torch's own
# RPC unless its comment says so (then it has a fallback): TORCH_PRIVATE_NAMES lists them all.

#: Every private torch name the package uses, and whether it depends on torch's own RPC (a
#: torch build without RPC, where ``torch.distributed.rpc.is_available()`` is False, lacks
#: it; this module then uses the fallback that its comment names). tests/test_compat.py
#: checks it with torch's RPC and without: each independent name resolves, and each
#: dependent one resolves exactly where torch has its RPC, its fallback is used where not.
#: A name of an instance attribute names its class.
TORCH_PRIVATE_NAMES: dict[str, bool] = {
    "torch.autograd.graph._engine_run_backward": False,
    "torch._C._functions.DelayedError": False,
    "torch._C.Future": False,
    "torch._C._autograd._profiler_enabled": False,
    "torch._C._autograd._profiler_type": False,
    "torch._C._profiler.ActiveProfilerType": False,
    "torch.jit._builtins._find_builtin": False,
    "torch.autograd.profiler.record_function._call_end_callbacks_on_future": False,
    "torch.futures.Future._set_unwrap_func": False,
    "torch.autograd.profiler.profile._parse_kineto_results": False,
    "torch.autograd.profiler.profile._start_trace": False,
    "torch.autograd.profiler_legacy.profile._start_trace": False,
    "torch.autograd.profiler_legacy._parse_legacy_records": False,
    # rpc._calls.server_profiler builds a server-side profile's tree with it, as torch's does.
    "torch.autograd.profiler_util.EventList._build_tree": False,
    "torch.autograd._enable_profiler_legacy": False,
    "torch.autograd._disable_profiler_legacy": False,
    "torch.Tensor._backward_hooks": False,
    "torch.Tensor._post_accumulate_grad_hooks": False,
    "torch.Tensor._indices": False,
    "torch.Tensor._values": False,
    "torch.autograd.graph.Node._input_metadata": False,
    "torch.nn.Module._modules": False,
    "torch.nn.parallel.DistributedDataParallel._module_parameters": False,
    "torch.nn.parallel.DistributedDataParallel._delay_all_reduce_params": False,
    "torch.distributed._composable_state._module_state_mapping": False,
    "torch.UntypedStorage._share_cuda_": False,
    "torch.UntypedStorage._new_shared_cuda": False,
    "torch._C._distributed_rpc._set_profiler_node_id": True,
    "torch.distributed.rpc.api._thread_local_var": True,
}

# Waits for a public torch.autograd.grad without its Python-side argument checks (it runs
# them on every region of a distributed pass). Below torch 2.5 it refuses GradientEdge roots,
# which is the floor of SUPPORTED_TORCH.
engine_run_backward: Callable[..., tuple] = _private("torch.autograd.graph", "_engine_run_backward")
# No public alternative as of torch 2.13: a C++ node whose backward raises a given message
# (the send and recv nodes of distributed autograd).
DelayedError: type = _private("torch._C._functions", "DelayedError")
# torch.futures.Future is the public class, but then() and collect_all() return instances of
# this base class that are not torch.futures.Future instances; no public alternative.
CFuture: type = _private("torch._C", "Future")
# CFuture.done without torch.futures.Future's Python wrapper; public alternative: Future.done.
future_done: Callable[[Any], bool] = CFuture.done
# Waits for a public "is a profiler recording" query (torch.autograd.profiler has none).
profiler_enabled: Callable[[], bool] = _private("torch._C._autograd", "_profiler_enabled")
# No public alternative as of torch 2.13: the aten operator name of a torch function.
find_builtin: Callable[[Any], Any] = _private("torch.jit._builtins", "_find_builtin")
# No public alternative as of torch 2.13 (torch's own RPC profiling uses it): a
# record_function span that ends when a future completes.
_call_end_callbacks_on_future = _private(
    "torch.autograd.profiler", "record_function"
)._call_end_callbacks_on_future
_set_unwrap_func = _private("torch.futures", "Future")._set_unwrap_func


def end_span_on_future(record: Any, future: torch.futures.Future) -> torch.futures.Future:
    """End the entered ``torch.autograd.profiler.record_function`` ``record`` when ``future``
    completes; returns the future to use in its place."""
    return _call_end_callbacks_on_future(record, future)


def kineto_records_this_thread() -> bool:
    """Whether the profiler on this thread is Kineto's (``torch.profiler.profile``,
    ``torch.autograd.profiler.profile``) rather than the legacy one.

    No public alternative as of torch 2.13: torch has no query of the active profiler's type.
    """
    kineto = torch._C._profiler.ActiveProfilerType.KINETO
    return torch._C._autograd._profiler_type() == kineto


_parser_lock = threading.Lock()
_event_adders: list[Callable[[Any, Any, list], list]] = []


def wrap_kineto_results_parser(add_events: Callable[[Any, Any, list], list]) -> None:
    """Make every Kineto profile pass its parsed events through ``add_events(profile,
    results, events)``, which returns the events to list. Adding the same function again
    changes nothing.

    Wraps the private ``torch.autograd.profiler.profile._parse_kineto_results``, behind
    ``events()``, ``key_averages()`` and ``table()``. It waits for a public way to add events
    to a Kineto profile: torch's own RPC profiling adds remote events to the legacy profiler
    only, in C++. Its arguments differ by release (``(result)`` in torch 2.5 to 2.10,
    ``(result, timeout_s=None)`` in 2.11 to 2.14): the wrapper passes whatever it is given.
    """
    profile = torch.autograd.profiler.profile
    with _parser_lock:
        if add_events in _event_adders:
            return
        _event_adders.append(add_events)
        if len(_event_adders) > 1:
            return  # the wrapper is in place
        original = profile._parse_kineto_results

        def parse(self: Any, result: Any, *args: Any, **kwargs: Any) -> list:
            events = original(self, result, *args, **kwargs)
            for adder in list(_event_adders):
                events = adder(self, result, events)
            return events

        profile._parse_kineto_results = parse


def quiet_kineto_without_gpu() -> None:
    """Keep Kineto's log lines out of the output of a node without a GPU (a CPU partition's
    or login node's usual case); call before starting a profiler.

    There, Kineto writes lines to stderr that a user can do nothing about:
    ``gpuGetDeviceCount failed with code 35`` when a trace is written (CUDA builds of torch
    2.5 to 2.14) and ``USDT ... profiler_start`` / ``profiler_stop`` (CPU and CUDA builds of
    torch 2.13 and 2.14). Kineto reads ``KINETO_LOG_LEVEL`` once, when the process's first
    profiler starts; 6 is above its highest severity. A level the user set is kept, and
    nodes with a GPU are left alone.
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")


@contextlib.contextmanager
def quiet_first_profiler_cycle() -> Iterator[None]:
    """Inside, starting a ``torch.profiler.profile`` does not warn "Profiler clears events at
    the end of each cycle".

    torch 2.10 and 2.11 warn so when any such profiler starts its first cycle, where nothing
    was cleared; 2.13 and 2.14 only when a schedule starts a second cycle without
    ``acc_events``; 2.5 never. The package's own profilers run one cycle.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"Warning: Profiler clears events at the end of each cycle"
        )
        yield


def set_unwrap_func(future: torch.futures.Future, unwrap: Callable[[Any], Any]) -> None:
    """Make every ``future.wait()`` call ``unwrap(result)`` first; ``unwrap`` may raise.

    No public alternative as of torch 2.13: ``Future.set_exception`` raises the stored
    exception object itself on every ``wait()``.
    """
    _set_unwrap_func(future, unwrap)


def tensor_hooks(tensor: torch.Tensor) -> dict | None:
    """The hooks that ``tensor.register_hook`` added (a live dict), or None.

    No public alternative as of torch 2.13: hooks can be added and removed by handle only.
    """
    return getattr(tensor, "_backward_hooks", None)


def _no_op_hook(*_: Any) -> None:
    return None


def node_post_hooks(node: Any) -> dict:
    """The hooks that ``node.register_hook`` added (a snapshot, in the order they run).

    No public alternative as of torch 2.13 (same from 2.5 on): a node keeps its Python
    post-hooks in one dict, which a new hook's ``RemovableHandle`` points to; a stand-in
    hook added and removed reads it. A node that had no hook keeps the empty dict, as
    after a user removes a hook. About 2 to 3 us a node.
    """
    return _hooks_dict(node.register_hook(_no_op_hook))


def node_pre_hooks(node: Any) -> dict:
    """The hooks that ``node.register_prehook`` added (a snapshot, in the order they run).

    No public alternative as of torch 2.14; read as :func:`node_post_hooks` reads post-hooks
    (a node keeps its Python pre-hooks in a dict of their own), the same from torch 2.5 on.
    """
    return _hooks_dict(node.register_prehook(_no_op_hook))


def _hooks_dict(stand_in: Any) -> dict:
    hooks = stand_in.hooks_dict_ref()
    stand_in.remove()
    return dict(hooks) if hooks else {}


def post_accumulate_grad_hooks(tensor: torch.Tensor) -> dict | None:
    """The hooks that ``tensor.register_post_accumulate_grad_hook`` added (a live dict), or
    None.

    No public alternative as of torch 2.14 (the same from 2.5 on): hooks can be added and
    removed by handle only.
    """
    return getattr(tensor, "_post_accumulate_grad_hooks", None)


def ddp_parameters(ddp: torch.nn.Module) -> tuple[list, list] | None:
    """``(reduced, delayed)`` parameters of a ``DistributedDataParallel`` module: those whose
    AccumulateGrad node its reducer hooks (the ones that require grad), and those whose
    allreduce it delays (``delay_all_reduce_named_params``, no reducer hook); None while its
    constructor has not built the reducer.

    No public alternative as of torch 2.14: DDP keeps them in ``_module_parameters`` and
    ``_delay_all_reduce_params``, the same from torch 2.5 to 2.14.
    """
    if getattr(ddp, "reducer", None) is None:
        return None
    reduced = [p for p in ddp._module_parameters if p.requires_grad]
    return reduced, list(ddp._delay_all_reduce_params)


def fully_shard_modules() -> list[torch.nn.Module]:
    """The modules that ``fully_shard`` (FSDP2) manages in this process.

    No public alternative as of torch 2.14: ``fully_shard`` records each module's state in
    the private ``torch.distributed._composable_state._module_state_mapping`` (a dict in torch
    2.5, a ``WeakKeyDictionary`` in 2.13 and 2.14), which ``replicate`` shares. Their class,
    ``FSDPModule``, is public as ``torch.distributed.fsdp.FSDPModule`` from torch 2.6 and
    ``torch.distributed._composable.fsdp.FSDPModule`` in 2.5.
    """
    state = sys.modules.get("torch.distributed._composable_state")
    mapping = getattr(state, "_module_state_mapping", None)
    if not mapping:
        return []
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch 2.5
        from torch.distributed._composable.fsdp import FSDPModule
    return [module for module in list(mapping) if isinstance(module, FSDPModule)]


# No public alternative as of torch 2.14 (torch.multiprocessing shares CUDA tensors with them):
# a CUDA storage's IPC export, ``(device, memory handle, size, offset in its block, reference
# counter handle, counter offset, event handle, event recorded)``, and its import in another
# process. The export records an interprocess event on the current stream, and torch's
# cross-process reference counter keeps the block from reuse until every import is released;
# an import waits for that event on the current stream, and its release synchronises the then
# current stream before it decrements the counter.
share_cuda_storage: Callable[[torch.UntypedStorage], tuple] = _private(
    "torch.UntypedStorage", "_share_cuda_"
)
open_cuda_storage: Callable[..., torch.UntypedStorage] = _private(
    "torch.UntypedStorage", "_new_shared_cuda"
)


def num_node_inputs(node: Any) -> int:
    """How many gradients an autograd node takes (one per output of its forward).

    No public alternative as of torch 2.13.
    """
    return len(node._input_metadata)


def coo_parts(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The indices and values of a sparse COO tensor as stored, coalesced or not (views).

    Public alternative: ``indices()`` and ``values()``, which refuse an uncoalesced tensor
    (coalescing it first would cost a sort and change what a sender sends).
    """
    return t._indices(), t._values()


def module_children(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``module``'s registered child modules by attribute name (the live dict).

    Public alternative: ``named_children()``, which yields a module held under two names once.
    """
    return module._modules


# No public alternative as of torch 2.14 (torch's RPC agent calls it at init_rpc): the
# node_id that the legacy profiler gives the events it records in this process. Depends on
# torch's RPC (torch's RPC init creates torch._C._distributed_rpc); without it,
# set_profiler_node_id gives that node_id to the events its parser returns instead.
_torch_set_profiler_node_id: Callable[[int], None] | None = _private_if_torch_rpc(
    "torch._C._distributed_rpc", "_set_profiler_node_id"
)
#: The node_id of the legacy profiler's events where torch cannot set it, once set.
_profiler_node_id: int | None = None
# No public alternative as of torch 2.13 (torch's RPC server profiles requests with them):
# the legacy profiler of the calling thread, on with a torch ProfilerConfig, and off,
# returning its raw records (``list[list[ProfilerEvent]]``). Defined by torch.autograd
# itself, from torch._C._autograd: independent of torch's RPC.
enable_legacy_profiler: Callable[[Any], None] = _private(
    "torch.autograd", "_enable_profiler_legacy"
)
disable_legacy_profiler: Callable[[], list] = _private("torch.autograd", "_disable_profiler_legacy")
# Imported, not read as an attribute of torch.autograd: it is one only once something has
# imported it (torch.distributed.rpc does, where torch has its RPC).
_legacy_profiler = importlib.import_module("torch.autograd.profiler_legacy")
_parse_legacy_records = _private("torch.autograd.profiler_legacy", "_parse_legacy_records")
_private("torch.autograd.profiler_legacy.profile", "_start_trace")
_private("torch.autograd.profiler.profile", "_start_trace")


def set_profiler_node_id(node_id: int) -> None:
    """Make the events that the legacy profiler records in this process carry ``node_id``
    (torch's RPC agent does so at ``init_rpc``), in ``function_events`` and in the parse of
    :func:`parse_legacy_records`.

    Where torch has its RPC, torch's own call sets it on every record; where not, the
    parser of legacy records sets it on the events it returns (those recorded in this
    process: the remote events that :func:`watch_torch_profilers` adds carry their own).
    """
    global _profiler_node_id
    if _torch_set_profiler_node_id is not None:
        _torch_set_profiler_node_id(node_id)
        return
    with _parser_lock:
        _profiler_node_id = node_id
        _wrap_legacy_parser()


def _parse_legacy_records_here(records: Any, *args: Any, **kwargs: Any) -> list:
    """torch's parse of legacy records, their events given this process's node_id where
    torch could not record it (see :func:`set_profiler_node_id`)."""
    events = _parse_legacy_records(records, *args, **kwargs)
    node_id = _profiler_node_id
    if node_id is not None:
        for event in events:
            if event.node_id == -1 and not event.is_remote:  # -1: torch's "not set"
                event.node_id = node_id
    return events


def parse_legacy_records(records: list) -> list:
    """The ``FunctionEvent``\\ s of raw legacy profiler records, sorted by start (those
    that :func:`watch_torch_profilers` adds to a profile are not among them).

    No public alternative as of torch 2.13: ``torch.autograd.profiler_legacy``'s private
    parser, which its ``profile`` and torch's RPC server profiler use.
    """
    return _parse_legacy_records_here(records)


def legacy_profile_start_ns(records: list) -> int | None:
    """When the legacy profile of ``records`` started (its ``__start_profile`` mark), in ns
    of the wall clock (``time.time_ns()``); None if the records hold no such mark.

    No public alternative as of torch 2.13: legacy records count from that mark, and
    ``ProfilerEvent.start_us()`` gives its wall-clock time in us.
    """
    for thread in records:
        for record in thread:
            if record.name() == "__start_profile":
                return int(record.start_us() * 1000)
    return None


_watchers: list[tuple[Callable, Callable]] = []


def watch_torch_profilers(
    on_start: Callable[[Any, bool], None], add_legacy_events: Callable[[list, list], list]
) -> None:
    """Call ``on_start(profile, legacy)`` on the thread that starts a ``torch.autograd.
    profiler.profile`` (``legacy=False``; ``torch.profiler.profile`` starts one) or a
    ``torch.autograd.profiler_legacy.profile`` (``legacy=True``) once it records; and make
    every parse of legacy records (on the thread that stops a legacy profile) return
    ``add_legacy_events(records, events)``. Watching with the same functions again
    changes nothing.

    Wraps the private ``_start_trace`` of both profile classes and
    ``profiler_legacy._parse_legacy_records``. Waits for a public way to learn a running
    profiler's settings and to add events to a legacy profile: torch's own RPC profiling
    adds remote events to the legacy profiler in C++.
    """
    with _parser_lock:
        if (on_start, add_legacy_events) in _watchers:
            return
        _watchers.append((on_start, add_legacy_events))
        _wrap_legacy_parser()
        if len(_watchers) > 1:
            return  # the wrappers are in place

        def wrap_start(cls: type, legacy: bool) -> None:
            original = cls._start_trace

            def start(self: Any, *args: Any, **kwargs: Any) -> Any:
                result = original(self, *args, **kwargs)
                for watch, _ in list(_watchers):
                    watch(self, legacy)
                return result

            cls._start_trace = start

        wrap_start(torch.autograd.profiler.profile, False)
        wrap_start(_legacy_profiler.profile, True)


def _parse_watched(records: Any, *args: Any, **kwargs: Any) -> list:
    """torch's parse of legacy records (with this process's node_id), then each watcher's
    remote events added."""
    events = _parse_legacy_records_here(records, *args, **kwargs)
    for _, add in list(_watchers):
        events = add(records, events)
    return events


def _wrap_legacy_parser() -> None:
    """Make every parse of legacy records (a legacy profile's ``function_events``) go
    through :func:`_parse_watched`; with ``_parser_lock`` held. Again changes nothing."""
    _legacy_profiler._parse_legacy_records = _parse_watched


def torch_rpc_thread_local() -> Any:
    """``torch.distributed.rpc.api._thread_local_var``, the thread-local in which torch's
    ``rpc.api._wait_all()`` block collects ``rpc_async`` futures (its ``future_list``), or
    None when torch's RPC API is not imported.

    No public alternative as of torch 2.13 (``_wait_all`` and its thread-local are private).
    Depends on torch's RPC (``torch.distributed.rpc`` imports its ``api`` only where torch
    has its RPC); without it, None: no torch ``_wait_all()`` block can be open, and the
    package's own blocks use a thread-local of their own.
    """
    return getattr(sys.modules.get("torch.distributed.rpc.api"), "_thread_local_var", None)


# --- Python --------------------------------------------------------------------------------------

# No public alternative as of Python 3.13: atexit handlers run only after the interpreter
# has joined non-daemon threads; these run before.
register_atexit: Callable[..., None] = _private("threading", "_register_atexit")


# --- Lightning: imported on first use ------------------------------------------------------------

_LIGHTNING = {
    # No public alternative as of Lightning 2.6: the base class of a strategy's launcher.
    "Launcher": ("lightning.pytorch.strategies.launchers.launcher", "_Launcher"),
    # Waits for a public Strategy helper; moves a loaded optimizer state to the device.
    "optimizers_to_device": ("lightning.fabric.utilities.optimizer", "_optimizers_to_device"),
}
# Private hooks of Lightning's classes that the strategy overrides or calls (class, name).
_LIGHTNING_HOOKS = (
    # No public alternative as of Lightning 2.6: the Trainer asks the strategy for its
    # launcher through this hook (at Trainer construction).
    ("lightning.pytorch.strategies", "ParallelStrategy", "_configure_launcher"),
    # No public alternative as of Lightning 2.6: on_before_optimizer_step hooks and gradient
    # clipping, in Lightning's order, for a strategy that runs the optimizer step itself.
    ("lightning.pytorch.plugins.precision", "Precision", "_after_closure"),
    # No public alternative as of Lightning 2.6: the name of the next hpc checkpoint
    # (hpc_save_path above, for Slurm auto-requeue).
    (
        "lightning.pytorch.trainer.connectors.checkpoint_connector",
        "_CheckpointConnector",
        "hpc_save_path",
    ),
)


def quiet_lightning_pytree() -> None:
    """Ignore the FutureWarning that torch (2.10 to 2.14 at least) raises for every
    ``LeafSpec`` that Lightning's ``_pytree`` helper builds (once per fit): it concerns
    Lightning's code, not the user's. torch 2.5 has no such warning, and the filter then
    matches nothing.

    Waits for a Lightning release whose ``_pytree`` uses ``TreeSpec.is_leaf()``.
    """
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )


def after_closure(precision: Any, model: Any, optimizer: Any) -> None:
    """Run ``on_before_optimizer_step`` hooks and gradient clipping as Lightning's precision
    plugin does after the training step's closure."""
    precision._after_closure(model, optimizer)


def __getattr__(name: str) -> Any:
    if name in _LIGHTNING:
        value = _private(*_LIGHTNING[name])
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_lightning_hooks() -> None:
    """Raise ``ImportError`` unless the installed Lightning has every private name the strategy
    uses (run by ``lightning_distgrad.lightning`` after the version check): a hook that is
    gone would otherwise be skipped silently."""
    for module, name in _LIGHTNING.values():
        _private(module, name)
    for module, cls, name in _LIGHTNING_HOOKS:
        if not hasattr(_private(module, cls), name):
            raise ImportError(
                f"lightning_distgrad overrides or calls {module}.{cls}.{name}, which the"
                " installed Lightning lacks. HINT: install a Lightning version that"
                f" lightning_distgrad is tested with ({describe(SUPPORTED_LIGHTNING)})."
            )


def hpc_save_path(trainer: Any) -> str:
    """The path of the next Lightning "hpc" checkpoint in ``trainer.default_root_dir``
    (``hpc_ckpt_<N+1>.ckpt`` after the highest N there), as Lightning's Slurm handler names it;
    ``Trainer.fit(ckpt_path=None)`` under Slurm resumes from the highest.

    No public alternative as of Lightning 2.6: the trainer's private ``_checkpoint_connector``
    (a ``_CheckpointConnector``) names it.
    """
    return trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
