"""A frozen rank in a graceful shutdown: the jobs (``jobs/frozen_peer.py``) and what their
output must say, at any size (``test_rpc_process`` runs them at 2 and 4 ranks,
``test_many_ranks`` at 16).
"""

from __future__ import annotations

import re
import sys

from _job_runner import TESTS
from _timing import scaled
from mpi_launch import JobResult

#: The timeouts the jobs set (and see fire): of a call, of a timed shutdown, and the RPC
#: timeout after which an unanswered liveness ping ends a default shutdown (scaled: the
#: healthy ranks must answer their pings within it).
CALL_TIMEOUT_S = 1
SHUTDOWN_TIMEOUT_S = 2
PING_TIMEOUT_S = round(scaled(3), 1)
#: A timed shutdown raises at most this long after its timeout: far less than the RPC
#: timeout (60 s) that a shutdown ignoring its own timeout would wait for.
SHUTDOWN_RAISE_BOUND_S = scaled(10)


def argv(mode: str) -> list[str]:
    """The job's Python arguments: ``timed`` (a call and a shutdown with timeouts) or
    ``default`` (a shutdown without one)."""
    script = str(TESTS / "jobs" / "frozen_peer.py")
    seconds = (CALL_TIMEOUT_S, SHUTDOWN_TIMEOUT_S) if mode == "timed" else (PING_TIMEOUT_S,)
    return [sys.executable, "-m", "mpi4py", script, mode, *map(str, seconds)]


def check_timed(result: JobResult, size: int) -> None:
    """The call to the frozen rank timed out naming it; every healthy rank's timed shutdown
    raised once its timeout passed, naming the frozen worker."""
    out, last = result.output, size - 1
    said = f"call failed: RPC ran for more than set timeout ({CALL_TIMEOUT_S * 1000} ms)"
    assert said in out, out
    assert f"(call to worker{last}, rank {last})" in out, out
    for rank in range(last):
        # Lines of different ranks may run together in the job's output: no line anchors.
        said = re.search(
            rf"rank {rank} shutdown raised after ([0-9.]+) s: shutdown timed out after "
            rf"{SHUTDOWN_TIMEOUT_S} s on worker{rank}: (.*?) did not call shutdown",
            out,
        )
        assert said is not None, out
        seconds = float(said[1])
        assert 0.9 * SHUTDOWN_TIMEOUT_S <= seconds <= SHUTDOWN_TIMEOUT_S + SHUTDOWN_RAISE_BOUND_S
        # Only the frozen worker: the others all joined, even those stopped since.
        assert said[2] == f"worker{last} (rank {last})", said[0]


def check_default(result: JobResult, size: int) -> None:
    """The frozen worker ended the job, named, after the RPC timeout; no shutdown returned.

    How long the job ran is no evidence (starting 16 ranks on a busy machine takes longer
    than the ping's timeout): the job's runner fails a job that hangs, and the message names
    the timeout that ended it."""
    out, last = result.output, size - 1
    assert result.code != 0, out
    assert f"worker{last} (rank {last}) did not answer for {PING_TIMEOUT_S:g} s" in out, out
    assert "shutdown returned" not in out, out
