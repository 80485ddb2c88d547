r"""A model split across two ranks (pipeline-style model parallelism), trained with Lightning.

Run with (rank 0 trains the first half, rank 1 holds the second half)::

    mpiexec -n 2 python -m mpi4py examples/lightning_pipeline.py

The first half of an MLP runs locally on the trainer; the second half is a
:class:`~lightning_distgrad.nn.RemoteModule` on the serving rank. Each training step sends the
activations to rank 1, gets the prediction back, and runs the distributed backward pass, which
crosses back to rank 1 for the second half's gradients; the update steps both halves with the
optimizer that ``configure_optimizers`` returns (here SGD with an LR schedule, whose learning
rate reaches the remote half too). With more ranks (``mpiexec -n 3``) the extra ranks train as
data-parallel replicas of the first half, all sharing the one remote second half.

The data: a random "teacher" MLP labels Gaussian inputs, so the loss can go to (almost) zero.
Flags: ``--max-steps N`` stops after N optimizer steps, ``--fast`` uses a small dataset.
"""

from __future__ import annotations

import time

import lightning as L
import torch
from _lightning_utils import lightning_parser, loaders, make_trainer, report
from torch import nn
from torch.utils.data import TensorDataset

import lightning_distgrad  # noqa: F401  (registers strategy="distgrad")
from lightning_distgrad import DistAutogradStrategy

IN, HIDDEN, OUT = 8, 32, 1


class SecondHalf(nn.Module):
    """The remote half; its initial weights depend only on ``seed``.

    It draws them from its own ``torch.Generator``: the constructor runs on one of the serving
    rank's RPC threads, and the global generator is shared with that rank's other threads.
    """

    def __init__(self, hidden: int = HIDDEN, out: int = OUT, seed: int = 0):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, out))
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for layer in (self.net[0], self.net[2]):
                bound = layer.in_features**-0.5
                for param in (layer.weight, layer.bias):
                    param.copy_(
                        torch.empty_like(param).uniform_(-bound, bound, generator=generator)
                    )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_dataset(num_samples: int, seed: int = 0) -> TensorDataset:
    """Gaussian inputs and the outputs of a random teacher network."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, IN, generator=generator)
    w1 = torch.randn(IN, 16, generator=generator) / IN**0.5
    w2 = torch.randn(16, OUT, generator=generator) / 4
    return TensorDataset(x, torch.tanh(x @ w1) @ w2)


class PipelineModel(L.LightningModule):
    """``self.first`` runs here, ``self.second`` (a RemoteModule) on the first serving rank."""

    def __init__(self, lr: float = 0.2, seed: int = 0, gamma: float = 0.9):
        super().__init__()
        self.save_hyperparameters()
        self.first = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh())
        self.second: nn.Module | None = None

    def make_remote(self) -> None:
        strategy = self.trainer.strategy
        self.second = strategy.remote_module(
            strategy.server_device(0), SecondHalf, kwargs={"seed": self.hparams.seed}
        )

    def configure_model(self) -> None:
        if self.second is None:  # configure_model runs again for every fit/validate/test
            self.make_remote()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The server computes on CPU: activations cross the wire as CPU tensors (a no-op on
        # CPU; on GPU trainers, autograd moves the gradients back to the GPU).
        h = self.first(x)
        return self.second(h.cpu()).to(h.device)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), prog_bar=True, sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        schedule = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=self.hparams.gamma)
        return {"optimizer": optimizer, "lr_scheduler": schedule}


def main(argv: list[str] | None = None) -> tuple[float, float] | None:
    """Train; returns ``(first loss, last loss)`` on trainer 0, ``None`` elsewhere."""
    args = lightning_parser(__doc__, lr=0.2).parse_args(argv)

    L.seed_everything(0, verbose=False)
    samples = 512 if args.fast else 4096
    train, val = loaders(make_dataset, samples, args.batch_size)
    trainer, printer = make_trainer(DistAutogradStrategy(num_servers=1), args)
    # On the serving rank fit() answers the trainer's RPCs until it finishes, then returns.
    start = time.perf_counter()
    trainer.fit(PipelineModel(lr=args.lr), train, val)
    return report(
        trainer,
        printer,
        time.perf_counter() - start,
        f"the second half (MLP {HIDDEN}-{HIDDEN}-{OUT})",
        f"the first half (MLP {IN}-{HIDDEN})",
    )


if __name__ == "__main__":
    main()
