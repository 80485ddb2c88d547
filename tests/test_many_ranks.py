"""A 16-rank job: RPC, RRefs, distributed autograd and the optimizer across every rank.

A serial test (the plain ``pytest`` pass): it starts ``jobs/many_ranks.py`` under
``mpiexec -n 16``, far more ranks than cores, and checks that every rank finished
(the script asserts its own results and raises on any mismatch).
"""

from __future__ import annotations

import re
import sys

import pytest
from _job_runner import MPIEXEC, TESTS, clean_env, run_job

RANKS = 16
#: Oversubscribed 8:1 on two cores the job takes about 30 s; a hung one is killed.
TIMEOUT_S = 240


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")
def test_rpc_rrefs_autograd_and_optimizer_on_16_ranks(tmp_path):
    argv = [MPIEXEC, "-n", str(RANKS), sys.executable, "-m", "mpi4py",
            str(TESTS / "jobs" / "many_ranks.py")]
    env = clean_env({"TMPDIR": str(tmp_path), "MPIEXEC_TIMEOUT": str(TIMEOUT_S - 5)})
    result = run_job(argv, timeout_s=TIMEOUT_S, cwd=tmp_path, env=env)
    assert result.code == 0, result.describe()
    # Lines of different ranks may run together in the job's output: no line anchors.
    done = sorted(int(r) for r in re.findall(r"MANY_RANKS_OK (\d+)", result.output))
    assert done == list(range(RANKS)), result.describe()
    assert "Traceback" not in result.output, result.describe()
