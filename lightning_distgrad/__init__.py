"""PyTorch distributed autograd, RPC and a Lightning strategy over MPI."""

from typing import Any

from . import (
    _compat,  # noqa: F401  (first: checks the installed torch's version)
    autograd,
    rpc,
)
from ._register import register_strategy_with_lightning

__all__ = ["rpc", "autograd", "DistAutogradStrategy", "MPIClusterEnvironment"]
__version__ = "0.1.0"

# `Trainer(strategy="distgrad")` works after `import lightning_distgrad`; Lightning itself is
# imported only when used (see `_register`), so RPC-only programs start fast.
register_strategy_with_lightning()

_LIGHTNING_NAMES = ("DistAutogradStrategy", "MPIClusterEnvironment")


def __getattr__(name: str) -> Any:
    if name in _LIGHTNING_NAMES:
        from . import lightning

        return getattr(lightning, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
