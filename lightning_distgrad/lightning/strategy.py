r"""``DistAutogradStrategy``: Lightning training with distributed autograd over MPI.

Some ranks *train* (they run Lightning's loops on their share of the data), others *serve*
(parameter servers that hold :class:`~lightning_distgrad.nn.RemoteModule`\ s and answer RPCs);
the class docstring says how a step runs and how a script is written. Its parts, split as
Lightning splits a strategy: ``_parallel`` (ranks, roles, the RPC agent and Lightning's
collectives, the launcher), ``_roles``, ``environment``, ``_precision`` (which hands clipping to
the step), ``_step`` (one optimisation step, its clipping across ranks), ``_checkpoint`` and
``_model``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from .._compat import after_closure, optimizers_to_device
from ..nn import RemoteModule, ReplicatedModule
from ..rpc._internal import record_rpcs
from . import _remote, _requeue
from ._checkpoint import (
    REMOTE_OPTIMIZER_STATE,
    REMOTE_OPTIMIZER_STATES,
    load_model_state,
    load_remote_optimizer_state,
    pop_remote_optimizer_state,
    with_remote_optimizer_states,
    with_remote_parameters,
)
from ._model import (
    check_remote_modules,
    install_forward,
    replicate,
    take_remote_modules,
    warn_backward_override,
)
from ._parallel import MPIRolesStrategy
from ._precision import DistGradClipping, DistGradPrecision, adopt_precision
from ._step import DistributedStep

__all__ = ["DistAutogradStrategy", "REMOTE_OPTIMIZER_STATE", "REMOTE_OPTIMIZER_STATES"]

log = logging.getLogger(__name__)


class DistAutogradStrategy(MPIRolesStrategy):
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
    optimizer step: each batch's forward and distributed backward pass (which adds
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
    random initial values from a ``torch.Generator`` to make them reproducible). The first
    optimizer of ``configure_optimizers`` also updates the remote parameters: one
    ``DistributedOptimizer`` of its class with the hyper-parameters of its first param group,
    shared by all trainers, which follows LR schedulers (changed values are pushed before each
    step). Each step, trainer 0 steps it once on the mean of all trainers' remote gradients
    while the other trainers wait, as DDP's optimizer steps once on the averaged ``.grad``: Adam,
    weight decay and every other ``torch.optim`` optimizer give DDP's numbers.

    Gradient clipping by norm (``gradient_clip_val``, or ``self.clip_gradients`` under manual
    optimisation) uses one global norm over the local gradients and the trainers' mean remote
    gradient; clipping by value clamps that mean, as DDP clamps its averaged ``.grad``.
    Checkpoints hold the remote modules' parameters under their attribute names (as a local
    model's ``state_dict`` would) and the remote optimizer's state, the same on every trainer;
    resuming restores both. ``precision="bf16-mixed"`` also runs the remote modules' forward
    under autocast.

    Args:
        num_servers (int, optional): the last ``num_servers`` ranks serve (default: none).
        server_ranks (Sequence[int], optional): these ranks serve (instead of ``num_servers``).
        replicate_local_parameters (bool): average the gradients of all local parameters over
            the trainers, as DDP does, and start every trainer from trainer 0's values (default
            True). With False only :class:`~lightning_distgrad.nn.ReplicatedModule`\ s found in
            the LightningModule are synchronised; other local parameters stay per trainer.
        sync_remote_updates (bool): one remote optimizer for all trainers, stepped once per
            step on their mean gradient while they wait, as DDP (default True). False lets
            trainers run ahead, Hogwild-style: each trainer has its own remote optimizer (its
            own Adam moments, say) and steps it on its own ``1/num_trainers`` share of the
            gradient whenever it gets there, so weight decay is applied once per trainer,
            stateful optimizers see each trainer's share as a separate step, clipping by value
            clamps each share, and a forward pass may read parameters that another trainer is
            updating. Only SGD without weight decay, which is linear in the gradient, then adds
            up to DDP's update.
        **options: the settings below, by keyword.
        rpc_timeout (float): default timeout of the RPCs, in seconds (0: none). Default 60.
        num_worker_threads (int): threads that run incoming RPCs on each rank. Default 16.
        device_maps (dict, optional): ``{worker_name: {local_device: remote_device}}`` for
            CUDA tensors sent over RPC (see ``MPIRpcBackendOptions``).
        auto_requeue (bool): under Slurm, when ``requeue_signal`` reaches any rank, stop every
            rank after one common step, write a Lightning hpc checkpoint
            (``hpc_ckpt_N.ckpt`` in ``default_root_dir``), requeue the job and exit (``fit``
            raises a ``SystemExit`` with status 0); the requeued job resumes from it. As
            Lightning's ``SLURMEnvironment(auto_requeue=True)``. Default True; outside Slurm
            the signal changes nothing.
        requeue_signal (signal.Signals): the signal of ``sbatch --signal``. Default ``SIGUSR1``.
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

        # train.py, the same script on every rank; run it with
        # `mpiexec -n 3 python -m mpi4py train.py`: ranks 0 and 1 train, rank 2 serves.
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

        >>> # xdoctest: +SKIP
        >>> trainer = L.Trainer(strategy=DistAutogradStrategy(num_servers=1), max_epochs=1)
        >>> trainer.fit(Model(), dataloader)  # on rank 2: serves, returns None once 0, 1 are done
        >>> trainer.strategy.is_server        # False on ranks 0 and 1
        True

    Every rank calls the same entry points in the same order; a serving rank raises the error a
    trainer raised, and ``trainer.save_checkpoint`` writes nothing there. Guard only code that
    uses results with ``trainer.is_global_zero`` or ``trainer.strategy.is_server``. Without
    ``mpiexec`` the same script trains in one process if no servers are asked for.
    """

    strategy_name = "distgrad"

    def __init__(
        self,
        num_servers: int | None = None,
        server_ranks: Sequence[int] | None = None,
        *,
        replicate_local_parameters: bool = True,
        sync_remote_updates: bool = True,
        **options: Any,
    ) -> None:
        # First: the precision plugin, adopted while the base class is built, clips through it.
        self._step = DistributedStep()  # the current optimisation step, the remote optimizer
        super().__init__(num_servers, server_ranks, **options)
        self.replicate_local_parameters = replicate_local_parameters
        self.sync_remote_updates = sync_remote_updates
        self._sync_blocked = False
        # The model's distributed parts (set up in `setup`).
        self._remote_modules: list[tuple[str, RemoteModule]] = []
        self._replicated: list[ReplicatedModule] = []
        self._owned_replica: ReplicatedModule | None = None
        self._patched_forwards: list[RemoteModule] = []
        self._rpc_recording = contextlib.ExitStack()  # record_rpcs() from setup to teardown

    @property
    def context_id(self) -> int | None:
        """The distributed autograd context of the current optimisation step (None outside)."""
        return self._step.context_id

    # --- Setup: Trainer construction, then each fit/validate/test/predict --------------------

    @property
    @override
    def precision_plugin(self) -> Precision:
        plugin = ParallelStrategy.precision_plugin.fget(self)
        if not isinstance(plugin, DistGradClipping):  # none set: Lightning's default, adopted
            plugin = DistGradPrecision(self._step)
            ParallelStrategy.precision_plugin.fset(self, plugin)
        return plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        ParallelStrategy.precision_plugin.fset(self, adopt_precision(plugin, self._step))

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
        # Lightning's PyTorchProfiler (Kineto) lists the step's RPCs, as documented.
        self._rpc_recording.enter_context(record_rpcs())
        if not any(isinstance(c, _requeue.RequeueCheckpoint) for c in trainer.callbacks):
            trainer.callbacks.append(_requeue.RequeueCheckpoint())
        super().setup(trainer)  # converts, moves to device, builds the optimizers
        self._step.loss_scale = 1.0 / self.num_trainers if self._remote_modules else 1.0
        self._owned_replica, self._replicated = replicate(
            module, self._collectives, self.num_trainers, self.replicate_local_parameters
        )
        if isinstance(self.precision_plugin, MixedPrecision):  # remote forwards autocast too
            for _, remote in self._remote_modules:
                install_forward(remote, torch.bfloat16)
                self._patched_forwards.append(remote)

    @override
    def model_to_device(self) -> None:
        self.lightning_module.to(self.root_device)

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        self._step.drop_optimizer()
        self._step.shared = self.sync_remote_updates
        if not self._remote_modules:
            return
        if not self.optimizers:
            rank_zero_warn(
                "DistAutogradStrategy: configure_optimizers returned no optimizer, so"
                " the RemoteModules' parameters are not trained."
            )
            return
        self._step.build_optimizer(
            self.optimizers[0],
            self._remote_modules,
            self._collectives,
            self.roles.trainers,
            self.roles.servers,
        )

    @override
    def teardown(self) -> None:
        self._rpc_recording.close()
        self._step.close()
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
        self._step.close()

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
            with self._step.scope():
                return super().training_step(*args, **kwargs)
        if self._step.context is None:  # the first batch of an accumulation window
            self._step.open()
        return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self._step.context_id is None:
            raise RuntimeError(
                "DistAutogradStrategy: backward was called outside a training step, where no"
                " distributed autograd context is open. HINT: call self.manual_backward(loss)"
                " inside training_step."
            )
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        # Each batch's pass adds to the context's gradients and frees its graph.
        self._step.backward(closure_loss, retain_graph=bool(kwargs.get("retain_graph", False)))
        if not (self._sync_blocked and module.automatic_optimization):
            # The last batch of the accumulation window.
            self._step.collect_local_gradients(
                module.parameters(), self._replicated, self.num_trainers
            )
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
            if self._step.context_id is None:
                raise RuntimeError(
                    "DistAutogradStrategy: optimizer.step() was called outside a training step."
                    " HINT: step optimizers inside training_step (manual optimisation)."
                )
            after_closure(self.precision_plugin, model, optimizer)  # hooks and clipping
            optimizer.step(**kwargs)  # the local parameters, from `.grad`
            if self._step.updates_remote(optimizer):
                self._step.step_remote(optimizer)  # shared: every trainer waits for the update
            if self.requeue.armed:
                self.requeue.vote(self._collectives)
        finally:
            if model.automatic_optimization:
                self._step.close()
        return closure_result

    # --- Checkpoints: remote parameters and remote optimizer state ---------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return with_remote_parameters(self.lightning_module.state_dict(), self._remote_modules)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        load_model_state(self.lightning_module, checkpoint["state_dict"], strict)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        state = super().optimizer_state(optimizer)
        raw = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if self._step.optimizer is None or not self.optimizers or raw is not self.optimizers[0]:
            return state
        return with_remote_optimizer_states(state, self._step, self._collectives)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        for index, (optimizer, state) in enumerate(zip(self.optimizers, states, strict=False)):
            state = dict(state)
            remote = pop_remote_optimizer_state(state)
            optimizer.load_state_dict(state)
            optimizers_to_device([optimizer], self.root_device)
            if index == 0 and self._step.optimizer is not None:
                load_remote_optimizer_state(self._step, remote, self.num_trainers, self.global_rank)

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
        return _remote.share(
            self._collectives,
            self.roles.trainers,
            lambda: RemoteModule(remote_device, module_cls, args, kwargs),
        )

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
