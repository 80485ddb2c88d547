"""How long tests wait for what should happen, scaled for slow and busy machines.

A test that waits for something that should happen (a reply, a released context, a job
that ends) bounds the wait, so that a hang fails the test instead of blocking the suite.
Every such bound goes through :func:`scaled`: it is multiplied by the environment
variable ``LIGHTNING_DISTGRAD_TEST_SLOWDOWN`` (default 1), which a slow or busy machine
raises::

    LIGHTNING_DISTGRAD_TEST_SLOWDOWN=3 bash tests/run_all.sh

A timeout that a test sets in order to see it fire stays as it is.

Example::

    >>> scaled(30.0) == 30.0 * SLOWDOWN
    True
"""

from __future__ import annotations

import os

VARIABLE = "LIGHTNING_DISTGRAD_TEST_SLOWDOWN"


def _slowdown() -> float:
    text = os.environ.get(VARIABLE, "").strip() or "1"
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"{VARIABLE} must be a factor > 0 for time limits, got {text!r}")
    return value


#: The factor every time limit of the tests is multiplied by.
SLOWDOWN = _slowdown()


def scaled(seconds: float) -> float:
    """``seconds`` times :data:`SLOWDOWN`: the bound on a wait for something that should happen."""
    return seconds * SLOWDOWN
