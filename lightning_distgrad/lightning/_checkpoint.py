"""What the distgrad strategy adds to checkpoints: remote parameters and remote optimizer states.

The model's state dict holds each RemoteModule's parameters under its attribute name, as a local
model's ``state_dict`` would; loading sends them back to the owner. The first optimizer's state
holds, under :data:`REMOTE_OPTIMIZER_STATES`, the state of every trainer's remote optimizer (each
trainer has its own DistributedOptimizer, with its own per-parameter state on the owners).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from ..nn import RemoteModule
from ..optim import DistributedOptimizer
from ._collectives import TrainerCollectives
from ._model import take_remote_modules
from ._step import DistributedStep

__all__ = [
    "REMOTE_OPTIMIZER_STATES",
    "load_model_state",
    "load_remote_optimizer_state",
    "with_remote_optimizer_states",
    "with_remote_parameters",
]

#: Where ``optimizer_state`` keeps the remote optimizers' states (one entry per trainer).
REMOTE_OPTIMIZER_STATES = "distgrad_remote_optimizer_states"


def with_remote_parameters(
    state: dict[str, Any], remote_modules: list[tuple[str, RemoteModule]]
) -> dict[str, Any]:
    """``state`` (the local module's state dict) plus every remote module's, under its name."""
    for name, module in remote_modules:
        state.update((f"{name}.{k}", v) for k, v in module.remote_state_dict().items())
    return state


def load_model_state(module: nn.Module, state_dict: Mapping[str, Any], strict: bool) -> None:
    """Load ``state_dict`` into ``module``: remote modules' entries go to their owners."""
    state = dict(state_dict)
    for name, remote in take_remote_modules(module):
        prefix = f"{name}."
        part = {k[len(prefix) :]: state.pop(k) for k in list(state) if k.startswith(prefix)}
        if part or strict:
            remote.load_remote_state_dict(part, strict=strict)
    module.load_state_dict(state, strict=strict)


def with_remote_optimizer_states(
    state: dict[str, Any], optimizer: DistributedOptimizer, collectives: TrainerCollectives | None
) -> dict[str, Any]:
    """``state`` plus every trainer's remote optimizer state (a collective over the trainers;
    trainer 0, which writes the checkpoint, gets them all)."""
    remote = optimizer.state_dict()
    everyone = collectives.gather_object(remote, root=0) if collectives is not None else None
    return {**state, REMOTE_OPTIMIZER_STATES: everyone if everyone is not None else [remote]}


def load_remote_optimizer_state(
    step: DistributedStep, remote: list[dict] | None, num_trainers: int, trainer_rank: int
) -> None:
    """Give this trainer's remote optimizer its state from the checkpoint's ``remote`` list."""
    if remote is None:
        rank_zero_warn(
            "DistAutogradStrategy: the checkpoint has no remote optimizer state;"
            " the remote optimizers start afresh."
        )
        return
    if len(remote) != num_trainers:
        raise ValueError(
            f"The checkpoint holds the remote optimizer states of {len(remote)} trainer(s),"
            f" but this run has {num_trainers}. HINT: resume with the same number of"
            " trainers and servers, or load the weights only"
            " (`LightningModule.load_from_checkpoint`) and start the optimizers afresh."
        )
    step.optimizer.load_state_dict(remote[trainer_rank])
    step.forget_pushed()  # push the user's optimizer's values at the next step
