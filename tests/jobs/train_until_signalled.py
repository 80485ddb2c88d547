"""Job script: 3 ranks train until something ends the job (``tests/test_rpc_faults.py``).

Ranks 0 and 1 train a module that lives on rank 2, each step one distributed autograd
context with a remote optimizer step; rank 2 serves. ``--lightning`` trains the same way
through ``Trainer(strategy=DistAutogradStrategy(num_servers=1))``. The RPC timeout is 600 s,
so a rank left waiting for a lost peer would wait far longer than any test does.

Files in the working directory tell the test where the job is: ``pid.<rank>`` (written at
start), ``training`` (once rank 0 has trained 20 steps). With ``--exit-rank R`` rank R
leaves with exit status 0, without shutting down RPC, once the test writes ``go``.
Training never ends by itself before ``--max-seconds``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from mpi4py import MPI

RPC_TIMEOUT_S = 600.0
READY_STEPS = 20

args = argparse.ArgumentParser()
args.add_argument("--lightning", action="store_true")
args.add_argument("--exit-rank", type=int, default=-1)
args.add_argument("--max-seconds", type=float, default=300.0)
opts = args.parse_args()
RANK = MPI.COMM_WORLD.Get_rank()
START = time.monotonic()
Path(f"pid.{RANK}").write_text(str(os.getpid()))


def after_step(step: int) -> bool:
    """Marks progress and leaves when asked; False once training should stop."""
    if RANK == 0 and step == READY_STEPS:
        Path("training").write_text("")
    if RANK == opts.exit_rank and Path("go").exists():
        print(f"rank {RANK} leaves without shutting down", flush=True)
        os._exit(0)
    time.sleep(0.002)
    return time.monotonic() - START < opts.max_seconds


def train_rpc() -> None:
    import lightning_distgrad.autograd as dist_autograd
    from lightning_distgrad import rpc
    from lightning_distgrad.nn import RemoteModule
    from lightning_distgrad.optim import DistributedOptimizer

    rpc.init_rpc(rpc_backend_options=rpc.MPIRpcBackendOptions(rpc_timeout=RPC_TIMEOUT_S))
    if RANK < 2:
        layer = RemoteModule("worker2/cpu", torch.nn.Linear, args=(8, 1))
        opt = DistributedOptimizer(torch.optim.SGD, layer.remote_parameters(), lr=0.01)
        step = 0
        while True:
            step += 1
            with dist_autograd.context() as ctx:
                loss = layer(torch.randn(16, 8)).pow(2).mean()
                dist_autograd.backward(ctx, [loss])
                opt.step(ctx)
            if not after_step(step):
                break
    rpc.shutdown()


def train_lightning() -> None:
    import lightning as L

    from lightning_distgrad import DistAutogradStrategy

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.remote = None
            self.head = torch.nn.Linear(4, 1)

        def configure_model(self):
            if self.remote is None:
                strategy = self.trainer.strategy
                self.remote = strategy.remote_module(
                    strategy.server_device(0), torch.nn.Linear, args=(8, 4)
                )

        def training_step(self, batch, batch_idx):
            (x,) = batch
            loss = self.head(self.remote(x)).pow(2).mean()
            if not after_step(self.global_step + 1):
                self.trainer.should_stop = True
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = torch.utils.data.TensorDataset(torch.randn(256, 8))
    trainer = L.Trainer(
        strategy=DistAutogradStrategy(num_servers=1, rpc_timeout=RPC_TIMEOUT_S),
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=16))


if opts.lightning:
    train_lightning()
else:
    train_rpc()
print(f"rank {RANK} finished", flush=True)
