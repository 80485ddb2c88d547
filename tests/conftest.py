"""Shared pytest setup: MPI failure handling and the RPC fixtures.

How the suite runs (``tests/run_all.sh`` does all three):

* ``python -m pytest tests``: serial tests only; ``mpi``-marked tests are skipped.
* ``mpiexec -n N python -m mpi4py -m pytest --with-mpi tests`` (N = 2, 4): every rank
  runs the same session. Under N > 1 only ``mpi``-marked tests are selected (the
  serial ones already ran in the serial pass, and some start ``mpiexec`` themselves).

Under ``LIGHTNING_DISTGRAD_TEST_WITHOUT_TORCH_RPC=1`` each of these runs on a torch whose
own RPC is unavailable, as on a torch build without it (``tests/without_torch_rpc``): this
module makes it so in its process, before anything imports torch, and puts that folder on
``PYTHONPATH``, whose ``sitecustomize`` does the same in every process the tests start (MPI
jobs, interpreters). ``tests/test_compat.py`` checks that it holds in every rank.

Rules for ``mpi`` tests (pytest-mpi does not keep ranks in step for you):

* Collection must be identical on every rank: no rank-dependent ``skipif`` or
  parametrization. ``@pytest.mark.mpi(min_size=N)`` is fine (same on all ranks).
* Collectives (``init_rpc``, ``shutdown``, barriers) must be unconditional.
* A failed ``mpi`` test under N > 1 aborts the whole job at once (see
  :func:`pytest_runtest_makereport`): otherwise the other ranks would hang or
  pair their collectives with those of a different test.

Fixtures:

* ``mpi_comm`` (session): a duplicate of ``COMM_WORLD`` for test-level collectives.
* ``rpc_session`` (session): ``rpc.init_rpc()`` once per process, ``rpc.shutdown()``
  at session end. Worker names are the default ``worker{rank}``.
* ``rpc_world`` (function): the session's :class:`RpcWorld`, with a barrier before
  and after the test, so every test starts with the previous one finished on all
  ranks. Use this one in RPC tests.
* ``rpc_stopped`` (function): the shared agent is shut down for the test (tests of
  ``init_rpc`` errors and of ``shutdown``) and started again afterwards; any agent
  the test leaves running is shut down first.
"""

from __future__ import annotations

import os
import tempfile

import pytest
from without_torch_rpc import torch_rpc_off

if torch_rpc_off.requested():
    # Here, before any test module imports torch; the processes that the tests start
    # inherit PYTHONPATH, and its sitecustomize does the same there at interpreter start.
    torch_rpc_off.install()
    _path = [str(torch_rpc_off.FOLDER), *filter(None, os.environ.get("PYTHONPATH", "").split(":"))]
    os.environ["PYTHONPATH"] = ":".join(dict.fromkeys(_path))


def _testing_mpi(config: pytest.Config) -> bool:
    return bool(config.getoption("--with-mpi", False) or config.getoption("--only-mpi", False))


def _world_size() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size()


def polite_barrier(comm) -> None:
    """``comm.Barrier()`` that sleeps instead of spinning.

    MPICH spins inside blocking calls; with more ranks than cores (4 ranks on
    2 cores here) a spinning barrier steals the CPU the slower ranks need.
    """
    from lightning_distgrad._backoff import wait_all

    wait_all(comm.Ibarrier())


# ---------------------------------------------------------------------------
# Hooks


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "job(name): the subprocess job a test checks (tests/test_rpc_process.py)"
    )
    if _testing_mpi(config) and _world_size() > 1 and "PYTEST_DEBUG_TEMPROOT" not in os.environ:
        # A temp root per rank: every rank of a session cleans up old
        # `pytest-of-<user>/pytest-N` folders at start, and ranks sharing one
        # root race on it ("rm_rf error removing ..." warnings). pytest-mpi's
        # `mpi_tmp_path` still shares rank 0's folder.
        from mpi4py import MPI

        root = os.path.join(tempfile.gettempdir(), f"pytest-mpi-rank{MPI.COMM_WORLD.Get_rank()}")
        os.makedirs(root, exist_ok=True)
        os.environ["PYTEST_DEBUG_TEMPROOT"] = root


