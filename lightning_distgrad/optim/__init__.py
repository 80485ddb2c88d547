"""Distributed optimizers with the API of ``torch.distributed.optim``."""

from .optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
