"""``RemoteModule``: an ``nn.Module`` that lives on another worker, with torch's API.

The module is created on its worker with ``rpc.remote``; ``forward`` is an RPC
to that worker. Inside a distributed autograd context the RPC is recorded like
any other, so ``dist_autograd.backward`` reaches the remote parameters and a
:class:`~lightning_distgrad.optim.DistributedOptimizer` over
:meth:`RemoteModule.remote_parameters` trains them.
"""

from __future__ import annotations

import collections
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import rpc
from ..rpc._internal import current_pickling_context
from ._remote_device import has_device_map, parse_remote_device, resolve_worker

__all__ = ["RemoteModule"]

#: What crosses the wire when a RemoteModule is sent over RPC (torch's list).
_REMOTE_MODULE_PICKLED_ATTRIBUTES = (
    "on",
    "device",
    "is_device_map_set",
    "is_scriptable",
    "generated_methods",
    "module_rref",
)

_SerializedRemoteModule = collections.namedtuple(  # type: ignore[misc]
    "_SerializedRemoteModule", _REMOTE_MODULE_PICKLED_ATTRIBUTES
)

#: ``nn.Module``'s own per-instance state (``training``, parameter tables, hooks).
_MODULE_STATE = frozenset(vars(nn.Module()))

#: Attributes that are rebuilt on the receiver instead: ``nn.Module``'s own
#: state (made on first use there) and the installed ``forward``/``forward_async``.
_REMOTE_MODULE_ATTRIBUTES_IGNORE_FOR_PICKLING = _MODULE_STATE | {
    "forward_async",
    "forward",
}

#: ``nn.Module`` methods that make no sense on a module that lives elsewhere.
_UNSUPPORTED_METHODS = (
    "register_buffer",
    "register_parameter",
    "add_module",
    "apply",
    "cuda",
    "ipu",
    "xpu",
    "cpu",
    "type",
    "float",
    "double",
    "half",
    "bfloat16",
    "to",
    "register_backward_hook",
    "register_forward_pre_hook",
    "register_forward_hook",
    "state_dict",
    "load_state_dict",
    "named_parameters",
    "buffers",
    "named_buffers",
    "children",
    "named_children",
    "modules",
    "named_modules",
    "requires_grad_",
    "zero_grad",
    "share_memory",
    "extra_repr",
)
#: The replacement to name in the error, where there is one.
_REPLACEMENTS = {
    "state_dict": "remote_state_dict",
    "load_state_dict": "load_remote_state_dict",
    "named_parameters": "remote_parameters",
}


# ---------------------------------------------------------------------------
# RPC handlers (run on the module's worker)


def _create_module(
    module_cls: Callable[..., nn.Module], args: tuple, kwargs: dict, device: str
) -> nn.Module:
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise ValueError(
            "Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, "
            f"but it returns an instance of {type(module)}."
        )
    return module.to(device)


def _remote_forward(
    module_rref: rpc.RRef, device: str, is_device_map_set: bool, *args: Any, **kwargs: Any
) -> Any:
    module = module_rref.local_value()
    if torch.device(device).type == "cpu":
        return module(*args, **kwargs)
    args, kwargs = _move_tensors((args, kwargs), torch.device(device))
    out = module(*args, **kwargs)
    # Without a device map only CPU tensors may cross the wire.
    return out if is_device_map_set else _move_tensors(out, torch.device("cpu"))


def _param_rrefs(module_rref: rpc.RRef, recurse: bool) -> list[rpc.RRef]:
    return [rpc.RRef(param) for param in module_rref.local_value().parameters(recurse)]


def _set_training(module_rref: rpc.RRef, mode: bool) -> None:
    module_rref.local_value().train(mode)


def _module_state_dict(module_rref: rpc.RRef) -> dict[str, Any]:
    # Copies: the reply's tensors may be sent after a concurrent optimizer step.
    return {
        k: v.detach().clone() if isinstance(v, torch.Tensor) else v
        for k, v in module_rref.local_value().state_dict().items()
    }


def _module_load_state_dict(module_rref: rpc.RRef, state_dict: dict, strict: bool) -> Any:
    return module_rref.local_value().load_state_dict(state_dict, strict=strict)


