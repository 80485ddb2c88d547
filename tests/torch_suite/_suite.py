"""PyTorch's own RPC test classes, pointed at ``lightning_distgrad``.

The test modules ship in every torch wheel (``torch/testing/_internal/distributed/...``).
They import ``torch.distributed.rpc`` (and ``autograd``, ``optim.DistributedOptimizer``,
``nn.RemoteModule``) when they are imported; :func:`load` imports them first as they are,
then points them at this package:

* every module-level name of a test module (and of ``dist_utils``, whose ``dist_init``
  starts and stops RPC for each test) that is one of torch's RPC objects is rebound to
  the object of the same name here (``rpc``, ``dist_autograd``, ``RRef``, ``WorkerInfo``,
  ``DistributedOptimizer``, ``RemoteModule``, ...). Names this package does not have
  (torch internals such as ``PythonUDF``) stay torch's; :data:`UNBOUND` lists them.
* ``torch.distributed.rpc``, ``torch.distributed.rpc.api`` and
  ``torch.distributed.autograd`` then resolve to this package's modules, in
  ``sys.modules`` and as attributes of ``torch.distributed``, for the imports that
  tests make inside their bodies (``import torch.distributed.rpc.api as api``).
  torch's own modules were imported before, so torch's internals keep theirs.

Each test class is mixed, as torch's CI does (``rpc_utils.generate_tests``), with a
fixture for this agent and ``common_utils.TestCase``; MPI rank r plays ``self.rank``.
"""

from __future__ import annotations

import concurrent.futures
import copy
import enum
import importlib
import os
import sys
import types
from dataclasses import dataclass

_INTERNAL = "torch.testing._internal.distributed."

#: (module under torch.testing._internal.distributed, class name, needs CUDA)
CLASSES: list[tuple[str, str, bool]] = [
    ("rpc.rpc_test", "RpcTest", False),
    ("rpc.rpc_test", "TensorPipeAgentRpcTest", False),
    ("rpc.dist_autograd_test", "DistAutogradTest", False),
    ("rpc.dist_autograd_test", "TensorPipeAgentDistAutogradTest", False),
    ("rpc.dist_optimizer_test", "DistOptimizerTest", False),
    ("nn.api.remote_module_test", "RemoteModuleTest", False),
    ("nn.api.remote_module_test", "ThreeWorkersRemoteModuleTest", False),
    ("rpc.examples.parameter_server_test", "ParameterServerTest", False),
    ("rpc.examples.reinforcement_learning_rpc_test", "ReinforcementLearningRpcTest", False),
    ("ddp_under_dist_autograd_test", "DdpComparisonTest", False),
    ("ddp_under_dist_autograd_test", "DdpUnderDistAutogradTest", False),
    ("rpc.rpc_test", "CudaRpcTest", True),
    ("rpc.rpc_test", "TensorPipeAgentCudaRpcTest", True),
    ("rpc.dist_autograd_test", "CudaDistAutogradTest", True),
    ("rpc.dist_autograd_test", "TensorPipeCudaDistAutogradTest", True),
    ("nn.api.remote_module_test", "CudaRemoteModuleTest", True),
]

#: torch module (or the C extension module its objects report) -> ours.
_OURS = {
    "torch.distributed.rpc": "lightning_distgrad.rpc",
    "torch.distributed.rpc.api": "lightning_distgrad.rpc",
    "torch.distributed.rpc.functions": "lightning_distgrad.rpc.functions",
    "torch._C._distributed_rpc": "lightning_distgrad.rpc",
    "torch.distributed.autograd": "lightning_distgrad.autograd",
    "torch._C._distributed_autograd": "lightning_distgrad.autograd",
    "torch.distributed.optim.optimizer": "lightning_distgrad.optim",
    "torch.distributed.nn.api.remote_module": "lightning_distgrad.nn",
}
#: Whole modules that tests use by attribute (``rpc.rpc_sync``): rebound to ours as a whole.
_OUR_MODULES = {
    "torch.distributed.rpc": "lightning_distgrad.rpc",
    "torch.distributed.rpc.api": "lightning_distgrad.rpc.api",
    "torch.distributed.rpc.functions": "lightning_distgrad.rpc.functions",
    "torch.distributed.autograd": "lightning_distgrad.autograd",
}

