"""``DistAutogradStrategy``: Lightning training with trainers and a parameter server over MPI.

Run under ``mpiexec -n N python -m mpi4py -m pytest --with-mpi`` with N = 2, 3, 4. Unless a test
says otherwise the last rank serves and the other N - 1 ranks train, so the runs cover one
trainer (N = 2) and several trainers sharing one remote module (N = 3, 4). Training runs are
compared with a single-process reference: the same LightningModule class with its remote part
built locally, the same seed, and at every step the union of the trainers' batches.

Every rank runs every test; assertions about training results run on trainers only (a serving
rank's ``fit`` returns None). Bad-input tests expect the same error on every rank.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from _dist_utils import make_trainer, sampled_batch
from _timing import scaled
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, TensorDataset

import lightning_distgrad
import lightning_distgrad.autograd as dist_autograd
from lightning_distgrad import DistAutogradStrategy, MPIClusterEnvironment
from lightning_distgrad.lightning.strategy import REMOTE_OPTIMIZER_STATE
from lightning_distgrad.nn import RemoteModule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import lightning_embedding_ps as emb_example  # noqa: E402
import lightning_pipeline as pipe_example  # noqa: E402

TOL = 1e-5
BATCH = 8  # per trainer


# --- Helpers -----------------------------------------------------------------------------------


def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def loader(dataset: Dataset, batch_size: int = BATCH) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False)


def num_trainers() -> int:
    return world()[1] - 1


def pipeline_data(steps_per_epoch: int, seed: int = 1) -> TensorDataset:
    return pipe_example.make_dataset(steps_per_epoch * BATCH * num_trainers(), seed=seed)


def embedding_data(steps_per_epoch: int, seed: int = 1) -> TensorDataset:
    return emb_example.make_dataset(steps_per_epoch * BATCH * num_trainers(), seed=seed)


def pipeline_model(**kwargs) -> pipe_example.PipelineModel:
    L.seed_everything(0, verbose=False)
    return pipe_example.PipelineModel(**kwargs)


def embedding_model(**kwargs) -> emb_example.EmbeddingPSModel:
    L.seed_everything(0, verbose=False)
    return emb_example.EmbeddingPSModel(**kwargs)


def local_pipeline(**kwargs) -> pipe_example.PipelineModel:
    """The reference: the same model with its second half built here."""
    model = pipeline_model(**kwargs)
    model.second = pipe_example.SecondHalf(seed=model.hparams.seed)
    return model


def local_embedding(**kwargs) -> emb_example.EmbeddingPSModel:
    model = embedding_model(**kwargs)
    model.emb = emb_example.SeededEmbeddingBag(
        emb_example.VOCAB, emb_example.DIM, model.hparams.seed
    )
    return model


def global_batch(dataset: TensorDataset, index: int, trainers: int, epoch: int = 0):
    return sampled_batch(dataset, index, trainers, BATCH, epoch)


def reference_state(
    model: L.LightningModule,
    dataset: TensorDataset,
    steps: int,
    *,
    accumulate: int = 1,
    clip_norm: float | None = None,
    clip_value: float | None = None,
) -> dict[str, torch.Tensor]:
    """Train ``model`` (all local) in one process as DDP trains it: each step, one optimizer
    step on the mean gradient of all trainers' batches, clipped as DDP clips it."""
    trainers = num_trainers()
    batches_per_epoch = len(dataset) // (BATCH * trainers)
    config = model.configure_optimizers()
    optimizer = config["optimizer"] if isinstance(config, dict) else config
    schedule = config.get("lr_scheduler") if isinstance(config, dict) else None
    index = 0
    for _ in range(steps):
        optimizer.zero_grad()
        for _ in range(accumulate):
            x, y = global_batch(
                dataset, index % batches_per_epoch, trainers, index // batches_per_epoch
            )
            (nn.functional.mse_loss(model(x), y) / accumulate).backward()
            index += 1
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        optimizer.step()
        if schedule is not None and index % batches_per_epoch == 0:
            schedule.step()
    return model.state_dict()


def assert_states_close(actual: dict, expected: dict, tol: float = TOL) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        diff = (actual[key].float() - value.float()).abs().max().item()
        assert diff <= tol, f"{key}: max abs difference {diff:.3g} > {tol}"


