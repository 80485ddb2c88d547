"""Remote parameters under ``DistAutogradStrategy`` step as under Lightning's own DDP.

The same LightningModule (an ``EmbeddingBag`` that is a RemoteModule on a serving rank under the
strategy and a local module under DDP, and a dense head on the trainers), the same seed, data and
``DistributedSampler``, trained with ``DistAutogradStrategy`` and with Lightning's
``DDPStrategy`` (gloo, over a process group of the trainer ranks), in the same job. After every
optimizer step, every parameter (local and remote) and every trainer's loss must agree within
1e-5, for every ``torch.optim`` optimizer, weight decay, clipping by norm and by value,
accumulation and an LR scheduler. ``SparseAdam`` on a sparse table, which DDP cannot average
into one sparse ``.grad``, is compared with a one-process replay of DDP's math instead.

Under ``mpiexec -n 2`` one trainer runs against one server; under ``-n 4`` three trainers against
one server, and two trainers against two serving ranks. Run-ahead mode
(``sync_remote_updates=False``) keeps one remote optimizer per trainer: each trainer's steps
are all applied. Checkpoints hold the one shared optimizer state, resume exactly, and one in the
per-trainer layout is refused with a hint.
"""

from __future__ import annotations

from contextlib import contextmanager

import lightning as L
import pytest
import torch
import torch.distributed as dist
from _dist_utils import make_trainer, sampled_batch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_distgrad import DistAutogradStrategy
from lightning_distgrad.lightning.strategy import REMOTE_OPTIMIZER_STATE, REMOTE_OPTIMIZER_STATES

TOL = 1e-5
BATCH = 8  # per trainer
VOCAB, DIM, BAG, HIDDEN = 50, 8, 4, 16

OPTIMIZERS = {
    "adam": (torch.optim.Adam, {"lr": 0.05}),
    "adamw": (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
    "sgd_nesterov_weight_decay": (
        torch.optim.SGD,
        {"lr": 0.2, "momentum": 0.9, "nesterov": True, "weight_decay": 0.05},
    ),
    "rmsprop": (torch.optim.RMSprop, {"lr": 0.01, "weight_decay": 0.01}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
}


# --- The model ---------------------------------------------------------------------------------


class Table(nn.EmbeddingBag):
    """``EmbeddingBag(mode="sum")`` with initial weights from a fixed seed."""

    def __init__(self, sparse: bool = False):
        super().__init__(VOCAB, DIM, mode="sum", sparse=sparse)
        with torch.no_grad():
            self.weight.copy_(torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(3)))


class TableModel(L.LightningModule):
    """A table (remote on the first serving rank, or local with ``remote=False``) and a local
    head: a dense MLP, or with ``sparse=True`` a second, local sparse table (SparseAdam steps
    sparse gradients only)."""

    def __init__(
        self,
        optimizer: str = "adam",
        remote: bool = True,
        sparse: bool = False,
        schedule: bool = False,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.table = None if remote else Table(sparse)
        torch.manual_seed(0)
        if sparse:
            self.head = Table(sparse=True)
        else:
            self.head = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.table is None:
            strategy = self.trainer.strategy
            self.table = strategy.remote_module(
                strategy.server_device(0), Table, kwargs={"sparse": self.hparams.sparse}
            )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.hparams.sparse:
            return (self.table(ids) * self.head(ids)).sum(1, keepdim=True)
        return self.head(self.table(ids))

    def training_step(self, batch, batch_idx):
        ids, target = batch
        loss = nn.functional.mse_loss(self(ids), target)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        ids, target = batch
        self.log("val_loss", nn.functional.mse_loss(self(ids), target))

    def configure_optimizers(self):
        if self.hparams.sparse:
            return torch.optim.SparseAdam(self.parameters(), lr=0.05)
        cls, kwargs = OPTIMIZERS[self.hparams.optimizer]
        optimizer = cls(self.parameters(), **kwargs)
        if not self.hparams.schedule:
            return optimizer
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def make_data(steps: int, trainers: int, seed: int = 1) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (steps * BATCH * trainers, BAG), generator=generator)
    target = torch.randn(len(ids), 1, generator=generator)
    return TensorDataset(ids, target)


def loader(data: TensorDataset) -> DataLoader:
    return DataLoader(data, batch_size=BATCH, shuffle=False)


class StepRecorder(L.Callback):
    """Every parameter, local and remote, after every optimizer step."""

    def __init__(self):
        self.states: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == len(self.states):  # no step at this batch: accumulating
            return
        state = trainer.strategy.lightning_module_state_dict()
        self.states.append({k: v.detach().clone().to_dense() for k, v in state.items()})


# --- Running both strategies -------------------------------------------------------------------


class TrainerRanks(ClusterEnvironment):
    """Lightning's DDP over the trainer ranks of the job: a node per rank, one device each."""

    def __init__(self, rank: int, size: int):
        super().__init__()
        self._rank, self._size = rank, size

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        return 0  # unused: the process group exists before DDP starts

    @staticmethod
    def detect() -> bool:
        return True

    def world_size(self) -> int:
        return self._size

    def set_world_size(self, size: int) -> None:
        pass

    def global_rank(self) -> int:
        return self._rank

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return self._rank


@contextmanager
def trainers_process_group(world, trainers: int):
    """torch.distributed's default group (gloo) over ranks ``0..trainers-1``; a collective."""
    store = None
    if world.rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, trainers, is_master=True, wait_for_workers=False)
    port = world.comm.bcast(store.port if store else None, root=0)
    if 0 < world.rank < trainers:
        store = dist.TCPStore("127.0.0.1", port, trainers, is_master=False)
    if world.rank < trainers:
        dist.init_process_group("gloo", store=store, rank=world.rank, world_size=trainers)
    try:
        yield
    finally:
        world.barrier()
        if world.rank < trainers:
            dist.destroy_process_group()


