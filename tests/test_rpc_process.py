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

import mpi_launch
import pytest
from _timing import scaled

#: A hung job is killed after this long; a job that works ends far sooner.
JOB_TIMEOUT_S = scaled(180)
#: The timeouts the frozen-peer jobs set (and see fire): of a call, of a timed shutdown, and
#: the RPC timeout after which an unanswered liveness ping ends a default shutdown (that
#: one scaled: the healthy ranks must answer their pings within it).
CALL_TIMEOUT_S = 1
SHUTDOWN_TIMEOUT_S = 2
PING_TIMEOUT_S = round(scaled(2), 1)
#: A timed shutdown raises at most this long after its timeout: far less than the RPC
#: timeout (60 s) that a shutdown ignoring its own timeout would wait for.
SHUTDOWN_RAISE_BOUND_S = scaled(10)
LAUNCHER = mpi_launch.find_launcher()

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


FROZEN_PEER_TIMEOUT = f"""
    import os, signal, time
    import torch
    from mpi4py import MPI
    import lightning_distgrad.rpc as rpc
    from lightning_distgrad.rpc._transport import abort_mpi_job

    rpc.init_rpc()
    me = rpc.get_worker_info().id
    rpc.rpc_sync((me + 1) % 3, torch.add, (torch.ones(1), 1))  # every agent answers
    MPI.COMM_WORLD.Barrier()  # every call was answered before rank 2 stops
    if me == 2:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: answers nothing from now on
    time.sleep(0.5)
    if me == 0:
        try:
            rpc.rpc_sync("worker2", torch.add, (torch.ones(1), 1), timeout={CALL_TIMEOUT_S})
        except RuntimeError as e:
            print(f"call failed: {{e}}", flush=True)
    start = time.monotonic()
    try:
        rpc.shutdown(timeout={SHUTDOWN_TIMEOUT_S})
    except RuntimeError as e:
        print(f"rank {{me}} shutdown raised after {{time.monotonic() - start:.2f}} s: {{e}}",
              flush=True)
    if me == 1:
        MPI.COMM_WORLD.send("printed", dest=0)
    if me == 0:
        MPI.COMM_WORLD.recv(source=1)  # rank 1's line is out
        # The only way to end a job with a stopped rank; this one waits until the launcher
        # has read rank 0's own line.
        abort_mpi_job("", 3)
    time.sleep(600)
"""

FROZEN_PEER_DEFAULT = f"""
    import os, signal, time
    import torch
    from mpi4py import MPI
    import lightning_distgrad.rpc as rpc

    rpc.init_rpc(rpc_backend_options=rpc.MPIRpcBackendOptions(rpc_timeout={PING_TIMEOUT_S}))
    me = rpc.get_worker_info().id
    rpc.rpc_sync((me + 1) % 3, torch.add, (torch.ones(1), 1))
    MPI.COMM_WORLD.Barrier()
    if me == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(0.5)
    rpc.shutdown()
    print(f"rank {{me}} shutdown returned", flush=True)
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
    "frozen-peer-timeout": (FROZEN_PEER_TIMEOUT, _mpi(3, "-m", "mpi4py")),
    "frozen-peer-default": (FROZEN_PEER_DEFAULT, _mpi(3, "-m", "mpi4py")),
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
    for name in sorted(wanted):
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
@pytest.mark.job("frozen-peer-timeout")
def test_a_frozen_peer_bounds_calls_and_a_timed_shutdown(jobs):
    """A stopped rank (SIGSTOP): a call to it times out naming it, and a timed shutdown
    raises on every healthy rank once its timeout passed, naming the worker that did not
    join."""
    out = finished(jobs["frozen-peer-timeout"]).output
    said = f"call failed: RPC ran for more than set timeout ({CALL_TIMEOUT_S * 1000} ms)"
    assert said in out, out
    assert "(call to worker2, rank 2)" in out, out
    for rank in (0, 1):
        said = f"rank {rank} shutdown raised"
        line = next((ln for ln in out.splitlines() if ln.startswith(said)), None)
        assert line is not None, out
        seconds = float(line.split(" after ")[1].split(" s")[0])
        assert 0.9 * SHUTDOWN_TIMEOUT_S <= seconds <= SHUTDOWN_TIMEOUT_S + SHUTDOWN_RAISE_BOUND_S
        assert "worker2 (rank 2) did not call shutdown" in line, line


@needs_mpiexec
@pytest.mark.job("frozen-peer-default")
def test_a_frozen_peer_ends_a_default_shutdown_by_aborting_the_job(jobs):
    """Without a timeout, shutdown waits for workers that answer; one that leaves a
    liveness ping unanswered for the RPC timeout ends the job, named."""
    result = finished(jobs["frozen-peer-default"])
    code, out = result.code, result.output
    assert code != 0, out
    assert f"worker2 (rank 2) did not answer for {PING_TIMEOUT_S:g} s" in out, out
    assert "shutdown returned" not in out, out
    assert result.seconds < scaled(60), out