def fit_seeded(model_class: type, data: TensorDataset) -> L.Trainer | None:
    """Seed, build ``model_class()`` and fit it for one epoch; the trainer, or None on a
    serving rank."""
    L.seed_everything(0, verbose=False)
    trainer = make_trainer(max_epochs=1)
    trainer.fit(model_class(), loader(data))
    return None if trainer.strategy.is_server else trainer


def distributed_state(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """The trained model's full state: local parameters and the remote ones, fetched."""
    return {k: v.detach().cpu() for k, v in trainer.strategy.lightning_module_state_dict().items()}


# --- Training matches a single process ---------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_embedding_ps_fit_matches_single_process(rpc_world):
    data = embedding_data(steps_per_epoch=3)
    trainer = make_trainer(max_epochs=1)
    assert trainer.fit(embedding_model(), loader(data)) is None
    if trainer.strategy.is_server:
        return
    expected = reference_state(local_embedding(), data, steps=3)
    assert_states_close(distributed_state(trainer), expected)


@pytest.mark.mpi(min_size=2)
def test_pipeline_fit_matches_single_process_with_lr_schedule(rpc_world):
    # Two epochs: the ExponentialLR step after epoch 0 must reach the remote optimizer too.
    data = pipeline_data(steps_per_epoch=2)
    # The model summary walks the module tree: it must not reach the RemoteModule.
    trainer = make_trainer(max_epochs=2, enable_model_summary=True)
    model = pipeline_model(gamma=0.5)
    trainer.fit(model, loader(data))
    if trainer.strategy.is_server:
        return
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.2 * 0.25)
    expected = reference_state(local_pipeline(gamma=0.5), data, steps=4)
    assert_states_close(distributed_state(trainer), expected)


@pytest.mark.mpi(min_size=2)
def test_gradient_accumulation_spans_one_context(rpc_world):
    data = pipeline_data(steps_per_epoch=4)
    seen, graded = [], []

    class Recorder(L.Callback):
        def on_after_backward(self, trainer, pl_module):
            grads = dist_autograd.get_gradients(trainer.strategy.context_id)
            graded.append(sum(p in grads for p in pl_module.parameters()))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(trainer.strategy.context_id)

    trainer = make_trainer(max_epochs=1, accumulate_grad_batches=2, callbacks=[Recorder()])
    model = pipeline_model()
    trainer.fit(model, loader(data))
    if trainer.strategy.is_server:
        return
    # The context stays open over the window and closes at the step.
    assert seen[0] is not None and seen[1] is None and seen[2] is not None and seen[3] is None
    # Every batch's backward runs at once (its graph is not kept for the window's last one).
    local = len(list(model.parameters()))
    assert graded == [local] * 4, graded
    expected = reference_state(local_pipeline(), data, steps=2, accumulate=2)
    assert_states_close(distributed_state(trainer), expected)


@pytest.mark.mpi(min_size=2)
def test_gradient_clipping_by_norm_covers_local_and_remote_gradients(rpc_world):
    data = pipeline_data(steps_per_epoch=3)
    trainer = make_trainer(max_epochs=1, gradient_clip_val=0.05)
    trainer.fit(pipeline_model(lr=0.5), loader(data))
    if trainer.strategy.is_server:
        return
    expected = reference_state(local_pipeline(lr=0.5), data, steps=3, clip_norm=0.05)
    assert_states_close(distributed_state(trainer), expected)


@pytest.mark.mpi(min_size=2)
def test_gradient_clipping_by_value_clamps_the_mean_gradient(rpc_world):
    data = pipeline_data(steps_per_epoch=2)
    trainer = make_trainer(max_epochs=1, gradient_clip_val=0.01, gradient_clip_algorithm="value")
    trainer.fit(pipeline_model(lr=0.5), loader(data))
    if trainer.strategy.is_server:
        return
    expected = reference_state(local_pipeline(lr=0.5), data, steps=2, clip_value=0.01)
    assert_states_close(distributed_state(trainer), expected)