#: Why the plain ``pytest`` pass skips the ``mpi`` tests.
MPI_SKIP_REASON = (
    "needs mpiexec: run `bash tests/run_all.sh` (serial tests, then the MPI tests on 2 and 4 ranks)"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without ``--with-mpi`` mark ``mpi`` tests skipped, saying how to run them; under
    ``mpiexec -n N`` (N > 1) select only ``mpi`` tests.

    Serial tests run in the plain ``pytest`` pass; running them on every rank
    would only repeat them N times (and the ones that start ``mpiexec`` must
    not run inside an MPI job). The same on every rank, so collection stays
    identical.
    """
    if not _testing_mpi(config):
        skip = pytest.mark.skip(reason=MPI_SKIP_REASON)
        for item in items:
            if item.get_closest_marker("mpi") is not None:
                item.add_marker(skip, append=False)  # before pytest-mpi's own skip
        return
    if _world_size() == 1:
        return
    keep, drop = [], []
    for item in items:
        (keep if item.get_closest_marker("mpi") is not None else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """In the plain ``pytest`` pass, say once how many ``mpi`` tests were skipped and why."""
    if _testing_mpi(config):
        return
    skipped = terminalreporter.stats.get("skipped", [])
    count = sum(1 for report in skipped if MPI_SKIP_REASON in str(report.longrepr))
    if count:
        terminalreporter.write_line(f"{count} multi-rank tests skipped: {MPI_SKIP_REASON}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Abort the MPI job when an ``mpi`` test fails on any rank (size > 1).

    A failure on a subset of ranks desynchronises collectives: the others hang,
    or silently pair their barrier with one from the next test and report false
    passes. Aborting at once ends the job with the failure printed (stderr).
    """
    report = yield
    if report.failed and item.get_closest_marker("mpi") is not None and _testing_mpi(item.config):
        from mpi4py import MPI

        from lightning_distgrad.rpc._transport import abort_mpi_job

        world = MPI.COMM_WORLD
        if world.Get_size() > 1:
            # Waits until mpiexec has read the failure text before the abort kills every rank.
            abort_mpi_job(
                f"\n===== rank {world.Get_rank()}/{world.Get_size()}: {item.nodeid} FAILED "
                f"during {report.when}; aborting the MPI job =====\n{report.longreprtext}\n"
            )
    return report


# ---------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="session")
def mpi_comm():
    """A duplicate of ``MPI.COMM_WORLD`` for barriers and other test collectives."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    yield comm
    comm.Free()


class RpcWorld:
    """This process's place in the RPC world of the test session."""

    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.name = f"worker{self.rank}"
        self.names = [f"worker{r}" for r in range(self.size)]
        self.running = False

    def peer(self, distance: int = 1) -> str:
        """The name of the worker ``distance`` ranks after this one (wraps around)."""
        return self.names[(self.rank + distance) % self.size]

    def peer_rank(self, distance: int = 1) -> int:
        return (self.rank + distance) % self.size

    def barrier(self) -> None:
        polite_barrier(self.comm)

    def start(self) -> None:
        from lightning_distgrad import rpc

        rpc.init_rpc()
        self.running = True

    def stop(self) -> None:
        from lightning_distgrad import rpc

        self.running = False
        rpc.shutdown()


@pytest.fixture(scope="session")
def rpc_session(mpi_comm):
    """``init_rpc()`` once per process for the whole session; ``shutdown()`` at its end."""
    world = RpcWorld(mpi_comm)
    world.start()
    yield world
    if world.running:
        world.stop()


@pytest.fixture
def rpc_world(rpc_session):
    """The running RPC world, with every rank in step at the start and end of the test."""
    assert rpc_session.running, "the shared RPC agent is not running"
    rpc_session.barrier()
    yield rpc_session
    rpc_session.barrier()


@pytest.fixture
def rpc_stopped(rpc_session):
    """No RPC agent during the test; the shared one is started again afterwards."""
    from lightning_distgrad import rpc
    from lightning_distgrad.rpc._calls import dispatch

    rpc_session.barrier()
    rpc_session.stop()
    yield rpc_session
    rpc_session.barrier()
    if dispatch.current_agent() is not None:  # the test left its own agent running
        rpc.shutdown()
    rpc_session.start()
    rpc_session.barrier()
