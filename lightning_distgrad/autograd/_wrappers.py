"""torch's data-parallel wrappers in this process: whose leaves DDP's reducer hooks, and FSDP.

DDP's reducer hooks the AccumulateGrad node of each parameter with a C++ post-hook, which
Python cannot see on the node (a node shows its Python hooks only). A module registration hook
(``torch.nn.modules.module.register_module_module_registration_hook``, run whenever a module
assigns a submodule: DDP and FSDP assign the module they wrap in their constructors) notes every
wrapper built once this module is imported; those built before are found once, at import, among
the garbage collector's objects when a default process group exists (the scan costs tens of ms;
without a default group, a wrapper needs a process group made by hand, before the import, to go
unnoticed). Nothing here costs a backward pass anything while no wrapper lives.

Example::

    >>> # xdoctest: +SKIP
    >>> ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    >>> owner = reducer_owners()[id(ddp.module.weight)]
    >>> owner[0] is ddp, owner[1]   # (the DDP module, delayed allreduce)
    (True, False)
    >>> reduced_parameters(ddp) == [ddp.module.weight, ddp.module.bias]
    True
"""

from __future__ import annotations

import gc
import sys
import weakref
from typing import Any

import torch
from torch.nn.modules.module import register_module_module_registration_hook
from torch.nn.parallel import DistributedDataParallel

from .._compat import ddp_parameters, fully_shard_modules

_FSDP1_MODULE = "torch.distributed.fsdp.fully_sharded_data_parallel"

_ddps: weakref.WeakSet = weakref.WeakSet()
_fsdps: weakref.WeakSet = weakref.WeakSet()
# A DDP module -> (the parameters its reducer hooks, {id(parameter): delayed} for those and the
# parameters whose allreduce it delays), once its reducer is built.
_owned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fsdp1_class() -> type | None:
    """``FullyShardedDataParallel`` if its module is loaded (no FSDP can exist otherwise)."""
    module = sys.modules.get(_FSDP1_MODULE)
    return None if module is None else module.FullyShardedDataParallel


def _note(module: torch.nn.Module, name: str, submodule: Any) -> None:
    """Module registration hook: remember data-parallel wrappers."""
    if isinstance(module, DistributedDataParallel):
        _ddps.add(module)
        return
    fsdp = _fsdp1_class()
    if fsdp is not None and isinstance(module, fsdp):
        _fsdps.add(module)


def _find_existing() -> None:
    """Wrappers built before this module was imported (only possible with a process group)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    fsdp = _fsdp1_class()
    kinds = (DistributedDataParallel,) if fsdp is None else (DistributedDataParallel, fsdp)
    for obj in gc.get_objects():
        if issubclass(type(obj), kinds):  # type(): some objects warn when asked __class__
            _note(obj, "module", None)


register_module_module_registration_hook(_note)
_find_existing()


def reducer_owners() -> dict[int, tuple[DistributedDataParallel, bool]]:
    """``{id(parameter): (DDP module, delayed)}`` for the parameters of every live DDP module:
    those its reducer hooks (``delayed`` False) and those whose allreduce it delays (True).
    Empty (at once) while no DDP module lives."""
    if not _ddps:
        return {}
    owners: dict[int, tuple[DistributedDataParallel, bool]] = {}
    for ddp in list(_ddps):
        known = _owned.get(ddp)
        if known is None:
            params = ddp_parameters(ddp)
            if params is None:  # still in its constructor
                continue
            reduced, delayed = params
            known = _owned[ddp] = (reduced, {id(p): False for p in reduced})
            known[1].update((id(p), True) for p in delayed)
        owners.update((i, (ddp, delayed)) for i, delayed in known[1].items())
    return owners


def reduced_parameters(ddp: DistributedDataParallel) -> list[torch.Tensor]:
    """The parameters whose AccumulateGrad node ``ddp``'s reducer hooks (after
    :func:`reducer_owners` has listed ``ddp``)."""
    return _owned[ddp][0]


def check_no_sharded_modules() -> None:
    """Raise if FSDP manages modules in this process: a distributed backward pass cannot
    give it the gradients it reduce-scatters."""
    if not _fsdps and not fully_shard_modules():
        return
    kinds = [type(m).__name__ for m in [*_fsdps, *fully_shard_modules()]]
    if kinds:
        raise RuntimeError(
            "lightning_distgrad cannot run a distributed backward pass on a worker where FSDP "
            f"manages modules (here: {', '.join(sorted(set(kinds)))}). FSDP "
            "(FullyShardedDataParallel, fully_shard) reduce-scatters the gradients that torch's "
            "local backward writes to .grad, at its end; a distributed backward pass keeps "
            "gradients in the distributed autograd context instead (torch's TensorPipe "
            "distributed autograd has the same limit). Train FSDP modules with a local "
            "loss.backward(), and use torch's DistributedDataParallel or "
            "lightning_distgrad.nn.ReplicatedModule for the replicated part of an RPC model."
        )
