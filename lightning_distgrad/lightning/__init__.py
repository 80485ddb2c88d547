"""Lightning integration of ``lightning_distgrad``: the strategy and its cluster environment.

Importing it checks that the installed Lightning is a tested version and has every private
name the strategy relies on (see ``lightning_distgrad._compat``).
"""

from lightning_distgrad._compat import check_lightning_hooks
from lightning_distgrad._versions import check_lightning_version

check_lightning_version()
check_lightning_hooks()

from lightning_distgrad.lightning.environment import MPIClusterEnvironment  # noqa: E402
from lightning_distgrad.lightning.strategy import DistAutogradStrategy  # noqa: E402

__all__ = ["DistAutogradStrategy", "MPIClusterEnvironment"]