#: "module.name" of torch objects the test modules still use because this package has no
#: object of that name (filled by :func:`load`).
UNBOUND: list[str] = []


@dataclass(frozen=True)
class SuiteClass:
    """One test class: its name (as in torch), the mixed class to run, its world size."""

    name: str
    cls: type
    world_size: int
    needs_cuda: bool

    def test_names(self) -> list[str]:
        import unittest

        return list(unittest.TestLoader().getTestCaseNames(self.cls))


def _test_modules() -> list[types.ModuleType]:
    names = dict.fromkeys(_INTERNAL + m for m, _, _ in CLASSES)
    return [importlib.import_module(n) for n in names]


def _ours_for(value: object) -> object | None:
    """The object of this package that stands for torch's ``value``, or None."""
    if isinstance(value, types.ModuleType):
        ours = _OUR_MODULES.get(value.__name__)
        return importlib.import_module(ours) if ours else None
    origin = getattr(value, "__module__", None)
    name = getattr(value, "__name__", None)
    if not isinstance(origin, str) or not isinstance(name, str) or origin not in _OURS:
        return None
    package = importlib.import_module(_OURS[origin])
    return getattr(package, name, None)


def _is_torch_rpc(value: object) -> bool:
    name = value.__name__ if isinstance(value, types.ModuleType) else None
    origin = name or getattr(value, "__module__", None)
    return isinstance(origin, str) and origin.startswith(tuple(_OURS))


def _rebind(module: types.ModuleType) -> None:
    for key, value in list(vars(module).items()):
        if key.startswith("__"):
            continue
        if isinstance(value, type) and value.__module__ == module.__name__:
            _rebase(module, key, value)
        elif _is_torch_rpc(value):
            ours = _ours_for(value)
            if ours is None:
                UNBOUND.append(f"{module.__name__.rsplit('.', 1)[-1]}.{key}")
            else:
                setattr(module, key, ours)


def _rebase(module: types.ModuleType, key: str, cls: type) -> None:
    """A test module's class derived from one of torch's RPC classes (``class
    FooBackendOptions(rpc.RpcBackendOptions)``) is made again on ours."""
    bases = tuple(_ours_for(b) or b if _is_torch_rpc(b) else b for b in cls.__bases__)
    if bases != cls.__bases__:
        body = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
        setattr(module, key, type(cls)(cls.__name__, bases, body))


def _redirect_torch_modules() -> None:
    import torch.distributed

    import lightning_distgrad.autograd
    import lightning_distgrad.rpc
    import lightning_distgrad.rpc.api

    torch.distributed.rpc = lightning_distgrad.rpc
    torch.distributed.autograd = lightning_distgrad.autograd
    sys.modules["torch.distributed.rpc"] = lightning_distgrad.rpc
    sys.modules["torch.distributed.rpc.api"] = lightning_distgrad.rpc.api
    sys.modules["torch.distributed.autograd"] = lightning_distgrad.autograd


def _fixture() -> type:
    from torch.testing._internal.common_distributed import tp_transports
    from torch.testing._internal.distributed.rpc.rpc_agent_test_fixture import (
        RpcAgentTestFixture,
    )

    import lightning_distgrad.rpc as rpc

    class MPIAgentTestFixture(RpcAgentTestFixture):
        """torch's TensorPipe fixture, with this package's backend type and options."""

        @property
        def rpc_backend(self):
            return rpc.BackendType.TENSORPIPE

        @property
        def rpc_backend_options(self):
            return rpc.TensorPipeRpcBackendOptions(
                init_method=self.init_method, _transports=tp_transports()
            )

        def get_shutdown_error_regex(self):
            return "(.*)"

        def get_timeout_error_regex(self):
            return "RPC ran for more than"

    return MPIAgentTestFixture


