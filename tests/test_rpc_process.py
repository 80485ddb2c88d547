"""Whole jobs in subprocesses: a failing rank ends the job, exit paths, one-process RPC.

Serial tests (the plain ``pytest`` pass). Under ``mpiexec -n N`` the conftest
deselects them: an MPI job must not start another one from every rank.

Starting a job costs seconds (Python, torch, MPI), so the first test of this
module starts every job of the module at once (only those of the selected
tests) and each test then checks the result of its own job.
"""

from __future__ import annotations

import sys
import textwrap

import _frozen_peer as frozen_peer
import mpi_launch
import pytest
from _job_runner import start_mpi_job
from _timing import scaled

#: A hung job is killed after this long; a job that works ends far sooner.
JOB_TIMEOUT_S = scaled(180)
LAUNCHER = mpi_launch.find_launcher()
#: Job sizes of the frozen-peer tests here (``test_many_ranks`` runs them at 16).
FROZEN_PEER_SIZES = (2, 4)

needs_mpiexec = pytest.mark.skipif(LAUNCHER is None, reason="no MPI launcher found")


# ---------------------------------------------------------------------------
# Job scripts


RAISES_AFTER_INIT = """
    import lightning_distgrad.rpc as rpc

    rpc.init_rpc()
    rank = rpc.get_worker_info().id
    print(f"started {rank}", flush=True)
    if rank == 1:
        raise ValueError("boom from user code")
    # Rank 0 waits for rank 1 in a graceful shutdown: without the abort it
    # would wait forever.
    rpc.shutdown()
    print("rank 0 finished shutdown", flush=True)
"""

FORGETS_SHUTDOWN = """
    import torch
    import lightning_distgrad.rpc as rpc

    rpc.init_rpc()
    me = rpc.get_worker_info().id
    peer = (me + 1) % 2
    futs = [rpc.rpc_async(peer, torch.add, (torch.ones(2), i)) for i in range(20)]
    print(f"rank {me} sent", flush=True)
    # No rpc.shutdown(): the exit hook shuts down gracefully, so the peer's
    # requests are still answered.
"""

SINGLE_PROCESS_LIFECYCLE = """
    import torch
    import lightning_distgrad.rpc as rpc

    def expect_not_initialized(call, shut_down=False):
        try:
            call()
        except RuntimeError as e:
            assert str(e).startswith("RPC has not been initialized"), e
            assert ("RPC has been shut down" in str(e)) == shut_down, e
        else:
            raise AssertionError("no error")

    for call in (lambda: rpc.rpc_sync("worker0", torch.add, (torch.ones(1), 1)),
                 lambda: rpc.get_worker_info(), lambda: rpc.RRef(1)):
        expect_not_initialized(call)
    for round in range(2):
        rpc.init_rpc()
        assert rpc.get_worker_info() == rpc.WorkerInfo("worker0", 0)
        assert torch.equal(rpc.rpc_sync("worker0", torch.add, (torch.ones(2), 1)),
                           torch.full((2,), 2.0))
        assert rpc.rpc_async(0, max, (3, 4)).wait() == 4
        rref = rpc.remote("worker0", torch.mul, (torch.ones(2), 3))
        assert rref.is_owner() and torch.equal(rref.to_here(), torch.full((2,), 3.0))
        rpc.shutdown()
        expect_not_initialized(lambda: rpc.rpc_sync(0, max, (1, 2)), shut_down=True)
    print("lifecycle ok", flush=True)
"""


def _mpi(n: int, *python_args: str) -> list[str] | None:
    """The launcher's command for ``n`` ranks of ``python python_args``; None without one.

    No launcher timeout: the test detects hangs itself (a launcher killing the job would
    look like an abort).
    """
    if LAUNCHER is None:
        return None
    return mpi_launch.command(LAUNCHER, n, [sys.executable, *python_args])[0]


#: job name -> (script, argv before the script's path; None: no launcher)
JOBS = {
    "raise-mpi4py": (RAISES_AFTER_INIT, _mpi(2, "-m", "mpi4py")),
    "raise-python": (RAISES_AFTER_INIT, _mpi(2)),
    "forgets-shutdown": (FORGETS_SHUTDOWN, _mpi(2, "-m", "mpi4py")),
    "single-process": (SINGLE_PROCESS_LIFECYCLE, [sys.executable]),
}
#: job name -> (ranks, the argv of each rank): jobs whose script is a file of ``tests/jobs``.
FILE_JOBS = {
    f"frozen-{mode}-{n}": (n, frozen_peer.argv(mode))
    for mode in ("timed", "default")
    for n in FROZEN_PEER_SIZES
}


