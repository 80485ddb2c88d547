"""A 16-rank job: RPC, RRefs, distributed autograd and the optimizer across every rank.

A serial test (the plain ``pytest`` pass): it starts ``jobs/many_ranks.py`` under
``mpiexec -n 16``, far more ranks than cores, and checks that every rank finished
(the script asserts its own results and raises on any mismatch, among them that the agent
keeps no table sized n x n, that init_rpc brought each rank a few bytes whatever the size,
that a rank calling the others once they are in shutdown is answered, and that shutdown
sent at most 4 log2(16) + 4 frames), then the frozen-peer jobs of ``_frozen_peer`` at 16
ranks.
"""

from __future__ import annotations

import re
import sys

import _frozen_peer as frozen_peer
import pytest
from _job_runner import LAUNCHER, TESTS, mpi_job
from _timing import scaled

RANKS = 16
#: Oversubscribed 8:1 on two cores the job takes about 30 s; a hung one is killed.
TIMEOUT_S = scaled(240)


@pytest.mark.skipif(LAUNCHER is None, reason="no MPI launcher found")
def test_rpc_rrefs_autograd_and_optimizer_on_16_ranks(tmp_path):
    result = mpi_job(
        RANKS,
        [sys.executable, "-m", "mpi4py", str(TESTS / "jobs" / "many_ranks.py"), str(scaled(60))],
        TIMEOUT_S,
        tmp_path,
        {"TMPDIR": str(tmp_path)},
    )
    assert result.code == 0, result.describe()
    # Lines of different ranks may run together in the job's output: no line anchors.
    done = sorted(int(r) for r in re.findall(r"MANY_RANKS_OK (\d+)", result.output))
    assert done == list(range(RANKS)), result.describe()
    assert "Traceback" not in result.output, result.describe()


@pytest.mark.skipif(LAUNCHER is None, reason="no MPI launcher found")
@pytest.mark.parametrize("mode", ["timed", "default"])
def test_a_frozen_peer_among_16_ranks(tmp_path, mode):
    """A stopped rank bounds a timed shutdown and ends a default one, named, at 16 ranks."""
    result = mpi_job(RANKS, frozen_peer.argv(mode), TIMEOUT_S, tmp_path)
    assert not result.hung, result.describe()
    check = frozen_peer.check_timed if mode == "timed" else frozen_peer.check_default
    check(result, RANKS)
