"""Which ranks train and which serve (:func:`resolve_roles`), and the devices they use."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from .environment import MPIClusterEnvironment

__all__ = ["Roles", "check_devices", "resolve_roles"]

_LAUNCH_HINT = "`mpiexec -n {n} python -m mpi4py train.py` (or `srun -n {n} --mpi=pmix ...`)"


class Roles(NamedTuple):
    """The role of every rank of the world."""

    rank: int
    world_size: int
    servers: tuple[int, ...]
    trainers: tuple[int, ...]

    @property
    def is_server(self) -> bool:
        return self.rank in self.servers

    @property
    def trainer_rank(self) -> int:
        """This rank's index among the trainers (servers: an index after all trainers)."""
        if self.is_server:
            return len(self.trainers) + self.servers.index(self.rank)
        return self.trainers.index(self.rank)


def resolve_roles(
    world_size: int, rank: int, num_servers: int | None, server_ranks: Sequence[int] | None
) -> Roles:
    """The roles that ``num_servers`` (the last N ranks) or ``server_ranks`` give this world.

    Raises the same error on every rank (no communication): ``ValueError`` for arguments that
    do not fit the world, ``RuntimeError`` for a world of one where servers were asked for.
    """
    if num_servers is not None and server_ranks is not None:
        raise ValueError(
            f"DistAutogradStrategy: pass either num_servers ({num_servers}) or server_ranks"
            f" ({list(server_ranks)}), not both."
        )
    if server_ranks is not None:
        requested = [int(r) for r in server_ranks]
        asked = f"server_ranks={requested}"
        if len(set(requested)) != len(requested):
            raise ValueError(f"DistAutogradStrategy: {asked} lists a rank twice.")
    else:
        n = 0 if num_servers is None else int(num_servers)
        if n < 0:
            raise ValueError(f"DistAutogradStrategy: num_servers={n} must be 0 or more.")
        requested = list(range(world_size - n, world_size))
        asked = f"num_servers={n}"
    if requested and world_size == 1:
        raise RuntimeError(
            f"DistAutogradStrategy({asked}) needs at least {len(requested) + 1} ranks (servers"
            " plus at least one trainer), but this process is an MPI world of one: it was"
            " started without mpiexec, or by srun without an MPI plugin. HINT: launch with"
            f" {_LAUNCH_HINT.format(n=len(requested) + 1)}, or drop the servers to train in one"
            " process."
        )
    if len(requested) >= world_size:
        raise ValueError(
            f"DistAutogradStrategy({asked}) leaves no rank to train in this world of"
            f" {world_size} ranks. HINT: launch at least {len(requested) + 1} ranks"
            f" ({_LAUNCH_HINT.format(n=len(requested) + 1)}) or ask for fewer servers."
        )
    outside = [r for r in requested if not 0 <= r < world_size]
    if outside:
        raise ValueError(
            f"DistAutogradStrategy({asked}): rank(s) {outside} do not exist in this world of"
            f" {world_size} ranks (0..{world_size - 1}). HINT: pick ranks below {world_size},"
            f" or launch more ranks ({_LAUNCH_HINT.format(n=max(*outside, world_size - 1) + 1)})."
        )
    servers = tuple(sorted(requested))
    trainers = tuple(r for r in range(world_size) if r not in servers)
    return Roles(rank, world_size, tuple(sorted(servers)), trainers)


def check_devices(
    env: MPIClusterEnvironment, devices: list[torch.device], trainers_on_node: int, num_nodes: int
) -> None:
    """Raise unless ``Trainer(devices=..., num_nodes=...)`` fits the ranks MPI started.

    The launch decides the processes; ``devices`` may be left at its default (1 on CPU, all
    visible GPUs), or equal the ranks on this node, or the trainers on this node.
    """
    on_node = env.local_world_size
    visible = torch.cuda.device_count() if devices and devices[0].type == "cuda" else None
    if len(devices) > 1 and len(devices) not in (on_node, trainers_on_node, visible):
        servers = on_node - trainers_on_node
        raise ValueError(
            f"You set `devices={len(devices)}`, but mpiexec started {on_node} rank(s) on this"
            f" node ({trainers_on_node} training, {servers} serving), and the launch decides"
            f" the processes. HINT: leave `devices` unset, set `devices={on_node}` (or"
            f" `{trainers_on_node}`, the trainers), or launch {len(devices)} rank(s) per node"
            f" (`mpiexec -n {len(devices) * env.num_nodes} ...`)."
        )
    if num_nodes not in (1, env.num_nodes):
        raise ValueError(
            f"You set `num_nodes={num_nodes}`, but mpiexec started ranks on {env.num_nodes}"
            f" node(s). HINT: leave `num_nodes` unset or set `num_nodes={env.num_nodes}`."
        )
