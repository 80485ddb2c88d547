"""The torch and Lightning releases the package supports, checked at import.

Importing the package checks the installed torch against :data:`SUPPORTED_TORCH`, and importing
``lightning_distgrad.lightning`` checks Lightning against :data:`SUPPORTED_LIGHTNING`: a release
below the floor raises ``ImportError`` saying what it lacks; one newer than the newest tested
warns once per package and process, and runs.
"""

from __future__ import annotations

import re
import threading
import warnings

import torch

__all__ = [
    "SUPPORTED_LIGHTNING",
    "SUPPORTED_TORCH",
    "check_lightning_version",
    "check_torch_version",
    "check_version",
]

#: ``(floor, newest tested)`` ``(major, minor)`` releases of torch; CI tests both ends.
SUPPORTED_TORCH = ((2, 5), (2, 14))
#: The same for Lightning.
SUPPORTED_LIGHTNING = ((2, 4), (2, 6))
#: What each package's floor is for: the error below it names this.
_FLOOR_REASON = {
    "torch": "its distributed backward pass restarts torch's autograd engine from GradientEdge"
    " roots (torch.autograd.graph.GradientEdge), which the engine accepts from torch 2.5 on",
    "lightning": "its strategy overrides Strategy hooks that Lightning has had since 2.4",
}

_warned: set[str] = set()
_warned_lock = threading.Lock()


def _release(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def describe(supported: tuple[tuple[int, int], tuple[int, int]]) -> str:
    """``"2.5 to 2.14"`` for ``((2, 5), (2, 14))``."""
    (lo_major, lo_minor), (hi_major, hi_minor) = supported
    return f"{lo_major}.{lo_minor} to {hi_major}.{hi_minor}"


def check_version(
    package: str, found: str, supported: tuple[tuple[int, int], tuple[int, int]]
) -> None:
    """Check ``found``, the installed version of ``package``, against ``supported``.

    ``supported`` is ``(floor, newest tested)`` as ``(major, minor)``. Below the floor this
    raises ``ImportError`` naming what the package needs; above the newest tested release (or
    for a version that names no release) it warns once per package and process; in between
    it returns silently.

    Example::

        >>> check_version("torch", "2.13.1+cpu", ((2, 5), (2, 14)))  # supported: returns
        >>> check_version("torch", "2.4.1", ((2, 5), (2, 14)))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ImportError: lightning_distgrad needs torch 2.5 or newer (supported: 2.5 to 2.14), ...
    """
    release = _release(found)
    floor, newest = supported
    if release is not None and release < floor:
        raise ImportError(
            f"lightning_distgrad needs {package} {floor[0]}.{floor[1]} or newer (supported:"
            f" {describe(supported)}), but {package} {found} is installed:"
            f" {_FLOOR_REASON[package]}. HINT: pip install '{package}>={floor[0]}.{floor[1]}'"
        )
    if release is not None and release <= newest:
        return
    with _warned_lock:
        if package in _warned:
            return
        _warned.add(package)
    warnings.warn(
        f"lightning_distgrad is tested with {package} {describe(supported)}, not with {package}"
        f" {found}. It relies on a few private APIs (lightning_distgrad._compat): one that is"
        " gone raises ImportError naming it, and a changed one may misbehave.",
        RuntimeWarning,
        stacklevel=2,
    )


def check_torch_version() -> None:
    """:func:`check_version` for the installed torch (when the package is imported)."""
    check_version("torch", torch.__version__, SUPPORTED_TORCH)


def check_lightning_version() -> None:
    """:func:`check_version` for the installed Lightning (``lightning_distgrad.lightning``)."""
    import lightning

    check_version("lightning", lightning.__version__, SUPPORTED_LIGHTNING)


check_torch_version()
