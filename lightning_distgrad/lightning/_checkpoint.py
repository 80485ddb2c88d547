"""What the distgrad strategy adds to checkpoints: remote parameters and remote optimizer states.

The model's state dict holds each RemoteModule's parameters under its attribute name, as a local
model's ``state_dict`` would; loading sends them back to the owner. The first optimizer's state
holds the remote optimizer's state: under :data:`REMOTE_OPTIMIZER_STATE` the one state that all
trainers share (``sync_remote_updates=True``; the same on every trainer), or under
:data:`REMOTE_OPTIMIZER_STATES` every trainer's own (``sync_remote_updates=False``, where each
trainer has its own DistributedOptimizer, with its own per-parameter state on the owners).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from ..nn import RemoteModule
from ._collectives import TrainerCollectives
from ._model import take_remote_modules
from ._step import DistributedStep

__all__ = [
    "REMOTE_OPTIMIZER_STATE",
    "REMOTE_OPTIMIZER_STATES",
    "load_model_state",
    "load_remote_optimizer_state",
    "with_remote_optimizer_states",
    "with_remote_parameters",
]

#: Where ``optimizer_state`` keeps the one remote optimizer's state that the trainers share.
REMOTE_OPTIMIZER_STATE = "distgrad_remote_optimizer_state"
#: Where ``optimizer_state`` keeps the remote optimizers' states of trainers that run ahead (one
#: entry per trainer).
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
    state: dict[str, Any], step: DistributedStep, collectives: TrainerCollectives | None
) -> dict[str, Any]:
    """``state`` plus the remote optimizer state: the shared optimizer's, or every trainer's own
    (then a collective over the trainers; trainer 0, which writes the checkpoint, gets them)."""
    remote = step.optimizer.state_dict()
    if step.shared:
        return {**state, REMOTE_OPTIMIZER_STATE: remote}
    everyone = collectives.gather_object(remote, root=0) if collectives is not None else None
    return {**state, REMOTE_OPTIMIZER_STATES: everyone if everyone is not None else [remote]}


def pop_remote_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """Take the remote optimizer entries out of ``state`` (an optimizer state dict), returned
    under their keys."""
    keys = (REMOTE_OPTIMIZER_STATE, REMOTE_OPTIMIZER_STATES)
    return {key: state.pop(key) for key in keys if key in state}


def load_remote_optimizer_state(
    step: DistributedStep, remote: Mapping[str, Any], num_trainers: int, trainer_rank: int
) -> None:
    """Give the remote optimizer its state from a checkpoint's ``remote`` entries (from
    :func:`pop_remote_optimizer_state`); raises if they were written in the other layout."""
    shared, per_trainer = remote.get(REMOTE_OPTIMIZER_STATE), remote.get(REMOTE_OPTIMIZER_STATES)
    if step.shared and per_trainer is not None:
        raise ValueError(
            "The checkpoint holds one remote optimizer state per trainer (written with"
            " sync_remote_updates=False, or by lightning_distgrad 0.1.0), but the trainers now"
            " share one remote optimizer that steps once on their mean gradient. HINT: resume"
            " with DistAutogradStrategy(sync_remote_updates=False) to go on with per-trainer"
            " updates, or start the remote optimizer afresh from the saved weights: delete"
            f" checkpoint['optimizer_states'][0]['{REMOTE_OPTIMIZER_STATES}'] and save it again."
        )
    if not step.shared and shared is not None:
        raise ValueError(
            "The checkpoint holds the one remote optimizer state that the trainers share"
            " (written with sync_remote_updates=True), but this run keeps one per trainer."
            " HINT: resume with DistAutogradStrategy(sync_remote_updates=True), or start the"
            " remote optimizers afresh from the saved weights: delete"
            f" checkpoint['optimizer_states'][0]['{REMOTE_OPTIMIZER_STATE}'] and save it again."
        )
    if shared is None and per_trainer is None:
        rank_zero_warn(
            "DistAutogradStrategy: the checkpoint has no remote optimizer state;"
            " the remote optimizer starts afresh."
        )
        return
    if step.shared:
        if trainer_rank == 0:  # one optimizer: trainer 0 loads it before its first step
            step.optimizer.load_state_dict(shared)
    else:
        if len(per_trainer) != num_trainers:
            raise ValueError(
                f"The checkpoint holds the remote optimizer states of {len(per_trainer)}"
                f" trainer(s), but this run has {num_trainers}. HINT: resume with the same"
                " number of trainers and servers, or load the weights only"
                " (`LightningModule.load_from_checkpoint`) and start the optimizers afresh."
            )
        step.optimizer.load_state_dict(per_trainer[trainer_rank])
    step.forget_pushed()  # push the user's optimizer's values at the next step
