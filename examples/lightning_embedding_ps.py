r"""An embedding table on a parameter server, a dense part trained on two trainers, with Lightning.

Run with (ranks 0 and 1 train, rank 2 holds the table)::

    mpiexec -n 3 python -m mpi4py examples/lightning_embedding_ps.py

The model is the hybrid of PyTorch's "DDP + RPC" tutorial: an ``EmbeddingBag`` lives on the
serving rank as a :class:`~lightning_distgrad.nn.RemoteModule` shared by both trainers, and a
small dense network is replicated on the trainers (its gradients are averaged, as with DDP).
Each step runs in one distributed autograd context: the trainers' forward passes call the table
over RPC, the distributed backward pass sends its gradients back to the server, and the update
steps the dense part locally and the table on the server.

The data: each sample is a bag of token ids; its target is a fixed linear function of the mean
of a hidden "true" embedding of those ids, so the loss can go to (almost) zero. Flags:
``--max-steps N`` stops after N optimizer steps, ``--fast`` uses a small dataset. Rank 0 shows
the progress bar and ends with a line saying what was trained on which ranks, for how long,
and the loss.
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

VOCAB, DIM, BAG, HIDDEN = 200, 16, 4, 32


class SeededEmbeddingBag(nn.EmbeddingBag):
    """An ``EmbeddingBag(mode="mean")`` whose initial weights depend only on ``seed``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, seed: int = 0):
        super().__init__(num_embeddings, embedding_dim, mode="mean")
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(num_embeddings, embedding_dim, generator=generator))


def make_dataset(num_samples: int, seed: int = 0) -> TensorDataset:
    """Bags of ``BAG`` token ids and regression targets from a hidden embedding."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (num_samples, BAG), generator=generator)
    true_table = torch.randn(VOCAB, DIM, generator=generator)
    true_head = torch.randn(DIM, 1, generator=generator) / DIM**0.5
    targets = true_table[ids].mean(dim=1) @ true_head
    return TensorDataset(ids, targets)


class EmbeddingPSModel(L.LightningModule):
    """Remote ``self.emb`` (on the first serving rank) and a local, replicated ``self.dense``."""

    def __init__(self, lr: float = 0.5, seed: int = 0, optimizer: str = "sgd"):
        super().__init__()
        self.save_hyperparameters()
        self.emb: nn.Module | None = None  # created in configure_model, once RPC runs
        self.dense = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))

    def make_remote(self) -> None:
        strategy = self.trainer.strategy
        self.emb = strategy.remote_module(
            strategy.server_device(0), SeededEmbeddingBag, args=(VOCAB, DIM, self.hparams.seed)
        )

    def configure_model(self) -> None:
        if self.emb is None:  # configure_model runs again for every fit/validate/test
            self.make_remote()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # The table lives on the server's CPU: ids go there, embeddings come back here.
        return self.dense(self.emb(ids.cpu()).to(ids.device))

    def training_step(self, batch, batch_idx):
        ids, targets = batch
        loss = nn.functional.mse_loss(self(ids), targets)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        ids, targets = batch
        self.log("val_loss", nn.functional.mse_loss(self(ids), targets), sync_dist=True)

    def configure_optimizers(self):
        if self.hparams.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.5)


def main(argv: list[str] | None = None) -> tuple[float, float] | None:
    """Train; returns ``(first loss, last loss)`` on trainer 0, ``None`` elsewhere."""
    args = lightning_parser(__doc__, lr=0.5).parse_args(argv)

    L.seed_everything(0, verbose=False)
    samples = 512 if args.fast else 8192
    train, val = loaders(make_dataset, samples, args.batch_size)
    trainer, printer = make_trainer(DistAutogradStrategy(num_servers=1), args)
    # On the serving rank fit() answers the trainers' RPCs until they finish, then returns.
    start = time.perf_counter()
    trainer.fit(EmbeddingPSModel(lr=args.lr), train, val)
    return report(
        trainer,
        printer,
        time.perf_counter() - start,
        f"an EmbeddingBag({VOCAB}, {DIM})",
        f"an MLP {DIM}-{HIDDEN}-1",
    )


if __name__ == "__main__":
    main()
