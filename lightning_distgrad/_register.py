"""Make ``Trainer(strategy="distgrad")`` work without importing Lightning at package import.

Lightning 2.x has no entry points for strategies: a name works only once ``StrategyRegistry``
holds it, and the registry lives in ``lightning.pytorch``, whose import costs seconds. Users of
``lightning_distgrad.rpc`` alone should not pay that, so ``import lightning_distgrad``
registers at once only if ``lightning.pytorch`` is already imported; otherwise it adds a
one-shot import hook (a ``sys.meta_path`` finder) that registers right after
``lightning.pytorch`` finishes importing, which is before any ``Trainer`` can exist. Either
way it imports ``lightning_distgrad.lightning.strategy``, which registers (guarded, so at most
once) when it is first imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any

__all__ = ["register_strategy_with_lightning"]

_TARGET = "lightning.pytorch"


def _register() -> None:
    """Import the strategy module, which registers ``"distgrad"`` when it is first imported."""
    if "lightning_distgrad.lightning" in sys.modules:
        return  # being imported right now (it imports lightning): it registers when done
    try:
        importlib.import_module("lightning_distgrad.lightning.strategy")
    except Exception as e:  # never break `import lightning` because of this package
        warnings.warn(
            f"lightning_distgrad could not register strategy='distgrad' with"
            f" Lightning ({type(e).__name__}: {e}). HINT: pass"
            " `strategy=DistAutogradStrategy(...)` instead.",
            stacklevel=2,
        )


class _RegisteringLoader(importlib.abc.Loader):
    """Runs the real loader of ``lightning.pytorch``, then registers."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _register()

    def __getattr__(self, name: str) -> Any:  # is_package, get_source, resource readers, ...
        return getattr(self._loader, name)


class _LightningFinder(importlib.abc.MetaPathFinder):
    """Finds ``lightning.pytorch`` like the other finders would, with the loader wrapped."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from coming back here
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


def register_strategy_with_lightning() -> None:
    """Register ``"distgrad"`` now if ``lightning.pytorch`` is imported, else when it is."""
    if _TARGET in sys.modules:
        _register()
    elif not any(isinstance(finder, _LightningFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _LightningFinder())
