"""Lightning integration of ``lightning_distgrad``: the strategy and its cluster environment."""

from lightning_distgrad.lightning.environment import MPIClusterEnvironment
from lightning_distgrad.lightning.strategy import DistAutogradStrategy

__all__ = ["DistAutogradStrategy", "MPIClusterEnvironment"]
