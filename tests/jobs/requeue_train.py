"""A small Lightning job for the Slurm auto-requeue tests: 2+ trainers and one serving rank.

Run as a job (``srun``/``mpiexec -n 3 python -m mpi4py tests/jobs/requeue_train.py --root D
--steps N --out F``): trainers fit a model whose head is a RemoteModule on the last rank, with
SGD and momentum; trainer 0 prints ``REQUEUE_JOB ...`` lines (the step it starts from, each
step) and writes the final parameters, remote ones included, to ``--out``. The tests import it
for the model and for :func:`reference`, the same training in one process.

The batch of each step depends only on the step and the trainer (:func:`step_batch`), so a run
resumed mid-epoch from any checkpoint sees the same data as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

IN, HIDDEN, BATCH = 4, 8, 4
LR, MOMENTUM = 0.05, 0.9


class Head(nn.Module):
    """The remote part; its initial values depend only on ``seed`` (built on an RPC thread)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.linear = nn.Linear(HIDDEN, 1)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in self.linear.parameters():
                param.copy_(torch.empty_like(param).uniform_(-0.3, 0.3, generator=generator))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear(h)


def step_batch(step: int, trainer_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of trainer ``trainer_rank`` at optimisation step ``step``."""
    generator = torch.Generator().manual_seed(1000 * step + trainer_rank)
    x = torch.randn(BATCH, IN, generator=generator)
    return x, x.sum(1, keepdim=True).sin()


class RequeueModel(L.LightningModule):
    """A local body (replicated over the trainers) and a remote head on the first server."""

    def __init__(self, on_step: Callable[[L.LightningModule], None] | None = None):
        super().__init__()
        generator = torch.Generator().manual_seed(7)
        self.body = nn.Linear(IN, HIDDEN)
        with torch.no_grad():
            for param in self.body.parameters():
                param.copy_(torch.empty_like(param).uniform_(-0.5, 0.5, generator=generator))
        self.head: nn.Module | None = None
        self.on_step = on_step  # tests: runs inside each training step, before the backward

    def configure_model(self) -> None:
        if self.head is None:
            strategy = self.trainer.strategy
            self.head = strategy.remote_module(strategy.server_device(0), Head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))

    def training_step(self, batch, batch_idx):
        x, y = step_batch(self.global_step, self.trainer.global_rank)
        loss = nn.functional.mse_loss(self(x), y)
        if self.on_step is not None:
            self.on_step(self)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


def loader(steps: int, num_trainers: int) -> DataLoader:
    """Placeholder batches, enough for ``steps`` steps in one epoch (the data comes from
    :func:`step_batch`)."""
    return DataLoader(range(steps * num_trainers), batch_size=1)


def reference(steps: int, num_trainers: int) -> dict[str, torch.Tensor]:
    """The parameters after ``steps`` steps in one process, on the union of the trainers'
    batches: what the distributed run must end with."""
    model = RequeueModel()
    model.head = Head()
    optimizer = model.configure_optimizers()
    for step in range(steps):
        batches = [step_batch(step, t) for t in range(num_trainers)]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class _Progress(L.Callback):
    def __init__(self, step_sleep: float):
        self.step_sleep = step_sleep

    def on_train_start(self, trainer, pl_module):
        if trainer.is_global_zero:
            restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
            print(f"REQUEUE_JOB start step={trainer.global_step} restarts={restarts}", flush=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.is_global_zero:
            print(f"REQUEUE_JOB step={trainer.global_step}", flush=True)
        time.sleep(self.step_sleep)  # a run long enough to be signalled half-way


def _kill_once(marker: str, step: int) -> Callable[[L.LightningModule], None]:
    """A training-step hook that SIGKILLs trainer 1 at ``step``, once (``marker`` records it)."""

    def on_step(module: L.LightningModule) -> None:
        if module.global_step == step and module.trainer.global_rank == 1:
            if not os.path.exists(marker):
                open(marker, "w").close()
                print(f"REQUEUE_JOB killing trainer 1 at step={step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    return on_step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", required=True, help="default_root_dir: hpc checkpoints")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", required=True, help="trainer 0 writes the final state here")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--every", type=int, default=0, help="ModelCheckpoint every N steps")
    parser.add_argument("--kill-at", type=int, default=-1, help="SIGKILL trainer 1 there, once")
    args = parser.parse_args(argv)

    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_distgrad import DistAutogradStrategy

    strategy = DistAutogradStrategy(num_servers=1)
    callbacks: list[L.Callback] = [_Progress(args.step_sleep)]
    if args.every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=os.path.join(args.root, "periodic"),
                every_n_train_steps=args.every,
                save_top_k=-1,
                save_last=True,
            )
        )
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_steps=args.steps,
        default_root_dir=args.root,
        logger=False,
        enable_checkpointing=bool(args.every),
        enable_model_summary=False,
        enable_progress_bar=False,
        callbacks=callbacks,
    )
    on_step = _kill_once(os.path.join(args.root, "killed"), args.kill_at)
    model = RequeueModel(on_step if args.kill_at >= 0 else None)
    num_trainers = strategy.num_trainers
    # The requeue case needs no ckpt_path (the hpc checkpoint is found under Slurm); a job
    # resubmitted after a crash resumes from ModelCheckpoint's last.ckpt.
    trainer.fit(model, loader(args.steps, num_trainers), ckpt_path="last" if args.every else None)
    if trainer.is_global_zero:
        state = {k: v.detach().cpu() for k, v in strategy.lightning_module_state_dict().items()}
        torch.save({"state": state, "global_step": trainer.global_step}, args.out)
        print(f"REQUEUE_JOB done step={trainer.global_step}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
