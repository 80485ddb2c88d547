"""Plumbing shared by the Lightning examples: flags, data loaders, ``Trainer``, a loss printer.

Not an example itself: ``lightning_pipeline.py`` and ``lightning_embedding_ps.py`` import it
with ``from _lightning_utils import ...`` (running ``examples/<name>.py`` puts ``examples/`` on
``sys.path``). The models, data and strategy stay in the examples.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence

import lightning as L
from lightning.pytorch.strategies import Strategy
from torch.utils.data import DataLoader, Dataset


def lightning_parser(doc: str, lr: float) -> argparse.ArgumentParser:
    """The Lightning examples' flags: ``--max-steps``, ``--fast``, ``--epochs``, ...

    Args:
        doc: the example's docstring; its first line describes the program in ``--help``.
        lr: the default of ``--lr``.
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after N steps")
    parser.add_argument("--fast", action="store_true", help="a small dataset")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per trainer")
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument("--accelerator", default="cpu", help="cpu, gpu or auto (trainers)")
    return parser


class PrintLoss(L.Callback):
    """Print the (trainer-averaged) training loss every ``every`` steps, on trainer 0, through
    the progress bar (so the line lands above it, not inside it).

    ``first`` and ``last`` are the mean losses of the first and the last ``window`` batches.
    """

    def __init__(self, every: int = 20, window: int = 5):
        self.every, self.window = every, window
        self.losses: list[float] = []

    @property
    def first(self) -> float:
        return sum(self.losses[: self.window]) / len(self.losses[: self.window])

    @property
    def last(self) -> float:
        return sum(self.losses[-self.window :]) / len(self.losses[-self.window :])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = trainer.callback_metrics.get("train_loss")
        if loss is None:
            return
        self.losses.append(float(loss))
        if trainer.is_global_zero and trainer.global_step % self.every == 0:
            line = f"step {trainer.global_step:4d}  loss {self.losses[-1]:.4f}"
            bar = trainer.progress_bar_callback
            if bar is None:
                print(line, flush=True)
            else:
                bar.print(line)


def loaders(
    make_dataset: Callable[..., Dataset], samples: int, batch_size: int
) -> tuple[DataLoader, DataLoader]:
    """Shuffled training batches of ``make_dataset(samples, seed=1)`` and validation batches
    of ``make_dataset(256, seed=2)``."""
    train = DataLoader(make_dataset(samples, seed=1), batch_size=batch_size, shuffle=True)
    val = DataLoader(make_dataset(256, seed=2), batch_size=batch_size)
    return train, val


class _QuietLightning(logging.Filter):
    """Drops Lightning's tip about installing a cloud logger (the examples log nothing) and its
    "`Trainer.fit` stopped" line (it lands inside the progress bar; :func:`report` says when
    and why training ended)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "litlogger" not in message and "`Trainer.fit` stopped" not in message


def make_trainer(strategy: Strategy, args: argparse.Namespace) -> tuple[L.Trainer, PrintLoss]:
    """An ``L.Trainer`` with ``strategy`` and the settings of :func:`lightning_parser`'s flags,
    and its only callback, a :class:`PrintLoss` (no logger, checkpoints or model summary)."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_QuietLightning())
    printer = PrintLoss(every=20 if args.fast else 100)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator=args.accelerator,
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        precision=args.precision,
        callbacks=[printer],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    return trainer, printer


def rank_list(ranks: Sequence[int]) -> str:
    """MPI ranks as a person writes them.

    >>> rank_list([2]), rank_list([0, 1, 2]), rank_list([0, 2])
    ('rank 2', 'ranks 0-2', 'ranks 0, 2')
    """
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def report(
    trainer: L.Trainer, printer: PrintLoss, seconds: float, remote: str, local: str
) -> tuple[float, float] | None:
    """On trainer 0, print what was trained on which ranks, for how long, and the loss, as
    ``trained <remote> held by rank 2 (server) and <local> replicated on ranks 0-1 (trainers)
    for 5 epochs (640 steps) in 12.0 s; loss: first 0.4942 -> last 0.0102``, and return
    ``(first loss, last loss)``; ``None`` on the other ranks.

    Args:
        trainer: a ``Trainer`` whose ``fit`` has returned, with a ``DistAutogradStrategy``.
        printer: its :class:`PrintLoss`.
        seconds: how long ``fit`` took.
        remote, local: what the first serving rank holds, and what every trainer holds.
    """
    if not trainer.is_global_zero:
        return None
    strategy = trainer.strategy
    servers = strategy.server_ranks
    trainers = [r for r in range(strategy.num_trainers + len(servers)) if r not in servers]
    where = "replicated on " if len(trainers) > 1 else "on "
    where += f"{rank_list(trainers)} (trainer{'s' * (len(trainers) > 1)})"
    epochs, steps = trainer.current_epoch, trainer.global_step
    print(
        f"trained {remote} held by {rank_list(servers[:1])} (server) and {local} {where} for"
        f" {epochs} epoch{'s' * (epochs != 1)} ({steps} step{'s' * (steps != 1)}) in"
        f" {seconds:.1f} s; loss: first {printer.first:.4f} -> last {printer.last:.4f}",
        flush=True,
    )
    return printer.first, printer.last