def load(bind: bool = True) -> dict[str, SuiteClass]:
    """Import torch's test modules and mix each class of :data:`CLASSES` with the fixture.

    ``bind=False`` leaves the modules on torch's RPC (enough to list the tests; also how to
    run them against torch's own agent).
    """
    # Not the "to reproduce, run python test/..." footer: these tests are not run that way.
    os.environ.setdefault("PYTORCH_PRINT_REPRO_ON_FAILURE", "0")
    import torch
    import torch.distributed.autograd
    import torch.distributed.nn
    import torch.distributed.optim
    import torch.distributed.rpc  # noqa: F401  (torch's own modules first: see module doc)
    import torch.testing._internal.dist_utils as dist_utils
    from torch.testing._internal.common_utils import TestCase

    modules = _test_modules()
    if bind:
        for module in [dist_utils, *modules]:
            _rebind(module)
        _redirect_torch_modules()
        fixture = _fixture()
    else:
        from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (
            TensorPipeRpcAgentTestFixture as fixture,
        )
    has_cuda = torch.cuda.is_available()
    this_module = sys.modules[__name__]
    suite = {}
    for module_name, class_name, needs_cuda in CLASSES:
        if needs_cuda and not has_cuda:
            continue
        test_class = getattr(importlib.import_module(_INTERNAL + module_name), class_name)
        # A module-level name, as torch's generate_tests gives its classes: instances and
        # bound methods pickle by reference to it.
        mixed_name = f"MPI{class_name}"
        mixed = type(mixed_name, (test_class, fixture, TestCase), {})
        mixed.__module__ = __name__
        setattr(this_module, mixed_name, mixed)
        size = mixed.world_size  # a property of the class (fixture: 4), not of an instance
        world_size = size.fget(None) if isinstance(size, property) else int(size)
        suite[class_name] = SuiteClass(class_name, mixed, world_size, needs_cuda)
    return suite


class FreshModules:
    """The module-level state of the test modules as imported, put back before each test.

    torch runs each test in a fresh process; here one process runs many, and tests leave
    state behind in their modules: flags (``rpc_done``), finished ``concurrent.futures``
    (``VALUE_FUTURE``), even deleted functions (``test_function_not_on_callee`` deletes
    ``foo_add`` on one rank). Every name is bound again to its value at import (after
    :func:`load` pointed it at this package); containers, tensors and futures are fresh;
    plain class attributes (``SimulateBackwardError._simulate_error``) get their values back.
    """

    def __init__(self) -> None:
        self._saved = [
            (module, dict(vars(module)))
            for name, module in list(sys.modules.items())
            if name.startswith((_INTERNAL, "torch.testing._internal.dist_utils"))
            and isinstance(module, types.ModuleType)
        ]
        # Flags that tests set on classes (SimulateBackwardError._simulate_error = False).
        self._class_flags = [
            (cls, key, value)
            for _, names in self._saved
            for cls in _classes_of(names.values())
            for key, value in list(vars(cls).items())
            if not key.startswith("__") and isinstance(value, (bool, int, float, str, type(None)))
        ]
        self._initial = {
            id(v): copy.deepcopy(v)
            for _, names in self._saved
            for v in names.values()
            if _is_plain_state(v)
        }

    def restore(self) -> None:
        """Bind every saved name again; fresh copies of mutable state."""
        for module, names in self._saved:
            for key, value in names.items():
                if isinstance(value, concurrent.futures.Future):
                    value = concurrent.futures.Future()
                elif id(value) in self._initial:
                    value = copy.deepcopy(self._initial[id(value)])
                setattr(module, key, value)
        for cls, key, value in self._class_flags:
            setattr(cls, key, value)


def _classes_of(values) -> list[type]:
    """The classes defined in the test modules, and the classes nested in them."""
    found: list[type] = []
    todo = [
        v
        for v in values
        if isinstance(v, type)
        and v.__module__.startswith(_INTERNAL)
        and not issubclass(v, enum.Enum)
    ]
    while todo:
        cls = todo.pop()
        if cls in found:
            continue
        found.append(cls)
        todo.extend(
            v for v in vars(cls).values() if isinstance(v, type) and v.__module__ == cls.__module__
        )
    return found


def _is_plain_state(value: object) -> bool:
    """Mutable data a test may change: containers of plain values, tensors."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.is_leaf
    if isinstance(value, (list, dict, set)):
        items = list(value.items()) if isinstance(value, dict) else list(value)
        flat = [x for item in items for x in (item if isinstance(item, tuple) else (item,))]
        return all(isinstance(x, (bool, int, float, str, type(None))) for x in flat)
    return False


def package_under_test() -> str:
    """Where ``lightning_distgrad`` is imported from (the current directory comes first)."""
    import lightning_distgrad

    return os.path.dirname(os.path.dirname(os.path.abspath(lightning_distgrad.__file__)))
