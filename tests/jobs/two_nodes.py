"""Job script of ``tests/test_two_nodes.py``: one job on the emulated nodes serves its tests.

Each rank prints its node facts (``node_local.py``), then runs pytest with the arguments
given (the MPI tests that run across the nodes); the job exits with pytest's status.
"""

from __future__ import annotations

import sys

import node_local
import pytest

if __name__ == "__main__":
    node_local.main()
    sys.exit(pytest.main(sys.argv[1:]))
