"""Faults that must end a whole job within seconds: SIGTERM and lost ranks.

Serial tests (the plain ``pytest`` pass): each starts ``jobs/train_until_signalled.py`` on
3 ranks (2 trainers, 1 server) under this interpreter's launcher, waits until it trains,
then sends a signal (to one rank, every rank as ``scancel`` does, or the launcher) or makes
a rank leave without shutting down. Every process of the job must then be gone within
:data:`BOUND_S`: a bound on "ends instead of hanging", not a speed (the job's RPC timeout is
600 s, so a rank left waiting for a lost peer shows).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from _dist_utils import wait_until
from _job_runner import LAUNCHER, TESTS, start_mpi_job
from _timing import scaled

#: Every process of the job is gone this long after the fault, or the job hung.
BOUND_S = scaled(30.0)
#: A job not yet training after this long failed to start.
START_S = scaled(240.0)
#: The launcher's own kill; nothing here should get near it.
JOB_TIMEOUT_S = scaled(600)
RANKS = 3

pytestmark = pytest.mark.skipif(LAUNCHER is None, reason="no MPI launcher found")

#: The two kinds of job: plain RPC training, and a Lightning job (two trainers, one server).
KINDS = pytest.mark.parametrize("args", [[], ["--lightning"]], ids=["rpc", "lightning"])


class Running:
    """A started job and the folder where its ranks leave their pids."""

    def __init__(self, args: list[str], folder: Path):
        self.folder = folder
        script = str(TESTS / "jobs" / "train_until_signalled.py")
        argv = [sys.executable, "-m", "mpi4py", script, *args]
        self.job = start_mpi_job(RANKS, argv, JOB_TIMEOUT_S, folder)

    def pids(self) -> dict[int, int]:
        return {r: int((self.folder / f"pid.{r}").read_text()) for r in range(RANKS)}

    def wait_training(self) -> dict[int, int]:
        """The ranks' pids, once rank 0 trains (fails if the job never got there)."""
        started = wait_until(
            lambda: (self.folder / "training").exists() or self.job.proc.poll() is not None,
            timeout=START_S,
        )
        if not started or self.job.proc.poll() is not None:
            self.job.kill()
            pytest.fail(f"the job did not start training: {self.job.wait(1).describe()}")
        return self.pids()

    def ends_within_bound(self, pids: dict[int, int]) -> str:
        """Waits up to BOUND_S for the launcher and every rank to end; the job's output.
        Fails, naming what still runs, if they did not."""
        fault = time.monotonic()
        result = self.job.wait(fault - self.job.start + BOUND_S)
        left = [r for r, pid in pids.items() if not wait_until(lambda p=pid: not alive(p), 5)]
        if result.hung or left:
            pytest.fail(
                f"{BOUND_S:g} s after the fault, ranks {left} were still running "
                f"(launcher {'hung' if result.hung else 'ended'}): {result.describe()}"
            )
        return result.output


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.fixture
def start(tmp_path):
    """Starts the job of one test (one at a time: ``srun`` steps of one allocation queue
    behind each other)."""
    started = []

    def start_job(*args: str) -> Running:
        started.append(Running(list(args), tmp_path))
        return started[-1]

    yield start_job
    for running in started:
        running.job.kill()


@KINDS
def test_sigterm_to_one_rank_ends_the_job(start, args):
    """In a Lightning job, Lightning's own SIGTERM handler stops that trainer's loop, after
    which a graceful shutdown would wait for the other trainer and the server for ever."""
    running = start(*args)
    pids = running.wait_training()
    os.kill(pids[1], signal.SIGTERM)
    assert "rank 1 received SIGTERM; aborting the MPI job" in running.ends_within_bound(pids)


@KINDS
def test_sigterm_to_every_rank_ends_the_job(start, args):
    """As ``scancel`` or a time limit without ``--signal`` do."""
    running = start(*args)
    pids = running.wait_training()
    for pid in pids.values():
        os.kill(pid, signal.SIGTERM)
    running.ends_within_bound(pids)


def test_sigterm_to_the_launcher_ends_the_job(start):
    running = start()
    pids = running.wait_training()
    running.job.proc.send_signal(signal.SIGTERM)
    running.ends_within_bound(pids)


@pytest.mark.parametrize("rank", [1, 2], ids=["trainer", "server already in shutdown"])
def test_a_killed_rank_ends_the_job(start, rank):
    running = start()
    pids = running.wait_training()
    os.kill(pids[rank], signal.SIGKILL)
    running.ends_within_bound(pids)


def test_a_rank_that_leaves_without_shutting_down_ends_the_job(start):
    """Exit status 0 and no ``rpc.shutdown()``: a launcher that kills the job only on a
    failed rank (``srun --kill-on-bad-exit=1``) leaves the others running; their agents
    see the rank's process end and abort the job."""
    running = start("--exit-rank", "1")
    pids = running.wait_training()
    (running.folder / "go").write_text("")
    output = running.ends_within_bound(pids)
    assert "rank 1 leaves without shutting down" in output
