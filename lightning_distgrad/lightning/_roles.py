"""Which ranks train and which serve, and the launcher that sends serving ranks to their serve loop.

Every rank runs the same script and calls the same ``Trainer`` entry points (``fit``,
``validate``, ``test``, ``predict``). Lightning hands each entry point to the strategy's
launcher. On a training rank :class:`RoleLauncher` runs it as usual and, when it ends (or
fails), reports to every serving rank. On a serving rank it runs no Lightning code at all: it
joins the RPC agent, answers RPCs (RemoteModule forwards, backward passes, optimizer steps,
checkpoint reads) until every trainer has reported, then returns ``None``, or raises the error a
trainer reported.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from lightning.pytorch.trainer.states import TrainerStatus
from typing_extensions import override

from .._compat import Launcher
from ..rpc._internal import call_all
from . import _requeue
from ._remote import StageReport, report_stage, stage_board
from ._requeue import RequeueExit

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from ._parallel import MPIRolesStrategy
    from .environment import MPIClusterEnvironment

__all__ = ["Roles", "RoleLauncher", "check_devices", "resolve_roles"]

log = logging.getLogger(__name__)

# Every rank counts its launches (one per Trainer entry point); the count names the stage.
_stages = itertools.count()

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


class RoleLauncher(Launcher):
    """Runs a Trainer entry point on training ranks and the serve loop on serving ranks."""

    def __init__(self, strategy: MPIRolesStrategy) -> None:
        self._strategy = strategy

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return True  # starts no process

    @override
    def launch(
        self, function: Callable, *args: Any, trainer: Trainer | None = None, **kwargs: Any
    ) -> Any:
        stage = next(_stages)
        # Every rank enters together: a serving rank's main thread has finished building its
        # copy of the model (which draws from the global RNG) before any trainer asks one of
        # its RPC threads to build a RemoteModule, so seeded runs stay deterministic.
        self._strategy.world_barrier()
        if self._strategy.is_server:
            return self._serve(stage, trainer)
        error: tuple[type, str] | None = None
        requeue = False
        try:
            return function(*args, **kwargs)
        except RequeueExit:
            requeue = True
            raise
        except BaseException as e:
            error = (type(e), f"{type(e).__name__}: {e}")
            raise
        finally:
            self._report(stage, error, requeue)

    @override
    def kill(self, signum: Any) -> None:
        """Nothing to kill: mpiexec or srun owns the processes."""

    def _serve(self, stage: int, trainer: Trainer | None) -> None:
        strategy = self._strategy
        roles = strategy.roles
        log.debug(f"{strategy.__class__.__name__}: rank {roles.rank} serves stage {stage}.")
        strategy.start_rpc()
        requeue = strategy.requeue
        if requeue.arm():
            # The signal handler only sets a flag: look at it now and then, and pass it on.
            while (reports := stage_board.wait(stage, len(roles.trainers), 0.25)) is None:
                requeue.relay(roles.trainers)
        else:
            reports = stage_board.wait(stage, len(roles.trainers))
        if trainer is not None:
            trainer.state.status = TrainerStatus.FINISHED
        failed = sorted((r for r in reports if r.error is not None), key=lambda r: r.trainer_rank)
        if failed:
            exc_type, message = failed[0].error
            text = (
                f"DistAutogradStrategy: trainer {failed[0].trainer_rank} (rank"
                f" {roles.trainers[failed[0].trainer_rank]}) failed, so serving rank"
                f" {roles.rank} stops too. The trainer's error: {message}"
            )
            try:
                raise exc_type(text)
            except TypeError:  # an exception type whose constructor takes other arguments
                raise RuntimeError(text) from None
        if any(r.requeue for r in reports):
            log.info(f"rank {roles.rank} stops for the requeue of the Slurm job.")
            _requeue.exit_for_requeue(None)
            raise RequeueExit(_requeue.slurm_job_id())
        log.debug(f"{strategy.__class__.__name__}: rank {roles.rank} served stage {stage}.")

    def _report(self, stage: int, error: tuple[type, str] | None, requeue: bool = False) -> None:
        strategy = self._strategy
        roles = strategy.roles
        if not roles.servers:
            return
        # Servers wait inside init_rpc if this trainer failed before starting RPC.
        strategy.start_rpc()
        report = StageReport(stage, roles.trainer_rank, error, requeue)
        try:
            call_all([(server, report_stage, (report,)) for server in roles.servers])
        except Exception as e:  # picklability of an odd exception type: keep the text
            if error is None:
                raise
            log.debug(f"reporting {error} failed ({e}); reporting a RuntimeError instead")
            report = StageReport(stage, roles.trainer_rank, (RuntimeError, error[1]))
            call_all([(server, report_stage, (report,)) for server in roles.servers])
