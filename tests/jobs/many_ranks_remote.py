"""Functions that ``many_ranks.py`` runs on other ranks.

RPCs send functions by reference (module and name), so they live in a module that
every rank imports under the same name; the job script's folder is on ``sys.path``.
"""

from __future__ import annotations

import torch

from lightning_distgrad import rpc

#: This rank's parameter for the distributed optimizer (see :func:`parameter`).
_PARAMETER: list[torch.Tensor] = []


def me() -> int:
    """This worker's rank."""
    return rpc.get_worker_info().id


def add_rank(t: torch.Tensor) -> torch.Tensor:
    """``t`` plus the callee's rank (shows which rank answered)."""
    return t + me()


def made_by(creator: int) -> torch.Tensor:
    """The value of an RRef: who asked for it, and who owns it."""
    return torch.tensor([creator, me()])


def fetch_and_forward(rref: rpc.RRef, to: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fetch ``rref`` here, then have rank ``to`` fetch it too; both values."""
    return rref.to_here(), rpc.rpc_sync(to, fetch, (rref,))


def fetch(rref: rpc.RRef) -> torch.Tensor:
    return rref.to_here()


def hop_step(t: torch.Tensor, rank: int) -> torch.Tensor:
    """One hop's computation, which depends on the rank that runs it."""
    return torch.tanh(t * (1.0 + rank / 8.0)) + 0.5 * t


def hop(t: torch.Tensor, hops_left: int, world: int) -> torch.Tensor:
    """Compute this hop, then hand the result to the next rank until no hop is left.

    Each call is a ``rpc_sync`` inside the handler of the previous one, so the
    distributed autograd context and the graph run through every rank on the way.
    """
    y = hop_step(t, me())
    if hops_left == 1:
        return y
    return rpc.rpc_sync((me() + 1) % world, hop, (y, hops_left - 1, world))


def initial_parameter(rank: int) -> torch.Tensor:
    """The starting value of rank ``rank``'s parameter (the local reference uses it too)."""
    return torch.arange(3, dtype=torch.float32) + rank


def parameter() -> torch.Tensor:
    """This rank's parameter, made once; an RRef to it is owned by this rank."""
    if not _PARAMETER:
        _PARAMETER.append(initial_parameter(me()).requires_grad_())
    return _PARAMETER[0]


def parameter_loss(p_rref: rpc.RRef, scale: float) -> torch.Tensor:
    """The loss term of one parameter, computed on its owner."""
    return (p_rref.local_value() * scale).pow(2).sum()


def current_parameter() -> torch.Tensor:
    return parameter().detach().clone()


class PlainSGD(torch.optim.Optimizer):
    """``p -= lr * p.grad``, the update of ``torch.optim.SGD`` with its defaults.

    A ``torch.optim.Optimizer`` subclass, as ``DistributedOptimizer`` takes only those, that
    does not run ``torch.optim.Optimizer.__init__``, which imports ``torch._dynamo``
    (about 2 CPU-seconds a process): in a 16-rank job on 2 cores that import on every rank
    would be half the job's time, and it tests nothing of the package. The optimizer's
    fan-out to every rank is what this job checks; torch's own optimizer classes are
    checked by ``test_dist_optim.py``.
    """

    def __init__(self, params, lr: float):
        self.params, self.lr = list(params), lr

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for p in self.params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-self.lr)