# ---------------------------------------------------------------------------
# Running jobs


def finished(job: mpi_launch.Job) -> mpi_launch.JobResult:
    """The job's result; fails the test if the job hangs."""
    result = job.wait(JOB_TIMEOUT_S)
    if result.hung:
        pytest.fail(f"hung for {JOB_TIMEOUT_S} s: {result.describe()}")
    return result


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    """Every job wanted by the selected tests of this module, started together."""
    wanted = {
        m.args[0]
        for item in request.session.items
        if item.module is request.module
        for m in item.iter_markers("job")
    }
    started: dict[str, mpi_launch.Job] = {}
    for name in sorted(wanted & FILE_JOBS.keys()):
        if LAUNCHER is not None:
            n, argv = FILE_JOBS[name]
            started[name] = start_mpi_job(n, argv, JOB_TIMEOUT_S, tmp_path_factory.mktemp(name))
    for name in sorted(wanted - FILE_JOBS.keys()):
        script_text, argv = JOBS[name]
        if argv is None:
            continue  # no launcher: its tests are skipped
        folder = tmp_path_factory.mktemp(name)
        script = folder / "job.py"
        script.write_text(textwrap.dedent(script_text))
        started[name] = mpi_launch.Job([*argv, str(script)], cwd=folder, env=mpi_launch.job_env())
    yield started
    for job in started.values():
        job.kill()


# ---------------------------------------------------------------------------
# Tests


@needs_mpiexec
@pytest.mark.parametrize(
    "name",
    [
        pytest.param("raise-mpi4py", marks=pytest.mark.job("raise-mpi4py"), id="python -m mpi4py"),
        pytest.param("raise-python", marks=pytest.mark.job("raise-python"), id="plain python"),
    ],
)
def test_rank_that_raises_after_init_rpc_ends_the_job(jobs, name):
    result = finished(jobs[name])
    code, out, seconds = result.code, result.output, result.seconds
    assert code != 0, out
    # (Rank 0's own output may be lost when the job is killed: not checked.)
    assert "started 1" in out, out
    assert "boom from user code" in out, out
    assert "uncaught ValueError on rank 1" in out, out  # the output names the rank
    assert "rank 0 finished shutdown" not in out, out
    assert seconds < JOB_TIMEOUT_S


@needs_mpiexec
@pytest.mark.job("forgets-shutdown")
def test_job_that_forgets_shutdown_still_exits_cleanly(jobs):
    result = finished(jobs["forgets-shutdown"])
    code, out = result.code, result.output
    assert code == 0, out
    assert "rank 0 sent" in out and "rank 1 sent" in out, out
    assert "Traceback" not in out, out


@pytest.mark.job("single-process")
def test_single_process_lifecycle_without_mpiexec(jobs):
    # A one-rank world (MPI singleton): calls before init_rpc fail, RPC to
    # self works, calls after shutdown fail, and init_rpc works again.
    result = finished(jobs["single-process"])
    code, out = result.code, result.output
    assert code == 0, out
    assert "lifecycle ok" in out, out


@needs_mpiexec
@pytest.mark.parametrize(
    "size", [pytest.param(n, marks=pytest.mark.job(f"frozen-timed-{n}")) for n in FROZEN_PEER_SIZES]
)
def test_a_frozen_peer_bounds_calls_and_a_timed_shutdown(jobs, size):
    """A stopped rank (SIGSTOP): a call to it times out naming it, and a timed shutdown
    raises on every healthy rank once its timeout passed, naming the worker that did not
    join."""
    frozen_peer.check_timed(finished(jobs[f"frozen-timed-{size}"]), size)


@needs_mpiexec
@pytest.mark.parametrize(
    "size",
    [pytest.param(n, marks=pytest.mark.job(f"frozen-default-{n}")) for n in FROZEN_PEER_SIZES],
)
def test_a_frozen_peer_ends_a_default_shutdown_by_aborting_the_job(jobs, size):
    """Without a timeout, shutdown waits for workers that answer; one that leaves a
    liveness ping unanswered for the RPC timeout ends the job, named."""
    frozen_peer.check_default(finished(jobs[f"frozen-default-{size}"]), size)