def servers_for(world, num_servers: int) -> list[int]:
    if world.size - num_servers < 1:
        pytest.skip(f"{num_servers} serving rank(s) leave no trainer in a world of {world.size}")
    if num_servers > 1 and world.size < 4:
        pytest.skip("two serving ranks: run with 4 ranks")
    return list(range(world.size - num_servers, world.size))


def fit(strategy, model: TableModel, data: TensorDataset, **options) -> StepRecorder:
    recorder = StepRecorder()
    L.seed_everything(0, verbose=False)
    trainer = make_trainer(strategy, max_epochs=1, callbacks=[recorder], **options)
    trainer.fit(model, loader(data))
    return recorder


def fit_both(world, num_servers: int, data_steps: int, model_args: dict, **options):
    """``(distgrad recorder, DDP recorder, distgrad model, DDP model)`` on trainers; ``None``
    on serving ranks."""
    servers = servers_for(world, num_servers)
    trainers = world.size - num_servers
    data = make_data(data_steps, trainers)
    model = TableModel(**model_args)
    ours = fit(DistAutogradStrategy(server_ranks=servers), model, data, **options)
    with trainers_process_group(world, trainers):
        if world.rank in servers:
            return None  # after the trainers' DDP run: the group's barrier
        reference = TableModel(remote=False, **model_args)
        ddp = DDPStrategy(
            process_group_backend="gloo", cluster_environment=TrainerRanks(world.rank, trainers)
        )
        theirs = fit(ddp, reference, data, num_nodes=trainers, devices=1, **options)
    return ours, theirs, model, reference


def assert_steps_match(ours: StepRecorder, theirs: StepRecorder, model, reference) -> None:
    assert len(ours.states) == len(theirs.states) > 0
    for step, (mine, expected) in enumerate(zip(ours.states, theirs.states, strict=True)):
        expected = {k.removeprefix("module."): v for k, v in expected.items()}
        assert sorted(mine) == sorted(expected)
        for key, value in expected.items():
            diff = (mine[key] - value).abs().max().item()
            assert diff <= TOL, f"step {step}, {key}: max abs difference {diff:.3g} > {TOL}"
    assert model.losses == pytest.approx(reference.losses, abs=TOL)