def _move_tensors(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_move_tensors(o, device) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_move_tensors(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _move_tensors(v, device) for k, v in obj.items()}
    return obj


# ---------------------------------------------------------------------------
# The methods installed on every instance (torch generates them from a template)


class _Generated:
    @staticmethod
    def forward_async(self: RemoteModule, *args: Any, **kwargs: Any) -> torch.futures.Future:
        return rpc.rpc_async(
            self.module_rref.owner(),
            _remote_forward,
            (self.module_rref, self.device, self.is_device_map_set, *args),
            kwargs,
        )

    @staticmethod
    def forward(self: RemoteModule, *args: Any, **kwargs: Any) -> Any:
        return rpc.rpc_sync(
            self.module_rref.owner(),
            _remote_forward,
            (self.module_rref, self.device, self.is_device_map_set, *args),
            kwargs,
        )


_GENERATED_METHODS = (_Generated.forward_async, _Generated.forward)


def _install_generated_methods(module: RemoteModule) -> None:
    for method in module.generated_methods:
        setattr(module, method.__name__, types.MethodType(method, module))


# ---------------------------------------------------------------------------


class RemoteModule(nn.Module):
    r"""A module created on a remote worker; ``forward`` runs there over RPC.

    ``module_cls(*args, **kwargs)`` is built on the worker named by
    ``remote_device`` and moved to its device. Calls to :meth:`forward` (or to
    the RemoteModule itself) and :meth:`forward_async` are RPCs; inside a
    distributed autograd context they are recorded, so a backward pass sends
    gradients to the remote parameters, and a
    :class:`~lightning_distgrad.optim.DistributedOptimizer` built over
    :meth:`remote_parameters` updates them. Errors of ``module_cls`` surface at
    the first call that uses the module.

    A RemoteModule can be passed in RPC arguments and results (only the
    attributes in ``_REMOTE_MODULE_PICKLED_ATTRIBUTES`` travel, and
    ``forward``/``forward_async`` are installed again on the receiver), but
    not pickled otherwise (``torch.save`` raises). ``nn.Module`` methods that
    would need the remote parameters locally raise ``ValueError``; use
    :meth:`remote_parameters`, :meth:`remote_state_dict` and
    :meth:`load_remote_state_dict` instead.

    Args:
        remote_device (str): ``"<workername>/<device>"`` (``"worker1/cpu"``),
            ``"rank:<rank>/<device>"`` (``"rank:1/cuda:0"``) or
            ``"<workername>"`` (device ``cpu``). A bare ``"<device>"`` places
            the module on this worker.
        module_cls (type): the ``nn.Module`` class (or any callable returning
            one) to instantiate remotely; defined at module level.
        args (tuple, optional): positional arguments of ``module_cls``.
        kwargs (dict, optional): keyword arguments of ``module_cls``.

    Raises:
        ValueError: ``remote_device`` is malformed or names an unknown worker.
        RuntimeError: RPC is not initialised.

    Example::
        Run with ``mpiexec -n 2 python -m mpi4py example.py``:

        >>> # xdoctest: +SKIP
        >>> import torch
        >>> from torch import nn
        >>> import lightning_distgrad.rpc as rpc
        >>> from lightning_distgrad.nn import RemoteModule
        >>> # On rank 0:
        >>> rpc.init_rpc()
        >>> linear = RemoteModule("worker1/cpu", nn.Linear, args=(20, 30))
        >>> linear(torch.randn(128, 20)).shape
        torch.Size([128, 30])
        >>> linear.forward_async(torch.randn(4, 20)).wait().shape
        torch.Size([4, 30])
        >>> len(linear.remote_parameters())
        2
        >>> rpc.shutdown()
        >>> # On rank 1:
        >>> rpc.init_rpc()
        >>> rpc.shutdown()
    """

    # Installed on each instance by ``_install_generated_methods``; declared
    # here for readers and type checkers.
    forward: Callable[..., Any]
    forward_async: Callable[..., torch.futures.Future]

    def __init__(
        self,
        remote_device: str,
        module_cls: Callable[..., nn.Module],
        args: tuple | None = None,
        kwargs: dict[str, Any] | None = None,
    ):
        super().__init__()
        self._prepare_init(remote_device)
        self.is_scriptable = False
        self.generated_methods = _GENERATED_METHODS
        self.module_rref = rpc.remote(
            self.on,
            _create_module,
            (module_cls, tuple(args or ()), dict(kwargs or {}), self.device),
        )
        _install_generated_methods(self)
        self._check_attribute_picklability()

    @staticmethod
    def init_from_module_rref(
        remote_device: str, module_rref: rpc.RRef, _module_interface_cls: Any = None
    ) -> RemoteModule:
        r"""A RemoteModule over an existing remote module (no new module is created).

        Several RemoteModules (on several workers) can share one remote module:
        send ``remote_module.get_module_rref()`` over RPC and call this there.

        Args:
            remote_device (str): as for :class:`RemoteModule`: where inputs are moved
                to (its device). As torch's, it is not checked against the owner of
                ``module_rref``: every call goes to that owner.
            module_rref (RRef[nn.Module]): the module to wrap.
            _module_interface_cls: TorchScript interfaces are not supported; must be None.

        Example::
            >>> # xdoctest: +SKIP
            >>> # On rank 0:
            >>> remote = RemoteModule("worker1/cpu", nn.Linear, args=(20, 30))
            >>> same = RemoteModule.init_from_module_rref("worker1/cpu", remote.get_module_rref())
            >>> same.get_module_rref() is remote.get_module_rref()
            True
        """
        if _module_interface_cls is not None:
            raise NotImplementedError("RemoteModule does not support TorchScript interfaces")
        if not isinstance(module_rref, rpc.RRef):
            raise TypeError(
                f"init_from_module_rref: module_rref must be an RRef, got "
                f"{type(module_rref).__name__}"
            )
        remote_module = object.__new__(RemoteModule)
        nn.Module.__init__(remote_module)
        remote_module._prepare_init(remote_device)
        remote_module.is_scriptable = False
        remote_module.generated_methods = _GENERATED_METHODS
        remote_module.module_rref = module_rref
        _install_generated_methods(remote_module)
        remote_module._check_attribute_picklability()
        return remote_module

    def _prepare_init(self, remote_device: str) -> None:
        on, self.device = parse_remote_device(remote_device)
        self.on, name = resolve_worker(on, remote_device)
        self.is_device_map_set = has_device_map(name)

    def __getattr__(self, name: str) -> Any:
        # A RemoteModule received over RPC holds only its pickled attributes, as torch's
        # (its ``__dict__`` is exactly what was sent); nn.Module's own state, which
        # calling it needs, is made on first use.
        if name in _MODULE_STATE and "_parameters" not in self.__dict__:
            nn.Module.__init__(self)
            return getattr(self, name)
        return super().__getattr__(name)

    def _check_attribute_picklability(self) -> None:
        for k in self.__dict__:
            if (
                k not in _REMOTE_MODULE_PICKLED_ATTRIBUTES
                and k not in _REMOTE_MODULE_ATTRIBUTES_IGNORE_FOR_PICKLING
            ):
                raise AttributeError(
                    f"Attribute {k} must be either in ``_REMOTE_MODULE_PICKLED_ATTRIBUTES`` or "
                    "``_REMOTE_MODULE_ATTRIBUTES_IGNORE_FOR_PICKLING``."
                )

    # -- remote state -------------------------------------------------------------

    def remote_parameters(self, recurse: bool = True) -> list[rpc.RRef]:
        r"""RRefs to the remote module's parameters, for a ``DistributedOptimizer``.

        Args:
            recurse (bool): include the parameters of submodules (default True).

        Returns:
            list[RRef[nn.Parameter]]: one RRef per parameter, in ``parameters()`` order.

        Example::
            >>> # xdoctest: +SKIP
            >>> opt = DistributedOptimizer(torch.optim.SGD, remote.remote_parameters(), lr=0.1)
        """
        return rpc.rpc_sync(self.module_rref.owner(), _param_rrefs, (self.module_rref, recurse))

    def get_module_rref(self) -> rpc.RRef:
        r"""The :class:`~lightning_distgrad.rpc.RRef` to the remote ``nn.Module``.

        Example::
            >>> # xdoctest: +SKIP
            >>> remote.get_module_rref().rpc_sync().extra_repr()
            'in_features=20, out_features=30, bias=True'
        """
        return self.module_rref

    def remote_state_dict(self) -> dict[str, Any]:
        r"""A copy of the remote module's ``state_dict()``, fetched here.

        For checkpoints; this is not torch API (torch's RemoteModule has no
        ``state_dict``, and :meth:`state_dict` raises here too, so a parent
        module's ``state_dict()`` never silently skips remote state).

        Example::
            >>> # xdoctest: +SKIP
            >>> sorted(remote.remote_state_dict())
            ['bias', 'weight']
        """
        return rpc.rpc_sync(self.module_rref.owner(), _module_state_dict, (self.module_rref,))

    def load_remote_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        r"""Load ``state_dict`` into the remote module (``nn.Module.load_state_dict`` there).

        Args:
            state_dict (dict): for example from :meth:`remote_state_dict`.
            strict (bool): as for ``nn.Module.load_state_dict``.

        Returns:
            ``NamedTuple`` with ``missing_keys`` and ``unexpected_keys``.

        Example::
            >>> # xdoctest: +SKIP
            >>> remote.load_remote_state_dict(torch.load("remote_linear.pt"))
            <All keys matched successfully>
        """
        return rpc.rpc_sync(
            self.module_rref.owner(),
            _module_load_state_dict,
            (self.module_rref, state_dict, strict),
        )

    def train(self, mode: bool = True) -> RemoteModule:
        r"""Set the remote module's training mode; returns this RemoteModule.

        Example::
            >>> # xdoctest: +SKIP
            >>> remote.eval()  # the module on worker1 is in eval mode now
            RemoteModule(on='worker1', device='cpu')
            >>> remote.train()
            RemoteModule(on='worker1', device='cpu')
        """
        rpc.rpc_sync(self.module_rref.owner(), _set_training, (self.module_rref, bool(mode)))
        self.training = bool(mode)
        return self

    def eval(self) -> RemoteModule:
        r"""``train(False)`` on the remote module; returns this RemoteModule.

        Example::
            >>> # xdoctest: +SKIP
            >>> remote.eval()
            RemoteModule(on='worker1', device='cpu')
        """
        return self.train(False)

    # -- not supported ------------------------------------------------------------

    def parameters(self, recurse: bool = True) -> Any:
        raise ValueError(
            "Method ``parameters`` not supported for RemoteModule. Please use "
            "``remote_parameters`` instead."
        )

    def __repr__(self) -> str:
        return f"RemoteModule(on={self.on!r}, device={self.device!r})"

    # -- pickling -----------------------------------------------------------------

    def __reduce_ex__(self, protocol: Any) -> tuple:
        if current_pickling_context() is None:
            raise RuntimeError(
                "Cannot pickle RemoteModule in python pickler. RemoteModule can only be "
                "pickled when using RPC"
            )
        for k in self.__dict__:
            if (
                k not in _REMOTE_MODULE_PICKLED_ATTRIBUTES
                and k not in _REMOTE_MODULE_ATTRIBUTES_IGNORE_FOR_PICKLING
            ):
                warnings.warn(
                    f"The new attribute ``{k}`` of RemoteModule is ignored during RPC pickling. "
                    "To pickle this attribute, please add it to "
                    "``_REMOTE_MODULE_PICKLED_ATTRIBUTES``. Otherwise, please explicitly add it "
                    "to ``_REMOTE_MODULE_ATTRIBUTES_IGNORE_FOR_PICKLING``.",
                    stacklevel=2,
                )
        return (
            _remote_module_receiver,
            tuple(self.__dict__[k] for k in _REMOTE_MODULE_PICKLED_ATTRIBUTES),
        )


def _raise_not_supported(name: str) -> Callable[..., Any]:
    hint = f". Please use ``{_REPLACEMENTS[name]}`` instead." if name in _REPLACEMENTS else ""

    def method(self: RemoteModule, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(f"Method ``{name}`` not supported for RemoteModule{hint}")

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Not supported: raises ``ValueError``{hint}"
    return method


for _name in _UNSUPPORTED_METHODS:
    setattr(RemoteModule, _name, _raise_not_supported(_name))


def _remote_module_receiver(*remote_module_pickled_attrs: Any) -> RemoteModule:
    """Rebuild a RemoteModule sent over RPC from its pickled attributes (nn.Module's own
    state is made on first use, see ``RemoteModule.__getattr__``)."""
    serialized = _SerializedRemoteModule._make(remote_module_pickled_attrs)
    m = object.__new__(RemoteModule)
    m.__dict__.update(serialized._asdict())
    _install_generated_methods(m)
    return m
