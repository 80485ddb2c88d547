"""PyTorch distributed autograd, RPC and a Lightning strategy over MPI."""

from typing import Any

from . import (
    _compat,  # noqa: F401  (first: checks the installed torch's version)
    autograd,
    rpc,
)
from ._register import register_strategy_with_lightning

__all__ = ["rpc", "autograd", "DistAutogradStrategy", "MPIClusterEnvironment"]

# `Trainer(strategy="distgrad")` works after `import lightning_distgrad`; Lightning itself is
# imported only when used (see `_register`), so RPC-only programs start fast.
register_strategy_with_lightning()

_LIGHTNING_NAMES = ("DistAutogradStrategy", "MPIClusterEnvironment")


def __getattr__(name: str) -> Any:
    if name == "__version__":
        # pyproject's version is the one source: the installed distribution's metadata, read
        # on first use so that the import does not scan sys.path for it.
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version(__name__)
        except PackageNotFoundError:  # imported from a source tree that was never installed
            value = "0+unknown"
        globals()["__version__"] = value
        return value
    if name in _LIGHTNING_NAMES:
        from . import lightning

        return getattr(lightning, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