# --- Every optimizer: the same numbers as DDP --------------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("num_servers", [1, 2])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_each_optimizer_steps_the_remote_table_as_ddp(rpc_world, optimizer, num_servers):
    runs = fit_both(rpc_world, num_servers, 3, {"optimizer": optimizer})
    if runs is not None:
        assert_steps_match(*runs)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "options",
    [
        {"gradient_clip_val": 0.05},
        {"gradient_clip_val": 0.002, "gradient_clip_algorithm": "value"},
        {"accumulate_grad_batches": 2},
    ],
    ids=["clip_norm", "clip_value", "accumulate"],
)
def test_clipping_and_accumulation_with_adam_match_ddp(rpc_world, options):
    runs = fit_both(rpc_world, 1, 4, {"optimizer": "adamw"}, **options)
    if runs is not None:
        assert_steps_match(*runs)


@pytest.mark.mpi(min_size=2)
def test_an_lr_scheduler_reaches_the_one_remote_optimizer(rpc_world):
    runs = fit_both(rpc_world, 1, 3, {"optimizer": "adam", "schedule": True})
    if runs is not None:
        assert_steps_match(*runs)
        assert runs[2].trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 / 8)


# --- SparseAdam on a sparse table: against a one-process replay of DDP's math ------------------


@pytest.mark.mpi(min_size=2)
def test_sparse_adam_on_a_sparse_table_steps_on_the_mean_gradient(rpc_world):
    servers = servers_for(rpc_world, 1)
    trainers = rpc_world.size - 1
    data = make_data(3, trainers)
    model = TableModel(sparse=True)
    ours = fit(DistAutogradStrategy(server_ranks=servers), model, data)
    if rpc_world.rank in servers:
        return
    reference = TableModel(sparse=True, remote=False)
    optimizer = reference.configure_optimizers()
    for step in range(3):
        ids, target = sampled_batch(data, step, trainers, BATCH)
        optimizer.zero_grad()
        nn.functional.mse_loss(reference(ids), target).backward()  # the mean over all batches
        optimizer.step()
        for key, value in reference.state_dict().items():
            diff = (ours.states[step][key] - value).abs().max().item()
            assert diff <= TOL, f"step {step}, {key}: {diff:.3g}"
    assert all(s["table.weight"].shape == (VOCAB, DIM) for s in ours.states)


# --- Run-ahead mode: one remote optimizer per trainer ------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_run_ahead_mode_applies_every_trainers_steps(rpc_world):
    servers = servers_for(rpc_world, 1)
    trainers = rpc_world.size - 1
    L.seed_everything(0, verbose=False)
    trainer = make_trainer(
        DistAutogradStrategy(server_ranks=servers, sync_remote_updates=False), max_epochs=1
    )
    trainer.fit(TableModel(optimizer="adam"), loader(make_data(3, trainers)))
    if trainer.strategy.is_server:
        return
    remote = trainer.strategy.optimizer_state(trainer.optimizers[0])[REMOTE_OPTIMIZER_STATES]
    if trainer.is_global_zero:
        assert len(remote) == trainers  # one optimizer per trainer, each stepped 3 times
        for per_trainer in remote:
            (state,) = per_trainer.values()
            assert [float(s["step"]) for s in state["state"].values()] == [3.0]


