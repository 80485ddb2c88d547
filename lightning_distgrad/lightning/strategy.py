r"""``DistAutogradStrategy``: Lightning training with distributed autograd over MPI.

Some ranks *train* (they run Lightning's loops on their share of the data), others *serve*
(parameter servers that hold :class:`~lightning_distgrad.nn.RemoteModule`\ s and answer RPCs).
Every optimisation step runs in one distributed autograd context: the forward pass of
``training_step`` (RemoteModule calls become recorded RPCs), the FAST-mode distributed backward
pass, and the update, which steps the user's own optimizer over the local parameters and a
:class:`~lightning_distgrad.optim.DistributedOptimizer` of the same class and hyper-parameters
over the remote ones. Local parameters are replicated over the trainers and their gradients
averaged, as DDP does; each RemoteModule is shared by all trainers, and each trainer's update of
it carries ``1/num_trainers`` of its gradient, so that a step applies the mean over the trainers
of every gradient, local or remote (like one process training on all the trainers' batches).

How a script is written (the same script on every rank)::

    import lightning as L
    import lightning_distgrad  # registers strategy="distgrad"
    from lightning_distgrad import DistAutogradStrategy

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.emb = None                      # remote: created in configure_model
            self.fc = torch.nn.Linear(16, 1)     # local: replicated on every trainer

        def configure_model(self):               # runs on trainers, after RPC started
            if self.emb is None:
                strategy = self.trainer.strategy
                self.emb = strategy.remote_module(strategy.server_device(0),
                                                  torch.nn.EmbeddingBag, args=(1000, 16))

        def training_step(self, batch, batch_idx):
            ...                                  # self.fc(self.emb(ids, offsets)), as usual

        def configure_optimizers(self):   # local parameters; the strategy adds the remote ones
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(strategy=DistAutogradStrategy(num_servers=1), max_epochs=1)
    trainer.fit(Model(), dataloader)  # on a serving rank: serves, then returns None

Run with ``mpiexec -n 3 python -m mpi4py train.py``: ranks 0 and 1 train, rank 2 serves. Every
rank builds the same ``Trainer`` and calls the same entry points (``fit``, ``validate``,
``test``, ``predict``) in the same order; on a serving rank each of them answers RPCs until all
trainers have finished it and returns ``None`` (or raises the error a trainer raised), and
``trainer.save_checkpoint`` writes nothing. Guard only code that uses results with
``trainer.is_global_zero`` or ``trainer.strategy.is_server``. Without ``mpiexec`` the same script
trains in one process if no servers are asked for.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from typing_extensions import override

from .. import autograd as dist_autograd
from .. import rpc
from .._compat import after_closure, optimizers_to_device
from ..nn import RemoteModule, ReplicatedModule
from ..optim import DistributedOptimizer
from ..rpc._core import call_all
from . import _remote
from ._collectives import AllGather, TrainerCollectives, reduce_op_name
from ._model import (
    check_remote_modules,
    hyperparameters,
    install_forward,
    same_hyperparameters,
    take_remote_modules,
    warn_backward_override,
)
from ._precision import DistGradClipping, DistGradPrecision, adopt_precision
from ._roles import RoleLauncher, Roles, check_devices, resolve_roles
from .environment import MPIClusterEnvironment

__all__ = ["DistAutogradStrategy"]

log = logging.getLogger(__name__)

#: Where ``optimizer_state`` keeps the remote optimizers' states (one entry per trainer).
REMOTE_OPTIMIZER_STATES = "distgrad_remote_optimizer_states"

_shared_modules = iter(range(1 << 62))  # numbers the shared RemoteModules, in creation order


class DistAutogradStrategy(ParallelStrategy):
    r"""Train with distributed autograd over MPI: trainers, parameter servers, RemoteModules.

    Processes come from ``mpiexec`` or ``srun``, never from Lightning: the strategy carries its
    own :class:`~lightning_distgrad.lightning.MPIClusterEnvironment`, so Lightning's Slurm/MPI
    auto-detection never runs. Every rank runs the same script and builds the same ``Trainer``.
    By default every rank trains; ``num_servers`` (the last ranks) or ``server_ranks`` make some
    ranks serve instead. On a serving rank, ``trainer.fit/validate/test/predict`` start (or join)
    the RPC agent, answer RPCs until every trainer has finished that call, and return ``None``.
    The RPC agent starts once, in the first ``setup_environment`` (an agent that already runs
    over the same world is reused), serves every later ``fit``/``validate``/``test`` call, and
    stops when the process exits (``lightning_distgrad.rpc``'s exit hook).

    For Lightning the world is the trainers: ``trainer.world_size`` counts them,
    ``trainer.global_rank`` numbers them, the ``DistributedSampler`` splits the data over them,
    ``self.log(..., sync_dist=True)``, ``all_gather``, barriers and broadcasts run over an MPI
    communicator of theirs, and progress bar, loggers and checkpoint files belong to trainer 0.

    Each optimisation step runs in one distributed autograd context (open in
    :attr:`context_id`) from the first ``training_step`` of the accumulation window to the
    optimizer step: each batch's forward and FAST-mode distributed backward pass (which adds
    to the context's gradients and frees the batch's graph), then the update. The local
    ``.grad`` is written on the window's last batch (hooks such as ``on_after_backward`` see
    the gradients there). Under manual optimisation one
    context spans each ``training_step``; ``self.manual_backward(loss)`` runs the distributed
    backward pass in it, once per forward pass.

    After the backward pass the local gradients are averaged over the trainers (DDP-style, on
    the last batch of the window) and written to ``.grad``, so ``on_before_optimizer_step``,
    gradient logging and the user's optimizer work as usual. RemoteModules are found among the
    LightningModule's attributes (at any depth) and taken out of the module tree, so
    ``parameters()``, ``state_dict()``, ``.to()`` and the model summary see local parameters
    only. Create them on serving ranks, in ``configure_model``, with :meth:`remote_module`: one
    module shared by all trainers (module constructors run on the server's RPC threads; draw
    random initial values from a ``torch.Generator`` to make them reproducible). Each trainer's
    update of a remote module carries ``1/num_trainers`` of its gradient, so with SGD a step
    applies the mean gradient over all trainers' batches, exactly as for the local parameters.
    The first optimizer of ``configure_optimizers`` also updates the remote parameters: a
    ``DistributedOptimizer`` of its class with the hyper-parameters of its first param group,
    which follows LR schedulers (changed values are pushed before each step).

    Gradient clipping by norm (``gradient_clip_val``, or ``self.clip_gradients`` under manual
    optimisation) uses one global norm over the local gradients and the remote gradients of
    all trainers' contexts; clipping by value clamps each trainer's contribution. Checkpoints
    hold the remote modules' parameters under their attribute names (as a local model's
    ``state_dict`` would) and every trainer's remote optimizer state; resuming restores both.
    ``precision="bf16-mixed"`` also runs the remote modules' forward under autocast.

    Args:
        num_servers (int, optional): the last ``num_servers`` ranks serve (default: none).
        server_ranks (Sequence[int], optional): these ranks serve (instead of ``num_servers``).
        replicate_local_parameters (bool): average the gradients of all local parameters over
            the trainers, as DDP does, and start every trainer from trainer 0's values (default
            True). With False only :class:`~lightning_distgrad.nn.ReplicatedModule`\ s found in
            the LightningModule are synchronised; other local parameters stay per trainer.
        sync_remote_updates (bool): with several trainers, wait after each step until every
            trainer's remote update is applied, so the next forward pass reads the same remote
            parameters everywhere (default True). False lets trainers run ahead (Hogwild-style).
        rpc_timeout (float): default timeout of the RPCs, in seconds (0: none). Default 60.
        num_worker_threads (int): threads that run incoming RPCs on each rank. Default 16.
        device_maps (dict, optional): ``{worker_name: {local_device: remote_device}}`` for
            CUDA tensors sent over RPC (see ``MPIRpcBackendOptions``).
        accelerator, parallel_devices, checkpoint_io, precision_plugin: as for Lightning's
            ``ParallelStrategy``; usually set by the ``Trainer``.
        cluster_environment (MPIClusterEnvironment, optional): default: one over
            ``MPI.COMM_WORLD``.

    Raises:
        ValueError: roles that do not fit the world (no trainer left, unknown ranks), both
            ``num_servers`` and ``server_ranks``, or ``devices``/``num_nodes`` that do not match
            the launch (at ``Trainer(...)``), or a precision other than ``"32-true"`` and
            ``"bf16-mixed"``.
        RuntimeError: servers asked for in an MPI world of one (not launched with ``mpiexec``).
        TypeError: a ``cluster_environment`` that is not an ``MPIClusterEnvironment``.

    Example::

        Run with `mpiexec -n 3 python -m mpi4py train.py` (ranks 0, 1 train; rank 2 serves):

        >>> # xdoctest: +SKIP
        >>> # On every rank:
        >>> trainer = L.Trainer(strategy=DistAutogradStrategy(num_servers=1), max_steps=100)
        >>> trainer.fit(model, train_loader)  # returns None on rank 2 once ranks 0, 1 are done
        >>> trainer.strategy.is_server        # False on ranks 0 and 1
        True
    """

    strategy_name = "distgrad"

    def __init__(
        self,
        num_servers: int | None = None,
        server_ranks: Sequence[int] | None = None,
        *,
        replicate_local_parameters: bool = True,
        sync_remote_updates: bool = True,
        rpc_timeout: float = 60.0,
        num_worker_threads: int = 16,
        device_maps: dict | None = None,
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
        self.replicate_local_parameters = replicate_local_parameters
        self.sync_remote_updates = sync_remote_updates
        self._rpc_options = {
            "rpc_timeout": rpc_timeout,
            "num_worker_threads": num_worker_threads,
            "device_maps": device_maps,
        }
        self._num_nodes = 1
        self._role_launcher: RoleLauncher | None = None
        self._collectives: TrainerCollectives | None = None
        self._world: TrainerCollectives | None = None
        self._local_trainers: tuple[int, int] | None = None  # (local trainer rank, count)
        # One optimisation step.
        self._context: dist_autograd.context | None = None
        self._context_id: int | None = None
        self._seen: dict[Tensor, Tensor] = {}
        self._sync_blocked = False
        # The model's distributed parts (set up in `setup`).
        self._remote_modules: list[tuple[str, RemoteModule]] = []
        self._replicated: list[ReplicatedModule] = []
        self._owned_replica: ReplicatedModule | None = None
        self._dist_optimizer: DistributedOptimizer | None = None
        self._remote_hparams: dict[str, Any] | None = None
        self._loss_scale = 1.0
        self._patched_forwards: list[RemoteModule] = []
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
    def context_id(self) -> int | None:
        """The distributed autograd context of the current optimisation step (None outside)."""
        return self._context_id

    # --- Setup: Trainer construction, then each fit/validate/test/predict --------------------

    @property
    @override
    def precision_plugin(self) -> Precision:
        plugin = ParallelStrategy.precision_plugin.fget(self)
        if not isinstance(plugin, DistGradClipping):  # none set: Lightning's default, adopted
            plugin = DistGradPrecision(self)
            ParallelStrategy.precision_plugin.fset(self, plugin)
        return plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        ParallelStrategy.precision_plugin.fset(self, adopt_precision(plugin, self))

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

    def start_rpc(self) -> None:
        """Start the RPC agent over the world, once; reuse one that already runs over it.

        A collective over the world (trainers and servers) the first time; later calls return
        at once. The agent stops when the process exits (or at ``rpc.shutdown()``).
        """
        from ..rpc import _core

        agent = _core.current_agent()
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

    @override
    def connect(self, model: Any) -> None:
        super().connect(model)
        take_remote_modules(model)

    @override
    def setup(self, trainer: Any) -> None:
        module = self.lightning_module
        self._remote_modules = take_remote_modules(module)
        check_remote_modules(self._remote_modules, self.roles, self._collectives)
        warn_backward_override(module)
        super().setup(trainer)  # converts, moves to device, builds the optimizers
        self._setup_replication(module)
        self._patch_remote_forwards()

    @override
    def model_to_device(self) -> None:
        self.lightning_module.to(self.root_device)

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        self._dist_optimizer, self._remote_hparams = None, None
        if not self._remote_modules:
            return
        if not self.optimizers:
            rank_zero_warn(
                "DistAutogradStrategy: configure_optimizers returned no optimizer, so"
                " the RemoteModules' parameters are not trained."
            )
            return
        optimizer = self.optimizers[0]
        hparams = hyperparameters(optimizer)
        rrefs = [r for _, module in self._remote_modules for r in module.remote_parameters()]
        self._dist_optimizer = DistributedOptimizer(type(optimizer), rrefs, **hparams)
        self._remote_hparams = copy.deepcopy(hparams)

    @override
    def teardown(self) -> None:
        self._close_context()
        for module in self._patched_forwards:
            install_forward(module, None)
        self._patched_forwards = []
        if self._owned_replica is not None:
            self._owned_replica.comm.Free()
            self._owned_replica = None
        self._replicated = []
        super().teardown()  # keeps the RPC agent: the next fit/validate/test reuses it

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._close_context()

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

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulation batches: their backward passes join the window's last one."""
        blocked, self._sync_blocked = self._sync_blocked, True
        try:
            yield None
        finally:
            self._sync_blocked = blocked

    # --- One optimisation step ---------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        if not module.automatic_optimization:
            with self._step_context():
                return super().training_step(*args, **kwargs)
        if self._context is None:  # the first batch of an accumulation window
            self._open_context()
        return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self._context_id is None:
            raise RuntimeError(
                "DistAutogradStrategy: backward was called outside a training step, where no"
                " distributed autograd context is open. HINT: call self.manual_backward(loss)"
                " inside training_step."
            )
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        root = closure_loss if self._loss_scale == 1.0 else closure_loss * self._loss_scale
        # Each batch's pass adds to the context's gradients and frees its graph.
        dist_autograd.backward(
            self._context_id, [root], retain_graph=bool(kwargs.get("retain_graph", False))
        )
        if not (self._sync_blocked and module.automatic_optimization):
            self._collect_local_gradients()  # the last batch of the accumulation window
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        model = model or self.lightning_module
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        closure_result = closure()  # training_step, zero_grad and backward (automatic)
        try:
            if self._context_id is None:
                raise RuntimeError(
                    "DistAutogradStrategy: optimizer.step() was called outside a training step."
                    " HINT: step optimizers inside training_step (manual optimisation)."
                )
            after_closure(self.precision_plugin, model, optimizer)  # hooks and clipping
            optimizer.step(**kwargs)  # the local parameters, from `.grad`
            if self._updates_remote(optimizer):
                self._push_hyperparameters(optimizer)
                self._dist_optimizer.step(self._context_id)
                if self.sync_remote_updates and self.num_trainers > 1:
                    self._collectives.barrier()
        finally:
            if model.automatic_optimization:
                self._close_context()
        return closure_result

    def _updates_remote(self, optimizer: Any) -> bool:
        return (
            self._dist_optimizer is not None
            and bool(self.optimizers)
            and optimizer is self.optimizers[0]
        )

    @contextlib.contextmanager
    def _step_context(self) -> Generator[None, None, None]:
        self._open_context()
        try:
            yield
        finally:
            self._close_context()

    def _open_context(self) -> None:
        if self._context is not None:
            self._close_context()
        context = dist_autograd.context()
        self._context_id = context.__enter__()
        self._context = context
        self._seen = {}

    def _close_context(self) -> None:
        context, self._context, self._context_id = self._context, None, None
        self._seen = {}
        if context is not None:
            context.__exit__(None, None, None)

    def _collect_local_gradients(self) -> None:
        """Average replicated gradients over the trainers and add what is new to ``.grad``.

        ``.grad`` of a local parameter then holds what ``loss.backward()`` would have left
        there: this context's (averaged) gradients so far, plus whatever was in ``.grad``.
        """
        if self.num_trainers > 1:
            for replica in self._replicated:
                replica.sync_gradients(self._context_id)
        grads = dist_autograd.get_gradients(self._context_id)
        unscale = 1.0 / self._loss_scale
        with torch.no_grad():
            for param in self.lightning_module.parameters():
                grad = grads.get(param)
                previous = self._seen.get(param)
                if grad is None or grad is previous:
                    continue
                delta = grad if previous is None else grad - previous
                if unscale != 1.0:
                    delta = delta * unscale
                if param.grad is None:
                    param.grad = delta.detach().clone() if delta is grad else delta.detach()
                else:
                    param.grad.add_(delta)
                self._seen[param] = grad

    def _push_hyperparameters(self, optimizer: Any) -> None:
        """Send the first param group's hyper-parameters to the remote optimizers if changed."""
        hparams = hyperparameters(optimizer)
        if self._remote_hparams is not None and same_hyperparameters(hparams, self._remote_hparams):
            return
        call_all(
            [
                (o.owner(), _remote.set_hyperparameters, (o, hparams))
                for o in self._dist_optimizer.remote_optimizers
            ]
        )
        self._remote_hparams = copy.deepcopy(hparams)

    # --- Gradient clipping over local and remote parameters ----------------------------------

    def clip_gradients_by_norm(self, optimizer: Any, max_norm: float) -> float:
        """Clip local and remote gradients together by their global 2-norm; returns the norm.

        The norm covers the (averaged) local gradients and the remote gradients of every
        trainer's context, summed per parameter: the update this step applies. Every trainer
        gets the same norm and scales its own gradients (local, and remote on their owners).
        """
        local = list(self.precision_plugin.main_params(optimizer))
        local_sq = math.fsum(_remote.sq_norm(p.grad) for p in local if p.grad is not None)
        remote = self._updates_remote(optimizer) and self._context_id is not None
        remote_sq = self._remote_grad_sq_norm() if remote else 0.0
        total = math.sqrt(local_sq + remote_sq)
        coef = min(max_norm / (total + 1e-6), 1.0)
        if coef < 1.0:
            with torch.no_grad():
                for p in local:
                    if p.grad is not None:
                        p.grad.mul_(coef)
            if remote:
                self._on_remote_owners(_remote.scale_grads, coef)
        return total

    def clip_gradients_by_value(self, optimizer: Any, clip_value: float) -> None:
        """Clamp local and (this trainer's) remote gradients to ``[-clip_value, clip_value]``."""
        torch.nn.utils.clip_grad_value_(self.precision_plugin.main_params(optimizer), clip_value)
        if self._updates_remote(optimizer) and self._context_id is not None:
            self._on_remote_owners(_remote.clamp_grads, clip_value * self._loss_scale)

    def _remote_grad_sq_norm(self) -> float:
        context_ids = self._collectives.allgather_object(self._context_id)
        total = None
        if self._collectives.rank == 0:
            total = math.fsum(
                call_all(
                    [
                        (server, _remote.grad_sq_norm, (context_ids,))
                        for server in self.roles.servers
                    ]
                )
            )
        return self._collectives.broadcast(total, 0)

    def _on_remote_owners(self, func: Callable, *args: Any) -> None:
        owners = {o.owner().id for o in self._dist_optimizer.remote_optimizers}
        call_all([(owner, func, (self._context_id, *args)) for owner in sorted(owners)])

    # --- Checkpoints: remote parameters and remote optimizer state ---------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = self.lightning_module.state_dict()
        for name, module in self._remote_modules:
            state.update((f"{name}.{k}", v) for k, v in module.remote_state_dict().items())
        return state

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        remotes = take_remote_modules(module)
        state = dict(checkpoint["state_dict"])
        for name, remote in remotes:
            prefix = f"{name}."
            part = {k[len(prefix) :]: state.pop(k) for k in list(state) if k.startswith(prefix)}
            if part or strict:
                remote.load_remote_state_dict(part, strict=strict)
        module.load_state_dict(state, strict=strict)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        state = super().optimizer_state(optimizer)
        raw = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if self._dist_optimizer is None or not self.optimizers or raw is not self.optimizers[0]:
            return state
        remote = self._dist_optimizer.state_dict()
        everyone = self._collectives.gather_object(remote, root=0)
        return {**state, REMOTE_OPTIMIZER_STATES: everyone if everyone is not None else [remote]}

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        for index, (optimizer, state) in enumerate(zip(self.optimizers, states, strict=False)):
            state = dict(state)
            remote = state.pop(REMOTE_OPTIMIZER_STATES, None)
            optimizer.load_state_dict(state)
            optimizers_to_device([optimizer], self.root_device)
            if index == 0 and self._dist_optimizer is not None:
                self._load_remote_optimizer_state(remote)

    def _load_remote_optimizer_state(self, remote: list[dict] | None) -> None:
        if remote is None:
            rank_zero_warn(
                "DistAutogradStrategy: the checkpoint has no remote optimizer state;"
                " the remote optimizers start afresh."
            )
            return
        if len(remote) != self.num_trainers:
            raise ValueError(
                f"The checkpoint holds the remote optimizer states of {len(remote)} trainer(s),"
                f" but this run has {self.num_trainers}. HINT: resume with the same number of"
                " trainers and servers, or load the weights only"
                " (`LightningModule.load_from_checkpoint`) and start the optimizers afresh."
            )
        self._dist_optimizer.load_state_dict(remote[self.global_rank])
        self._remote_hparams = None  # push the user's optimizer's values at the next step

    # --- Train/eval mode of the remote modules -----------------------------------------------

    @override
    def on_train_start(self) -> None:
        self._set_remote_mode(True)

    @override
    def on_validation_start(self) -> None:
        self._set_remote_mode(False)

    @override
    def on_validation_end(self) -> None:
        trainer = self.lightning_module.trainer
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self._set_remote_mode(True)

    @override
    def on_test_start(self) -> None:
        self._set_remote_mode(False)

    @override
    def on_predict_start(self) -> None:
        self._set_remote_mode(False)

    def _set_remote_mode(self, training: bool) -> None:
        for _, module in self._remote_modules:
            if module.training != training:
                module.train(training)

    # --- Helpers for LightningModules ---------------------------------------------------------

    def remote_module(
        self,
        remote_device: str,
        module_cls: Callable[..., nn.Module],
        args: tuple | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> RemoteModule:
        r"""One RemoteModule shared by all trainers: trainer 0 creates it, the others get it.

        A collective over the trainers: call it on every trainer, in the same order, after the
        strategy has started RPC (in ``configure_model`` or ``setup``).

        Args:
            remote_device (str): a serving rank and device, e.g. :meth:`server_device`.
            module_cls, args, kwargs: as for :class:`~lightning_distgrad.nn.RemoteModule`.

        Returns:
            RemoteModule: on every trainer, a handle to the same remote module.

        Example::

            >>> # xdoctest: +SKIP
            >>> def configure_model(self):
            ...     if self.emb is None:
            ...         strategy = self.trainer.strategy
            ...         self.emb = strategy.remote_module(strategy.server_device(0),
            ...                                           torch.nn.EmbeddingBag, args=(100, 8))
        """
        if self._collectives is None or self.is_server:
            raise RuntimeError(
                "DistAutogradStrategy.remote_module runs on trainers once the strategy is set up."
                " HINT: call it in LightningModule.configure_model (or setup)."
            )
        self.start_rpc()
        key = next(_shared_modules)
        if self._collectives.rank == 0:
            module = RemoteModule(remote_device, module_cls, args, kwargs)
            call_all(
                [(rank, _remote.stash_shared, (key, module)) for rank in self.roles.trainers[1:]]
            )
        self._collectives.barrier()
        if self._collectives.rank != 0:
            module = _remote.take_shared(key)
        return module

    # --- Checks and setup helpers ------------------------------------------------------------

    def _require_layout(self) -> tuple[int, int]:
        if self._local_trainers is None:
            raise RuntimeError(
                "DistAutogradStrategy is not connected to a Trainer yet (its ranks are learned"
                " when the Trainer is built). HINT: pass it to `Trainer(strategy=...)` on every"
                " rank."
            )
        return self._local_trainers

    def _setup_replication(self, module: nn.Module) -> None:
        """Replicated local parameters: the whole module, or the ReplicatedModules in it."""
        self._loss_scale = 1.0 / self.num_trainers if self._remote_modules else 1.0
        self._replicated = []
        if self.num_trainers == 1:
            return
        if self.replicate_local_parameters:
            if any(True for _ in module.parameters()):
                self._owned_replica = ReplicatedModule(
                    module, self._collectives.comm, broadcast_buffers=False
                )
                self._replicated = [self._owned_replica]
        else:
            self._replicated = [m for m in module.modules() if isinstance(m, ReplicatedModule)]

    def _patch_remote_forwards(self) -> None:
        """Under bf16-mixed, run the RemoteModules' forward under autocast on their owners."""
        plugin = self.precision_plugin
        if not isinstance(plugin, MixedPrecision):
            return
        for _, module in self._remote_modules:
            install_forward(module, torch.bfloat16)
            self._patched_forwards.append(module)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Distributed autograd over MPI: trainers and parameter servers",
        )


def _register_with_lightning() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    if DistAutogradStrategy.strategy_name not in StrategyRegistry:
        DistAutogradStrategy.register_strategies(StrategyRegistry)


_register_with_lightning()  # Trainer(strategy="distgrad"); see lightning_distgrad._register
