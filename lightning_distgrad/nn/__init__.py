"""Modules for distributed training: ``RemoteModule`` (torch API) and ``ReplicatedModule``."""

from .data_parallel import ReplicatedModule
from .remote_module import RemoteModule

__all__ = ["RemoteModule", "ReplicatedModule"]
