"""The private torch, Lightning and Python APIs the package uses, and the versions it is tested on.

Every private name the package relies on is resolved here and nowhere else, each with a comment
naming the public API it waits for (or that none exists). Where one of them changes in a new
release, this module is the one place to adapt. torch's names are resolved at import, Lightning's
are checked by :func:`check_lightning_hooks`; a missing one raises ``ImportError`` naming it.

Importing the package checks the installed torch against :data:`TESTED_TORCH`, and importing
``lightning_distgrad.lightning`` checks Lightning against :data:`TESTED_LIGHTNING`: an untested
version raises ``ImportError``, unless ``LIGHTNING_DISTGRAD_ALLOW_UNTESTED=1`` is set, which
turns the error into one warning per package and process.

Lightning's names are imported on first use (``from lightning_distgrad._compat import
Launcher``), never at package import: RPC-only programs do not load Lightning.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "ALLOW_UNTESTED_ENV",
    "TESTED_LIGHTNING",
    "TESTED_TORCH",
    "check_lightning_version",
    "check_torch_version",
    "check_lightning_hooks",
    "check_version",
]

#: Set to ``1`` to import the package on a torch or Lightning version it is not tested with.
ALLOW_UNTESTED_ENV = "LIGHTNING_DISTGRAD_ALLOW_UNTESTED"
#: ``(lowest, first untested)`` ``(major, minor)`` releases, for each package.
TESTED_TORCH = ((2, 13), (2, 14))
TESTED_LIGHTNING = ((2, 4), (2, 7))

_warned: set[str] = set()
_warned_lock = threading.Lock()


def _release(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _describe(tested: tuple[tuple[int, int], tuple[int, int]]) -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = tested
    last = (hi_major, hi_minor - 1) if hi_minor > 0 else None
    if last == (lo_major, lo_minor):
        return f"{lo_major}.{lo_minor}.x"
    upper = f"{last[0]}.{last[1]}.x" if last else f"below {hi_major}.{hi_minor}"
    return f"{lo_major}.{lo_minor}.x to {upper}"


def _pip_spec(package: str, tested: tuple[tuple[int, int], tuple[int, int]]) -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = tested
    return f"pip install '{package}>={lo_major}.{lo_minor},<{hi_major}.{hi_minor}'"


def check_version(
    package: str, found: str, tested: tuple[tuple[int, int], tuple[int, int]]
) -> None:
    """Raise ``ImportError`` unless ``found`` (``package``'s version) lies in ``tested``.

    ``tested`` is ``(lowest, first untested)`` as ``(major, minor)``. With
    ``LIGHTNING_DISTGRAD_ALLOW_UNTESTED=1`` an untested version warns instead, once per
    package and process.

    Example::

        >>> check_version("torch", "2.13.1+cpu", ((2, 13), (2, 14)))  # tested: returns
        >>> check_version("torch", "2.14.0", ((2, 13), (2, 14)))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ImportError: lightning_distgrad is tested with torch 2.13.x, but torch 2.14.0 is ...
    """
    release = _release(found)
    if release is not None and tested[0] <= release < tested[1]:
        return
    message = (
        f"lightning_distgrad is tested with {package} {_describe(tested)}, but {package} {found}"
        f" is installed; it relies on private {package} APIs that may differ there. HINT:"
        f" install a tested version ({_pip_spec(package, tested)}), or set"
        f" {ALLOW_UNTESTED_ENV}=1 to go on at your own risk."
    )
    if os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        raise ImportError(message)
    with _warned_lock:
        if package in _warned:
            return
        _warned.add(package)
    warnings.warn(
        f"lightning_distgrad runs on untested {package} {found} ({ALLOW_UNTESTED_ENV}=1; tested:"
        f" {_describe(tested)}).",
        RuntimeWarning,
        stacklevel=2,
    )


def check_torch_version() -> None:
    """:func:`check_version` for the installed torch (when the package is imported)."""
    check_version("torch", torch.__version__, TESTED_TORCH)


def check_lightning_version() -> None:
    """:func:`check_version` for the installed Lightning (``lightning_distgrad.lightning``)."""
    import lightning

    check_version("lightning", lightning.__version__, TESTED_LIGHTNING)


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
            f" {parts[0]} lacks. HINT: install a {parts[0]} version that lightning_distgrad is"
            " tested with (see TESTED_TORCH and TESTED_LIGHTNING in lightning_distgrad._compat)."
        ) from None


# --- torch ---------------------------------------------------------------------------------------

# Waits for a public torch.autograd.grad without its Python-side argument checks (it runs
# them on every region of a distributed pass).
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
    only, in C++.
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


def num_node_inputs(node: Any) -> int:
    """How many gradients an autograd node takes (one per output of its forward).

    No public alternative as of torch 2.13.
    """
    return len(node._input_metadata)


def module_children(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``module``'s registered child modules by attribute name (the live dict).

    Public alternative: ``named_children()``, which yields a module held under two names once.
    """
    return module._modules


def torch_rpc_thread_local() -> Any:
    """``torch.distributed.rpc.api._thread_local_var``, the thread-local in which torch's
    ``rpc.api._wait_all()`` block collects ``rpc_async`` futures (its ``future_list``), or
    None when torch's RPC API is not imported.

    No public alternative as of torch 2.13 (``_wait_all`` and its thread-local are private).
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
)


def quiet_lightning_pytree() -> None:
    """Ignore the FutureWarning that torch 2.13 raises for every ``LeafSpec`` that Lightning's
    ``_pytree`` helper builds (once per fit): it concerns Lightning's code, not the user's.

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
                f" lightning_distgrad is tested with ({_pip_spec('lightning', TESTED_LIGHTNING)})."
            )