class ManualPipeline(pipe_example.PipelineModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        optimizer.zero_grad()
        self.manual_backward(loss)
        assert all(p.grad is not None for p in self.first.parameters())
        optimizer.step()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


@pytest.mark.mpi(min_size=2)
def test_manual_optimization_runs_each_training_step_in_a_context(rpc_world):
    data = pipeline_data(steps_per_epoch=3)
    trainer = fit_seeded(ManualPipeline, data)
    if trainer is None:
        return
    assert trainer.strategy.context_id is None
    L.seed_everything(0, verbose=False)
    reference = ManualPipeline()
    reference.second = pipe_example.SecondHalf(seed=0)
    expected = reference_state(reference, data, steps=3)
    assert_states_close(distributed_state(trainer), expected)


@pytest.mark.mpi(min_size=2)
def test_validate_test_and_predict_after_fit_reuse_the_agent(rpc_world):
    data = pipeline_data(steps_per_epoch=2)
    val = pipe_example.make_dataset(BATCH * num_trainers() * 2, seed=5)
    trainer = make_trainer(max_epochs=1, limit_val_batches=None)
    model = pipeline_model()
    trainer.fit(model, loader(data), loader(val))
    assert trainer.strategy.is_server or model.second.training
    results = trainer.validate(model, loader(val))
    assert trainer.strategy.is_server or not model.second.training  # remote module in eval
    predictions = trainer.predict(model, loader(val))
    if trainer.strategy.is_server:
        assert results is None and predictions is None
        return
    reference = local_pipeline()
    reference_state(reference, data, steps=2)
    with torch.no_grad():
        expected = nn.functional.mse_loss(reference(val.tensors[0]), val.tensors[1]).item()
    assert results[0]["val_loss"] == pytest.approx(expected, abs=TOL)
    assert len(predictions) == 2 and predictions[0].shape == (BATCH, pipe_example.OUT)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("example", [emb_example, pipe_example], ids=["embedding", "pipeline"])
def test_example_trains_and_its_loss_goes_down(rpc_world, example, capsys):
    losses = example.main(["--fast", "--max-steps", "40", "--lr", "0.5"])
    if world()[0] != 0:
        assert losses is None
        return
    first, last = losses
    assert math.isfinite(last) and last < first
    assert "loss: first" in capsys.readouterr().out


# --- Checkpoints -------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_resume_from_checkpoint_continues_the_same_run(rpc_world, mpi_tmp_path):
    data = embedding_data(steps_per_epoch=2)
    path = str(mpi_tmp_path / "epoch1.ckpt")

    straight = make_trainer(max_epochs=2)
    straight.fit(embedding_model(), loader(data))

    first = make_trainer(max_epochs=1)
    first.fit(embedding_model(), loader(data))
    first.save_checkpoint(path)
    resumed = make_trainer(max_epochs=2)
    resumed.fit(embedding_model(), loader(data), ckpt_path=path)

    if straight.strategy.is_server:
        return
    checkpoint = torch.load(path, weights_only=False)
    assert "emb.weight" in checkpoint["state_dict"]
    remote_state = checkpoint["optimizer_states"][0][REMOTE_OPTIMIZER_STATE]
    assert list(remote_state) == [f"worker{num_trainers()}"]  # one optimizer, on the server
    assert all(state["state"] for state in remote_state.values())
    assert resumed.global_step == straight.global_step == 4
    assert_states_close(distributed_state(resumed), distributed_state(straight))


# --- What Lightning users expect ---------------------------------------------------------------


class IndexDataset(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.tensor([float(i)]), torch.tensor([0.0])


class Probe(L.LightningModule):
    """A local-only model that records what it sees and logs rank-dependent values."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.extend(int(v) for v in x.flatten())
        rank = float(self.global_rank)
        self.log("rank_mean", rank, sync_dist=True)
        self.log("rank_sum", rank, sync_dist=True, reduce_fx="sum")
        self.log("rank_max", rank, sync_dist=True, reduce_fx="max")
        gathered = self.all_gather(torch.tensor([rank]))
        assert gathered.flatten().tolist() == [float(r) for r in range(self.trainer.world_size)]
        weights = self.all_gather(self.layer.weight.sum(), sync_grads=True)  # collective backward
        assert weights.shape == (self.trainer.world_size,) and weights.requires_grad
        return nn.functional.mse_loss(self.layer(x), y) + 1e-3 * weights.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.mpi(min_size=2)
def test_sampler_splits_the_data_and_sync_dist_reduces_over_trainers(rpc_world):
    trainers = num_trainers()
    model = Probe()
    trainer = make_trainer(max_epochs=1)
    trainer.fit(model, loader(IndexDataset(4 * BATCH * trainers)))
    if trainer.strategy.is_server:
        assert trainer.strategy.global_rank >= trainers and not trainer.is_global_zero
        return
    strategy = trainer.strategy
    assert trainer.world_size == trainers
    assert strategy.distributed_sampler_kwargs == {
        "num_replicas": trainers,
        "rank": trainer.global_rank,
    }
    everyone = strategy._collectives.allgather_object(model.seen)
    assert sorted(i for seen in everyone for i in seen) == list(range(4 * BATCH * trainers))
    metrics = trainer.callback_metrics
    assert metrics["rank_mean"].item() == pytest.approx((trainers - 1) / 2)
    assert metrics["rank_sum"].item() == pytest.approx(trainers * (trainers - 1) / 2)
    assert metrics["rank_max"].item() == trainers - 1
    assert strategy.broadcast(trainer.global_rank + 10) == 10
    assert strategy.reduce_boolean_decision(trainer.global_rank == 0, all=False)
    assert strategy.reduce_boolean_decision(trainer.global_rank == 0, all=True) == (trainers == 1)


@pytest.mark.mpi(min_size=2)
def test_strategy_string_trains_every_rank_as_data_parallel(rpc_world):
    assert "distgrad" in L.pytorch.strategies.StrategyRegistry
    rank, size = world()
    torch.manual_seed(rank)  # different initial weights: the strategy broadcasts trainer 0's
    model = Probe()
    trainer = make_trainer(strategy="distgrad", max_epochs=1)
    assert isinstance(trainer.strategy, DistAutogradStrategy)
    assert trainer.world_size == size and trainer.global_rank == rank
    trainer.fit(model, loader(IndexDataset(2 * BATCH * size)))
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = trainer.strategy._collectives.allgather_object(weights)
    assert all(torch.equal(w, everyone[0]) for w in everyone)


@pytest.mark.mpi(min_size=2)
def test_bf16_mixed_trains_with_autocast_on_the_server(rpc_world):
    data = pipeline_data(steps_per_epoch=3)
    trainer = make_trainer(max_epochs=1, precision="bf16-mixed")
    trainer.fit(pipeline_model(), loader(data))
    if trainer.strategy.is_server:
        return
    expected = reference_state(local_pipeline(), data, steps=3)
    actual = distributed_state(trainer)
    initial = local_pipeline().state_dict()
    assert_states_close(actual, expected, tol=0.02)
    assert any((actual[k] - initial[k]).abs().max() > 1e-4 for k in initial if "second" in k)


@pytest.mark.mpi(min_size=2)
def test_strategy_starts_rpc_itself_when_none_runs(rpc_stopped):
    from lightning_distgrad.rpc._calls import dispatch

    assert dispatch.current_agent() is None
    trainer = make_trainer(max_epochs=1)
    model = pipeline_model()
    trainer.fit(model, loader(pipeline_data(steps_per_epoch=1)))
    agent = dispatch.current_agent()
    assert agent is not None and agent.info.name == f"worker{world()[0]}"
    trainer.validate(model, loader(pipeline_data(steps_per_epoch=1)))
    assert dispatch.current_agent() is agent


# --- Bad input ---------------------------------------------------------------------------------


def single_rank_environment() -> MPIClusterEnvironment:
    from mpi4py import MPI

    return MPIClusterEnvironment(MPI.COMM_SELF)


@pytest.mark.mpi
def test_servers_in_a_world_of_one_say_how_to_launch():
    with pytest.raises(RuntimeError, match=r"MPI world of one.*HINT: launch with `mpiexec -n 2"):
        DistAutogradStrategy(num_servers=1, cluster_environment=single_rank_environment())


@pytest.mark.mpi
def test_roles_that_do_not_fit_the_world_are_rejected():
    size = world()[1]
    with pytest.raises(ValueError, match=rf"num_servers={size}\) leaves no rank to train"):
        DistAutogradStrategy(num_servers=size)
    with pytest.raises(ValueError, match=rf"rank\(s\) \[{size}\] do not exist"):
        DistAutogradStrategy(server_ranks=[size])
    with pytest.raises(ValueError, match="lists a rank twice"):
        DistAutogradStrategy(server_ranks=[0, 0])
    with pytest.raises(ValueError, match="not both"):
        DistAutogradStrategy(num_servers=1, server_ranks=[0])
    with pytest.raises(TypeError, match="needs an MPIClusterEnvironment"):
        DistAutogradStrategy(cluster_environment=LightningEnvironment())


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("precision", ["16-true", "64-true", "bf16-true"])
def test_unsupported_precision_is_rejected(rpc_world, precision):
    with pytest.raises(ValueError, match=rf"precision={precision!r}.*HINT"):
        make_trainer(precision=precision)


@pytest.mark.mpi(min_size=2)
def test_fp16_mixed_precision_with_a_gradient_scaler_is_rejected(rpc_world):
    # On CPU Lightning turns precision="16-mixed" into "bf16-mixed"; a plugin forces fp16.
    with pytest.raises(ValueError, match=r"precision='16-mixed'.*HINT"):
        make_trainer(plugins=[MixedPrecision("16-mixed", "cpu")])


@pytest.mark.mpi(min_size=2)
def test_devices_that_do_not_match_the_launch_are_rejected(rpc_world):
    # Per node: the job may span several nodes (tests/test_two_nodes.py).
    env = MPIClusterEnvironment()
    on_node, nodes = env.local_world_size, env.num_nodes
    too_many = rf"`devices={on_node + 3}`, but mpiexec started {on_node}"
    with pytest.raises(ValueError, match=too_many):
        make_trainer(strategy="distgrad", devices=on_node + 3)
    too_few = rf"`num_nodes={nodes + 2}`, but mpiexec started ranks on {nodes} node"
    with pytest.raises(ValueError, match=too_few):
        make_trainer(num_nodes=nodes + 2)
    make_trainer(strategy="distgrad", devices=on_node)  # the launch itself is fine


class TrainerHostedModel(pipe_example.PipelineModel):
    """Puts its remote half on trainer 0 instead of a serving rank."""

    def make_remote(self):
        self.second = RemoteModule("worker0/cpu", pipe_example.SecondHalf)


@pytest.mark.mpi(min_size=2)
def test_remote_module_on_a_trainer_is_rejected_on_every_rank(rpc_world):
    trainer = make_trainer(max_epochs=1)
    with pytest.raises(ValueError, match=r"lives on worker0 \(rank 0\), which is a trainer"):
        trainer.fit(TrainerHostedModel(), loader(pipeline_data(steps_per_epoch=1)))


class PerTrainerRemoteModel(pipe_example.PipelineModel):
    """Every trainer creates its own copy of the remote half (not shared)."""

    def make_remote(self):
        self.second = RemoteModule(self.trainer.strategy.server_device(0), pipe_example.SecondHalf)


@pytest.mark.mpi(min_size=3)
def test_unshared_remote_modules_are_rejected_with_several_trainers(rpc_world):
    trainer = make_trainer(max_epochs=1)
    with pytest.raises(ValueError, match=r"trainers hold different RemoteModules.*remote_module"):
        trainer.fit(PerTrainerRemoteModel(), loader(pipeline_data(steps_per_epoch=1)))


def test_package_import_registers_distgrad_without_importing_lightning():
    assert lightning_distgrad.DistAutogradStrategy is DistAutogradStrategy
    script = (
        "import sys, lightning_distgrad\n"
        "assert 'lightning.pytorch' not in sys.modules, 'lightning imported eagerly'\n"
        "import lightning as L\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "assert 'distgrad' in StrategyRegistry\n"
        "assert lightning_distgrad.DistAutogradStrategy.__module__.endswith('strategy')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=scaled(300),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]


# --- Routed remote experts (SMART distributed backward) ----------------------------------------


class RoutedExperts(L.LightningModule):
    """A local gate and two remote experts; every step runs both and uses the one its batch
    routes to, so the other expert's RPC result reaches no loss (the SMART pass skips it)."""

    def __init__(self, lr: float = 0.3):
        super().__init__()
        self.save_hyperparameters()
        self.gate = nn.Sequential(nn.Linear(pipe_example.IN, pipe_example.HIDDEN), nn.Tanh())
        self.expert0: nn.Module | None = None
        self.expert1: nn.Module | None = None
        self.route = 0

    def configure_model(self) -> None:
        if self.expert0 is None:
            strategy = self.trainer.strategy
            self.expert0, self.expert1 = (
                strategy.remote_module(
                    strategy.server_device(0), pipe_example.SecondHalf, kwargs={"seed": seed}
                )
                for seed in (0, 1)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate(x)
        outputs = [self.expert0(h), self.expert1(h)]
        return outputs[self.route]

    def training_step(self, batch, batch_idx):
        self.route = batch_idx % 3 % 2  # expert 0, 1, 0, then 0, 1, 0, ...
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


@pytest.mark.mpi(min_size=2)
def test_routed_remote_experts_train_as_one_process_with_unused_experts_untouched(rpc_world):
    data = pipeline_data(steps_per_epoch=3)
    trainer = fit_seeded(RoutedExperts, data)
    if trainer is None:
        return
    L.seed_everything(0, verbose=False)
    reference = RoutedExperts()
    reference.expert0, reference.expert1 = (pipe_example.SecondHalf(seed=s) for s in (0, 1))
    optimizer = reference.configure_optimizers()
    for index in range(3):
        reference.route = index % 3 % 2
        x, y = global_batch(data, index, num_trainers())
        optimizer.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        # torch.optim skips a parameter whose .grad is None: the unused expert stays as it is.
        assert all(
            p.grad is None
            for p in (reference.expert1 if reference.route == 0 else reference.expert0).parameters()
        )
        optimizer.step()
    assert_states_close(distributed_state(trainer), reference.state_dict())


class DDPDenseModel(emb_example.EmbeddingPSModel):
    """The embedding model with its dense part wrapped in torch's DDP by the user, over a gloo
    process group of the trainers. The strategy averages local parameters itself; DDP's
    average in the backward pass is averaged again, which changes nothing."""

    def configure_model(self) -> None:
        super().configure_model()
        if not isinstance(self.dense, DDP):
            self.dense = DDP(self.dense)


@pytest.mark.mpi(min_size=2)
def test_a_dense_part_the_user_wrapped_in_ddp_trains_as_without_it(rpc_world):
    import torch.distributed as dist

    rank, size = world()
    trainers = size - 1
    store = None
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, trainers, is_master=True, wait_for_workers=False)
    port = rpc_world.comm.bcast(store.port if store else None, root=0)
    if 0 < rank < trainers:
        store = dist.TCPStore("127.0.0.1", port, trainers, is_master=False)
    if rank < trainers:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=trainers)
    try:
        data = embedding_data(steps_per_epoch=3)
        trainer = fit_seeded(DDPDenseModel, data)
        if trainer is not None:
            state = {
                k.replace("dense.module.", "dense."): v
                for k, v in distributed_state(trainer).items()
            }
            assert_states_close(state, reference_state(local_embedding(), data, steps=3))
            assert all(p.grad is not None for p in trainer.lightning_module.dense.parameters())
    finally:
        rpc_world.barrier()
        if rank < trainers:
            dist.destroy_process_group()


@pytest.mark.parametrize("trainers", [1, 2, 3, 7, 16, 1000])
def test_a_shared_module_reaches_every_trainer_in_log_n_hops_and_sends(trainers):
    from lightning_distgrad.lightning._remote import hand_out_plan

    reached, sends, depth = [], {0: 0}, {0: 0}

    def follow(holder: int, ranks: list[int]) -> None:
        plan = hand_out_plan(ranks)
        sends[holder] = len(plan)
        for rank, below in plan:
            reached.append(rank)
            depth[rank] = depth[holder] + 1
            follow(rank, below)

    follow(0, list(range(1, trainers)))
    assert sorted(reached) == list(range(1, trainers))  # each once
    bound = math.ceil(math.log2(trainers)) if trainers > 1 else 0
    assert max(sends.values()) <= bound and max(depth.values()) <= bound
