"""The test mode that runs the suite on a torch whose own RPC is unavailable.

Under ``LIGHTNING_DISTGRAD_TEST_WITHOUT_TORCH_RPC=1`` every test process, MPI rank and job
that the suite starts finds torch as a build without RPC (Windows builds, builds without
TensorPipe) is: ``torch.distributed.rpc.is_available()`` and
``torch.distributed.autograd.is_available()`` are False, ``torch._C._distributed_rpc`` and
``torch._C._distributed_autograd`` do not exist, and torch's own modules take their paths
for such a build.

torch decides that from two functions of ``torch._C`` (``_rpc_init``, ``_dist_autograd_init``):
where they exist, ``torch.distributed.rpc`` and ``torch.distributed.autograd`` call them at
import, and those calls create the two submodules. :func:`install` removes both functions
when ``torch.distributed`` is first imported (``import torch`` imports it, and
``torch.distributed.rpc``), before either is called. A process must install it before it
imports torch: the ``sitecustomize`` beside this module does so at interpreter start for
every Python process that has this folder on ``PYTHONPATH``, which ``tests/conftest.py`` and
``tests/run_all.sh`` put there under the variable; ``tests/conftest.py`` installs it in its
own process too.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

#: The variable that turns the mode on ("1").
VARIABLE = "LIGHTNING_DISTGRAD_TEST_WITHOUT_TORCH_RPC"
#: The folder to put on ``PYTHONPATH`` (its ``sitecustomize`` installs the mode).
FOLDER = Path(__file__).resolve().parent
#: The functions of ``torch._C`` whose presence torch's ``is_available()`` checks.
INIT_FUNCTIONS = ("_rpc_init", "_dist_autograd_init")


def requested() -> bool:
    """Whether the environment asks for the mode."""
    return os.environ.get(VARIABLE, "") == "1"


def _remove_init_functions(torch_c: object) -> None:
    for name in INIT_FUNCTIONS:
        if hasattr(torch_c, name):
            delattr(torch_c, name)


class _RemoveTorchRpc:
    """A ``sys.meta_path`` finder that finds nothing: on the first import of
    ``torch.distributed`` (or a module in it) it removes :data:`INIT_FUNCTIONS`."""

    removes_torch_rpc = True

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.startswith("torch.distributed") and "torch._C" in sys.modules:
            _remove_init_functions(sys.modules["torch._C"])
        return None


def install() -> None:
    """Make torch's RPC unavailable in this process (again: nothing changes).

    Raises RuntimeError if torch's RPC was set up already (``torch.distributed`` imported
    with it): the mode cannot hold in this process, and a test would pass without it.
    """
    if "torch.distributed" in sys.modules:
        torch_c = sys.modules.get("torch._C")
        if any(hasattr(torch_c, name) for name in INIT_FUNCTIONS) or hasattr(
            torch_c, "_distributed_rpc"
        ):
            raise RuntimeError(
                f"{VARIABLE}=1, but torch was imported with its RPC before the mode was"
                f" installed; put {FOLDER} on PYTHONPATH (tests/run_all.sh does) or"
                " import torch later"
            )
        return
    if not any(getattr(f, "removes_torch_rpc", False) for f in sys.meta_path):
        sys.meta_path.insert(0, _RemoveTorchRpc())


def run_shadowed_sitecustomize() -> None:
    """Run the ``sitecustomize`` that this folder's one hides (a distribution's, in the
    standard library's folder), if there is one: Python imports the first only."""
    rest = [p for p in sys.path if Path(p or os.curdir).resolve() != FOLDER]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
