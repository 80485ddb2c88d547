"""The ranks, roles, communicators and RPC agent of a Lightning strategy over MPI.

:class:`MPIRolesStrategy` is the part of ``DistAutogradStrategy`` that Lightning's
``ParallelStrategy`` layer covers for its other strategies: who this process is (for Lightning
the world is the trainers; serving ranks stand outside it), the launcher
(:class:`RoleLauncher`), the RPC agent over all ranks, and Lightning's collectives
(reduce, barrier, broadcast, all_gather) over the trainers' own communicator. Processes come from
``mpiexec`` or ``srun``, never from Lightning. ``strategy.py`` adds the training itself.

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
import signal
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from .. import rpc
from .._compat import Launcher, quiet_lightning_pytree
from ..rpc import _internal
from . import _requeue
from ._collectives import AllGather, TrainerCollectives, reduce_op_name
from ._remote import StageReport, report_stage, stage_board
from ._requeue import RequeueExit, SlurmRequeue
from ._roles import Roles, check_devices, resolve_roles
from .environment import MPIClusterEnvironment

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = ["MPIRolesStrategy", "RoleLauncher"]

log = logging.getLogger(__name__)

# Every rank counts its launches (one per Trainer entry point); the count names the stage.
_stages = itertools.count()

_SRUN_HINT = r"The `srun` command is available on your system but is not used"


class MPIRolesStrategy(ParallelStrategy):
    """A ``ParallelStrategy`` whose ranks come from MPI, some of which serve instead of training.

    For Lightning the world is the trainers: ``global_rank`` numbers them, ``world_size`` counts
    them, and the collectives run over their communicator. See ``DistAutogradStrategy`` for the
    arguments.
    """

    def __init__(
        self,
        num_servers: int | None = None,
        server_ranks: Sequence[int] | None = None,
        *,
        rpc_timeout: float = 60.0,
        num_worker_threads: int = 16,
        device_maps: dict | None = None,
        auto_requeue: bool = True,
        requeue_signal: signal.Signals = signal.SIGUSR1,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: MPIClusterEnvironment | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        env = MPIClusterEnvironment() if cluster_environment is None else cluster_environment
        if not isinstance(env, MPIClusterEnvironment):
            raise TypeError(
                "DistAutogradStrategy needs an MPIClusterEnvironment (ranks come from MPI), got"
                f" {type(env).__name__}. HINT: pass"
                " `cluster_environment=MPIClusterEnvironment(comm)` or leave it out."
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=env,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if env.world_size() == 1 and (num_servers or server_ranks):
            env.check_slurm_consistency()  # srun without an MPI plugin: say so first
        self.roles: Roles = resolve_roles(
            env.world_size(), env.global_rank(), num_servers, server_ranks
        )
        self._rpc_options = {
            "rpc_timeout": rpc_timeout,
            "num_worker_threads": num_worker_threads,
            "device_maps": device_maps,
        }
        #: Slurm auto-requeue (armed once RPC runs, under Slurm only).
        self.requeue = SlurmRequeue(auto_requeue, requeue_signal)
        self._num_nodes = 1
        self._role_launcher: RoleLauncher | None = None
        self._collectives: TrainerCollectives | None = None  # the trainers
        self._world: TrainerCollectives | None = None  # every rank
        self._local_trainers: tuple[int, int] | None = None  # (local trainer rank, count)
        # The launch is checked against Slurm's view (set_world_ranks raises on a mismatch), so
        # Lightning's advice to prepend `srun` (given whenever srun exists) does not apply.
        warnings.filterwarnings("ignore", message=_SRUN_HINT)
        quiet_lightning_pytree()
        log.debug(
            f"{self.__class__.__name__}: rank {self.roles.rank} of {self.roles.world_size}"
            f" {'serves' if self.is_server else 'trains'}."
        )

    # --- Roles and ranks ---------------------------------------------------------------------

    @property
    def is_server(self) -> bool:
        """Whether this rank serves (holds RemoteModules) rather than trains."""
        return self.roles.is_server

    @property
    def num_trainers(self) -> int:
        """The number of training ranks: Lightning's world size."""
        return len(self.roles.trainers)

    @property
    def server_ranks(self) -> tuple[int, ...]:
        """The global (MPI) ranks of the serving ranks."""
        return self.roles.servers

    def server_device(self, index: int = 0, device: str = "cpu") -> str:
        """The ``remote_device`` string of serving rank number ``index``, e.g. ``"worker2/cpu"``.

        Example::

            >>> # xdoctest: +SKIP
            >>> DistAutogradStrategy(num_servers=1).server_device(0)  # under mpiexec -n 3
            'worker2/cpu'
        """
        if not self.roles.servers:
            raise ValueError(
                "server_device: this strategy has no serving rank. HINT: pass num_servers=N or"
                " server_ranks=[...] to DistAutogradStrategy."
            )
        return f"worker{self.roles.servers[index]}/{device}"

    @property
    @override
    def global_rank(self) -> int:
        return self.roles.trainer_rank

    @property
    @override
    def world_size(self) -> int:
        return self.num_trainers

    @property
    @override
    def local_rank(self) -> int:
        return self._require_layout()[0]

    @property
    @override
    def node_rank(self) -> int:
        return self.cluster_environment.node_rank()

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def is_distributed(self) -> bool:
        """Always True: Lightning then adds a ``DistributedSampler`` and syncs ``self.log``."""
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_trainers, "rank": self.global_rank}

    @property
    @override
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        if devices[0].type == "cuda" and not self.is_server:
            return torch.device("cuda", self.local_rank % torch.cuda.device_count())
        return devices[0] if devices[0].type != "cuda" else torch.device("cpu")

    @property
    @override
    def launcher(self) -> RoleLauncher | None:
        return self._role_launcher

    def set_world_ranks(self) -> None:
        """Called by the Trainer's constructor on every rank: a collective the first time.

        Checks Slurm against MPI, learns the node layout, splits off the trainers'
        communicator, and points Lightning's rank-zero utilities at trainer 0.
        """
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        if self._local_trainers is not None:
            return
        env = self.cluster_environment
        env.check_slurm_consistency()
        leaders = env._get_layout().leaders
        local = [r for r in self.roles.trainers if leaders[r] == leaders[self.roles.rank]]
        self._local_trainers = (
            local.index(self.roles.rank) if not self.is_server else 0,
            len(local),
        )
        from mpi4py import MPI

        self._world = TrainerCollectives(env.world_comm().Dup())
        comm = env.world_comm().Split(MPI.UNDEFINED if self.is_server else 0, self.roles.rank)
        if not self.is_server:
            self._collectives = TrainerCollectives(comm)
        log.debug(
            f"{self.__class__.__name__}: rank {self.roles.rank} is trainer"
            f" {self.global_rank} of {self.world_size} (local {self._local_trainers})."
        )

    @override
    def _configure_launcher(self) -> None:
        check_devices(
            self.cluster_environment,
            self.parallel_devices or [],
            self._require_layout()[1],
            self._num_nodes,
        )
        self._role_launcher = RoleLauncher(self)

    @override
    def setup_environment(self) -> None:
        self._require_layout()
        super().setup_environment()
        self.start_rpc()
        self.requeue.arm()  # after MPI_Init and the agent: MPICH has a handler of its own

    def start_rpc(self) -> None:
        """Start the RPC agent over the world, once; reuse one that already runs over it.

        A collective over the world (trainers and servers) the first time; later calls return
        at once. The agent stops when the process exits (or at ``rpc.shutdown()``).
        """
        agent = _internal.current_agent()
        roles = self.roles
        if agent is not None:
            if len(agent.infos) != roles.world_size or agent.info.id != roles.rank:
                raise RuntimeError(
                    f"DistAutogradStrategy: an RPC agent already runs as {agent.info} in a world"
                    f" of {len(agent.infos)}, but this rank is {roles.rank} of"
                    f" {roles.world_size}. HINT: call lightning_distgrad.rpc.shutdown() first,"
                    " or start RPC over the strategy's communicator."
                )
            return
        log.debug(f"{self.__class__.__name__}: starting RPC on rank {roles.rank}.")
        options = rpc.MPIRpcBackendOptions(
            comm=self.cluster_environment.world_comm(), **self._rpc_options
        )
        rpc.init_rpc(f"worker{roles.rank}", rpc_backend_options=options)

    def world_barrier(self) -> None:
        """A barrier over every rank, trainers and servers (each Trainer entry point starts with
        one)."""
        if self._world is not None:
            self._world.barrier()

    # --- Lightning's collectives (the trainers only) -----------------------------------------

    @override
    def barrier(self, name: str | None = None) -> None:
        if self._collectives is not None:
            self._collectives.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self._collectives is None:
            return obj
        return self._collectives.broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, Tensor) or self._collectives is None:
            return tensor
        return self._collectives.all_reduce(tensor, reduce_op_name(reduce_op))

    @override
    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        if self._collectives is None:
            return tensor.unsqueeze(0)
        if sync_grads and torch.is_grad_enabled() and tensor.requires_grad:
            return AllGather.apply(tensor, self._collectives)
        return self._collectives.all_gather(tensor)

    def _require_layout(self) -> tuple[int, int]:
        if self._local_trainers is None:
            raise RuntimeError(
                "DistAutogradStrategy is not connected to a Trainer yet (its ranks are learned"
                " when the Trainer is built). HINT: pass it to `Trainer(strategy=...)` on every"
                " rank."
            )
        return self._local_trainers


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
            _internal.call_all([(server, report_stage, (report,)) for server in roles.servers])
        except Exception as e:  # picklability of an odd exception type: keep the text
            if error is None:
                raise
            log.debug(f"reporting {error} failed ({e}); reporting a RuntimeError instead")
            report = StageReport(stage, roles.trainer_rank, (RuntimeError, error[1]))
            _internal.call_all([(server, report_stage, (report,)) for server in roles.servers])
