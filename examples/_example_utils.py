"""Plumbing shared by the plain-RPC examples: printing, barriers, command lines, JSON dumps.

Not an example itself: ``dist_autograd_simple.py``, ``parameter_server.py`` and ``ddp_rpc.py``
import what they need with ``from _example_utils import ...`` (running ``examples/<name>.py``
puts ``examples/`` on ``sys.path``). Nothing here is specific to a model or a training loop;
those stay in the examples. The Lightning examples' plumbing is in ``_lightning_utils.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch
from mpi4py import MPI

# ---------------------------------------------------------------------------
# Output and synchronisation


def say(line: str) -> None:
    """Print one line in a single write (lines of several ranks then never interleave)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def polite_barrier(comm: MPI.Comm) -> None:
    """``comm.Barrier()`` that sleeps instead of spinning (MPICH spins in blocking calls)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.0002)


# ---------------------------------------------------------------------------
# Command lines and result dumps


def steps_parser(
    doc: str, steps: int, lr: float, seed: int, dump_help: str
) -> argparse.ArgumentParser:
    """A parser with ``--steps``, ``--lr``, ``--seed``, ``--dump`` and ``--quiet``.

    Args:
        doc: the example's docstring; its first line describes the program in ``--help``.
        steps, lr, seed: the defaults of ``--steps``, ``--lr`` and ``--seed``.
        dump_help: the help of ``--dump FILE`` (what the example writes there, as JSON).
    """
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--seed", type=int, default=seed)
    parser.add_argument("--dump", help=dump_help)
    parser.add_argument("--quiet", action="store_true", help="print only the summary")
    return parser


def tensors_to_lists(tensors: dict[str, torch.Tensor]) -> dict[str, list]:
    """``{name: tensor}`` as ``{name: nested lists}``, for ``json.dump``."""
    return {k: v.tolist() for k, v in tensors.items()}


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Write ``payload`` (JSON-serialisable: convert tensors first) to the file ``path``."""
    with open(path, "w") as f:
        json.dump(payload, f)
