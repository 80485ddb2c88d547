"""The LightningModule's distributed parts: its RemoteModules and its optimizer's settings."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from .. import rpc
from .._compat import module_children
from ..nn import RemoteModule, ReplicatedModule
from . import _remote
from ._collectives import TrainerCollectives
from ._roles import Roles

__all__ = [
    "take_remote_modules",
    "check_remote_modules",
    "install_forward",
    "replicate",
    "hyperparameters",
    "constructor_arguments",
    "same_hyperparameters",
    "warn_backward_override",
]


def take_remote_modules(root: nn.Module) -> list[tuple[str, RemoteModule]]:
    """Every RemoteModule attribute of ``root``'s module tree, taken out of the tree.

    A RemoteModule raises on ``parameters()``, ``state_dict()`` and ``.to()`` (torch's API), and
    so would every parent module. Moved from the parent's child modules to its ``__dict__``, it
    stays an attribute (``self.emb(x)`` works) but the tree walks skip it. Idempotent.
    """
    found: list[tuple[str, RemoteModule]] = []
    for prefix, module in root.named_modules():
        for name, child in list(module_children(module).items()):
            if isinstance(child, RemoteModule):
                if isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
                    kind = type(module).__name__
                    raise ValueError(
                        f"A RemoteModule sits inside the container '{prefix}' ({kind}); the"
                        " strategy cannot take it out of the module tree there."
                        " HINT: keep RemoteModules as plain attributes of a module (self.emb ="
                        " ...) and call them from forward."
                    )
                del module_children(module)[name]
                object.__setattr__(module, name, child)
        for name, value in vars(module).items():
            if isinstance(value, RemoteModule):
                found.append((f"{prefix}.{name}" if prefix else name, value))
    return found


def check_remote_modules(
    modules: list[tuple[str, RemoteModule]], roles: Roles, collectives: TrainerCollectives | None
) -> None:
    """Raise (on every trainer) unless each RemoteModule lives on a serving rank and, with
    several trainers, all trainers hold the same remote modules (a collective then)."""
    servers = set(roles.servers)
    for name, module in modules:
        owner = module.module_rref.owner()
        if owner.id not in servers:
            where = "a trainer" if owner.id in roles.trainers else "not a serving rank"
            hint = (
                f"place it on a serving rank (e.g. `strategy.server_device(0)`, which is"
                f" 'worker{roles.servers[0]}/cpu')"
                if servers
                else "give the strategy serving ranks (`num_servers=1` or `server_ranks=[...]`)"
                " and place it there"
            )
            raise ValueError(
                f"RemoteModule '{name}' lives on {owner.name} (rank {owner.id}), which is"
                f" {where}; RemoteModules must live on serving ranks (here:"
                f" {sorted(servers) or 'none'}). HINT: {hint}, or make rank {owner.id} a"
                " server with `server_ranks=[...]`."
            )
    if len(roles.trainers) == 1 or collectives is None:
        return
    mine = [(name, m.module_rref.owner().id, m.module_rref._rref_id()) for name, m in modules]
    everyone = collectives.allgather_object(mine)
    for t, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            raise ValueError(
                "DistAutogradStrategy: the trainers hold different RemoteModules (trainer 0:"
                f" {[n for n, *_ in everyone[0]]}, trainer {t}: {[n for n, *_ in theirs]}; a"
                " module created by each trainer is a separate copy on the server). All"
                " trainers must share each RemoteModule. HINT: create RemoteModules with"
                " `self.trainer.strategy.remote_module(...)` in configure_model, which creates"
                " one module and hands it to every trainer."
            )


def replicate(
    module: nn.Module,
    collectives: TrainerCollectives | None,
    num_trainers: int,
    replicate_all: bool,
) -> tuple[ReplicatedModule | None, list[ReplicatedModule]]:
    """The module's local parameters replicated over the trainers: the whole module (wrapped
    here, returned first: the caller frees its communicator) or, with ``replicate_all=False``,
    the ReplicatedModules in it; ``(None, [])`` for a single trainer."""
    if num_trainers == 1:
        return None, []
    if not replicate_all:
        return None, [m for m in module.modules() if isinstance(m, ReplicatedModule)]
    if not any(True for _ in module.parameters()):
        return None, []
    owned = ReplicatedModule(module, collectives.comm, broadcast_buffers=False)
    return owned, [owned]


def install_forward(module: RemoteModule, autocast_dtype: torch.dtype | None) -> None:
    """Give ``module`` a forward that runs under autocast on its owner (None: the default)."""
    from ..nn.remote_module import _install_generated_methods

    _install_generated_methods(module)
    if autocast_dtype is None:
        return

    def forward(*args: Any, **kwargs: Any) -> Any:
        return rpc.rpc_sync(
            module.module_rref.owner(),
            _remote.autocast_forward,
            (module.module_rref, module.device, module.is_device_map_set, autocast_dtype, *args),
            kwargs,
        )

    module.forward = forward


def hyperparameters(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The first param group's values of the optimizer's constructor arguments."""
    group = optimizer.param_groups[0]
    return {k: group[k] for k in optimizer.defaults if k in group and k != "params"}


def constructor_arguments(optimizer_class: type, hparams: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``hparams`` that ``optimizer_class``'s constructor takes: ``defaults`` may
    hold more (AdamW's holds Adam's ``decoupled_weight_decay`` in newer torch, which its own
    constructor refuses); the rest reach the param groups with the first push."""
    parameters = inspect.signature(optimizer_class.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(hparams)
    return {k: v for k, v in hparams.items() if k in parameters}


def same_hyperparameters(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for key, value in a.items():
        other = b[key]
        if isinstance(value, Tensor) or isinstance(other, Tensor):
            if not (
                isinstance(value, Tensor)
                and isinstance(other, Tensor)
                and torch.equal(value, other)
            ):
                return False
        elif value != other:
            return False
    return True


def warn_backward_override(module: Any) -> None:
    if is_overridden("backward", module):
        rank_zero_warn(
            "DistAutogradStrategy runs the distributed backward pass itself; the"
            " LightningModule.backward override is not called."
        )
