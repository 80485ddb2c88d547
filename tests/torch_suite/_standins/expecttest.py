"""Stand-in for the ``expecttest`` package, used only when it is not installed.

``torch.testing._internal.common_utils`` imports ``expecttest`` for the base class of its
``TestCase``; the RPC test classes that this suite runs never call ``assertExpectedInline``
(the only thing the real package adds), so a plain ``unittest.TestCase`` serves. Install
the real one (``pip install expecttest``, in the ``test`` extra) to run torch's tests
exactly as torch does.
"""

import unittest

ACCEPT = False


class TestCase(unittest.TestCase):
    """``unittest.TestCase``: the part of ``expecttest.TestCase`` that the RPC tests use."""