# --- Checkpoints -------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_resume_with_adam_continues_exactly_from_the_one_shared_state(rpc_world, mpi_tmp_path):
    servers = servers_for(rpc_world, 1)
    data = make_data(2, rpc_world.size - 1)
    path = str(mpi_tmp_path / "epoch1.ckpt")

    def run(epochs: int, ckpt_path: str | None = None) -> L.Trainer:
        L.seed_everything(0, verbose=False)
        trainer = make_trainer(DistAutogradStrategy(server_ranks=servers), max_epochs=epochs)
        trainer.fit(TableModel(optimizer="adam"), loader(data), ckpt_path=ckpt_path)
        return trainer

    straight = run(2)
    first = run(1)
    first.save_checkpoint(path)
    if not first.strategy.is_server:  # every trainer's state is the same, one optimizer
        mine = first.strategy.optimizer_state(first.optimizers[0])[REMOTE_OPTIMIZER_STATE]
        everyone = first.strategy._collectives.allgather_object(mine)
        assert all(_same_state(s, everyone[0]) for s in everyone)
    resumed = run(2, path)
    if straight.strategy.is_server:
        return
    checkpoint = torch.load(path, weights_only=False)
    (state,) = checkpoint["optimizer_states"][0][REMOTE_OPTIMIZER_STATE].values()
    assert [float(s["step"]) for s in state["state"].values()] == [2.0]
    assert REMOTE_OPTIMIZER_STATES not in checkpoint["optimizer_states"][0]
    assert resumed.global_step == straight.global_step == 4
    ours = resumed.strategy.lightning_module_state_dict()
    for key, value in straight.strategy.lightning_module_state_dict().items():
        assert (ours[key] - value).abs().max().item() <= TOL, key


def _same_state(a: dict, b: dict) -> bool:
    flat_a, flat_b = _flatten(a), _flatten(b)
    return flat_a.keys() == flat_b.keys() and all(
        torch.equal(v, flat_b[k]) if isinstance(v, torch.Tensor) else v == flat_b[k]
        for k, v in flat_a.items()
    )


def _flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        return {
            k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}/{key}").items()
        }
    if isinstance(tree, (list, tuple)):
        return {
            k: v for i, sub in enumerate(tree) for k, v in _flatten(sub, f"{prefix}/{i}").items()
        }
    return {prefix: tree}


@pytest.mark.mpi(min_size=2)
def test_a_per_trainer_checkpoint_is_refused_with_a_hint_and_load_from_checkpoint_is_local(
    rpc_world, mpi_tmp_path
):
    servers = servers_for(rpc_world, 1)
    data = make_data(2, rpc_world.size - 1)
    path = str(mpi_tmp_path / "run_ahead.ckpt")
    L.seed_everything(0, verbose=False)
    run_ahead = make_trainer(
        DistAutogradStrategy(server_ranks=servers, sync_remote_updates=False), max_epochs=1
    )
    trained = TableModel(optimizer="adam")
    run_ahead.fit(trained, loader(data))
    run_ahead.save_checkpoint(path)

    resumed = make_trainer(DistAutogradStrategy(server_ranks=servers), max_epochs=2)
    with pytest.raises(ValueError, match=r"one remote optimizer state per trainer.*HINT"):
        resumed.fit(TableModel(optimizer="adam"), loader(data), ckpt_path=path)
    if run_ahead.strategy.is_server:
        return
    # The checkpoint names remote parameters as a local model would: a plain local model.
    local = TableModel.load_from_checkpoint(path, remote=False)
    assert isinstance(local.table, Table)
    for key, value in run_ahead.strategy.lightning_module_state_dict().items():
        assert torch.equal(local.state_dict()[key], value), key


@pytest.mark.mpi(min_size=2)
def test_validate_with_ckpt_path_restores_the_remote_parameters(rpc_world, mpi_tmp_path):
    servers = servers_for(rpc_world, 1)
    data = make_data(2, rpc_world.size - 1)
    path = str(mpi_tmp_path / "validate.ckpt")
    L.seed_everything(0, verbose=False)
    first = make_trainer(DistAutogradStrategy(server_ranks=servers), max_epochs=1)
    model = TableModel(optimizer="adam")
    first.fit(model, loader(data))
    first.save_checkpoint(path)
    saved = None if first.strategy.is_server else first.strategy.lightning_module_state_dict()
    second = make_trainer(
        DistAutogradStrategy(server_ranks=servers), max_epochs=1, limit_val_batches=1.0
    )
    second.fit(model, loader(data))  # the same remote table moves on
    moved = None if second.strategy.is_server else second.strategy.lightning_module_state_dict()
    second.validate(model, loader(data), ckpt_path=path)
    if second.strategy.is_server:
        return
    assert not torch.equal(moved["table.weight"], saved["table.weight"])
    restored = second.strategy.lightning_module_state_dict()
    for key, value in saved.items():
        assert torch.equal(restored[key], value), key
