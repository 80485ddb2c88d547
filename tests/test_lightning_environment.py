"""Tests for ``MPIClusterEnvironment``.

Serial tests run every rank of a pretend launch as a thread over ``FakeComm``, whose collectives
meet at a barrier, so multi-host layouts and per-rank Slurm variables can be checked without MPI.
One test marked ``mpi`` checks the real values under ``mpiexec -n N``.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
from _timing import scaled
from lightning.fabric.plugins.environments import ClusterEnvironment
from mpi4py import MPI

import lightning_distgrad.lightning.environment as environment_module
from lightning_distgrad.lightning import MPIClusterEnvironment

# --- A fake communicator: one thread per rank ----------------------------------------------------


class _FakeGroup:
    """What the ranks of one fake communicator share: a barrier and one slot per rank."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=scaled(10))
        self.slots: list[Any] = [None] * size
        self.children: dict[tuple[int, tuple[int, ...]], _FakeGroup] = {}
        self.lock = threading.Lock()


class FakeComm:
    """The part of ``MPI.Comm`` the environment uses. ``hosts[r]`` is where rank ``r`` runs."""

    def __init__(self, group: _FakeGroup, rank: int, hosts: Sequence[str]) -> None:
        self._group, self._rank, self._hosts = group, rank, list(hosts)
        self.calls: list[str] = []
        self.freed = False
        self._splits = 0

    def Get_rank(self) -> int:
        return self._rank

    def Get_size(self) -> int:
        return len(self._hosts)

    def allgather(self, obj: Any) -> list[Any]:
        self.calls.append("allgather")
        return self._exchange(obj, root=None)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        self.calls.append("bcast")
        return self._exchange(obj, root=root)

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        self.calls.append("gather")
        everyone = self._exchange(obj, root=None)
        return everyone if self._rank == root else None

    def Split_type(self, split_type: int, key: int = 0, info: Any = None) -> FakeComm:
        assert split_type == MPI.COMM_TYPE_SHARED
        self.calls.append("Split_type")
        keys = self._exchange((self._hosts[self._rank], key), root=None)
        host = self._hosts[self._rank]
        members = sorted((r for r in range(len(keys)) if keys[r][0] == host), key=lambda r: keys[r])
        with self._group.lock:
            child = self._group.children.setdefault(
                (self._splits, tuple(members)), _FakeGroup(len(members))
            )
        self._splits += 1
        return FakeComm(child, members.index(self._rank), [host] * len(members))

    def Free(self) -> None:
        self.freed = True

    def _exchange(self, obj: Any, root: int | None) -> Any:
        if root is None or root == self._rank:
            self._group.slots[self._rank] = obj
        self._group.barrier.wait()
        result = list(self._group.slots) if root is None else self._group.slots[root]
        self._group.barrier.wait()
        return result


_thread_host = threading.local()


def run_ranks(hosts: Sequence[str], fn: Callable[[MPIClusterEnvironment, int], Any]) -> list[Any]:
    """Run ``fn(env, rank)`` for every rank in its own thread; return results or exceptions."""
    group = _FakeGroup(len(hosts))
    results: list[Any] = [None] * len(hosts)

    def rank_main(rank: int) -> None:
        _thread_host.name = hosts[rank]
        try:
            results[rank] = fn(MPIClusterEnvironment(FakeComm(group, rank, hosts)), rank)
        except BaseException as exc:  # reported to the test, never swallowed
            results[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(hosts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=scaled(30))
    assert not any(thread.is_alive() for thread in threads), "a fake rank hung"
    assert not any(isinstance(r, threading.BrokenBarrierError) for r in results), results
    return results


def values(results: list[Any]) -> list[Any]:
    """The results, re-raising the first exception a rank raised."""
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def raised(results: list[Any], kind: type[BaseException]) -> str:
    """Check every rank raised ``kind`` with one and the same message; return the message."""
    assert all(isinstance(r, kind) for r in results), results
    messages = {str(r) for r in results}
    assert len(messages) == 1, messages
    return messages.pop()


@pytest.fixture(autouse=True)
def no_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hide the Slurm variables of a CI job that runs these tests inside an allocation."""
    for name in [name for name in os.environ if name.startswith("SLURM_")]:
        monkeypatch.delenv(name)


@pytest.fixture
def thread_hostnames(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``socket.gethostname()`` return the fake host of the calling rank's thread."""
    monkeypatch.setattr(socket, "gethostname", lambda: _thread_host.name)


# --- Ranks, nodes and sizes ----------------------------------------------------------------------


def layout(env: MPIClusterEnvironment, rank: int) -> tuple[int, int, int, int, int, int]:
    return (
        env.global_rank(),
        env.world_size(),
        env.local_rank(),
        env.node_rank(),
        env.num_nodes,
        env.local_world_size,
    )


def test_two_ranks_on_one_host_have_distinct_local_ranks():
    assert values(run_ranks(["a", "a"], layout)) == [(0, 2, 0, 0, 1, 2), (1, 2, 1, 0, 1, 2)]


def test_four_ranks_on_two_hosts_in_blocks():
    assert values(run_ranks(["a", "a", "b", "b"], layout)) == [
        (0, 4, 0, 0, 2, 2),
        (1, 4, 1, 0, 2, 2),
        (2, 4, 0, 1, 2, 2),
        (3, 4, 1, 1, 2, 2),
    ]


def test_four_ranks_on_two_hosts_interleaved():
    assert values(run_ranks(["a", "b", "a", "b"], layout)) == [
        (0, 4, 0, 0, 2, 2),
        (1, 4, 0, 1, 2, 2),
        (2, 4, 1, 0, 2, 2),
        (3, 4, 1, 1, 2, 2),
    ]


def test_node_rank_follows_lowest_global_rank_not_hostname_order():
    # Lightning's MPIEnvironment sorts hostnames and would put host "a" first.
    results = values(run_ranks(["z", "a", "z", "m"], lambda env, rank: env.node_rank()))
    assert results == [0, 1, 0, 2]


def test_uneven_hosts_report_their_own_local_world_size():
    results = values(run_ranks(["a", "a", "b"], layout))
    assert [r[5] for r in results] == [2, 2, 1]
    assert [r[2] for r in results] == [0, 1, 0]
    assert {r[4] for r in results} == {2}


def test_single_rank_is_rank_zero_of_one_node():
    assert values(run_ranks(["a"], layout)) == [(0, 1, 0, 0, 1, 1)]


def test_layout_is_computed_once_and_node_comm_is_freed():
    def probe(env: MPIClusterEnvironment, rank: int) -> tuple[list[str], bool]:
        comm = env.world_comm()
        split = comm.Split_type
        children: list[FakeComm] = []

        def recording_split(*args: Any, **kwargs: Any) -> FakeComm:
            children.append(split(*args, **kwargs))
            return children[-1]

        comm.Split_type = recording_split
        for _ in range(3):
            env.local_rank(), env.node_rank(), env.num_nodes, env.local_world_size
        return list(comm.calls), all(child.freed for child in children) and len(children) == 1

    for calls, freed in values(run_ranks(["a", "b"], probe)):
        assert calls == ["Split_type", "allgather"]
        assert freed


def test_construction_and_world_facts_do_not_communicate():
    def probe(env: MPIClusterEnvironment, rank: int) -> list[str]:
        env.world_size(), env.global_rank(), env.creates_processes_externally
        env.set_world_size(7), env.set_global_rank(7), env.teardown()
        return env.world_comm().calls

    assert values(run_ranks(["a", "b"], probe)) == [[], []]


def test_is_a_cluster_environment_that_creates_processes_externally():
    env = MPIClusterEnvironment(FakeComm(_FakeGroup(1), 0, ["a"]))
    assert isinstance(env, ClusterEnvironment)
    assert env.creates_processes_externally is True


def test_default_communicator_is_comm_world():
    env = MPIClusterEnvironment()
    assert env.world_comm() is MPI.COMM_WORLD
    assert (env.global_rank(), env.world_size()) == (
        MPI.COMM_WORLD.Get_rank(),
        MPI.COMM_WORLD.Get_size(),
    )


def test_setters_are_ignored_and_logged(caplog: pytest.LogCaptureFixture):
    env = MPIClusterEnvironment(FakeComm(_FakeGroup(1), 0, ["a"]))
    with caplog.at_level(logging.DEBUG, logger=environment_module.__name__):
        env.set_world_size(4)
        env.set_global_rank(3)
    assert (env.world_size(), env.global_rank()) == (1, 0)
    assert "setting world size is not allowed. Ignored." in caplog.text
    assert "setting global rank is not allowed. Ignored." in caplog.text


def test_teardown_keeps_cached_values():
    def probe(env: MPIClusterEnvironment, rank: int) -> tuple[Any, ...]:
        before = layout(env, rank) + (env.main_address, env.main_port)
        env.teardown()
        calls = len(env.world_comm().calls)
        after = layout(env, rank) + (env.main_address, env.main_port)
        return before == after, calls == len(env.world_comm().calls)

    assert values(run_ranks(["a", "b"], probe)) == [(True, True), (True, True)]


# --- Main address and port -----------------------------------------------------------------------


@pytest.mark.usefixtures("thread_hostnames")
def test_main_address_is_rank_zero_hostname_on_every_rank_and_cached():
    def probe(env: MPIClusterEnvironment, rank: int) -> tuple[str, str, int]:
        return env.main_address, env.main_address, env.world_comm().calls.count("bcast")

    assert values(run_ranks(["n7", "n3", "n3"], probe)) == [("n7", "n7", 1)] * 3


def test_main_port_is_found_on_rank_zero_only_and_broadcast(monkeypatch: pytest.MonkeyPatch):
    found: list[str] = []

    def fake_port() -> int:
        found.append(threading.current_thread().name)
        return 31337

    monkeypatch.setattr(environment_module, "find_free_network_port", fake_port)
    results = values(run_ranks(["a", "b"], lambda env, rank: (env.main_port, env.main_port)))
    assert results == [(31337, 31337)] * 2
    assert len(found) == 1


# --- detect() ------------------------------------------------------------------------------------


def test_detect_returns_a_bool_without_raising():
    assert MPIClusterEnvironment.detect() is (MPI.COMM_WORLD.Get_size() > 1)


def test_detect_is_false_without_mpi4py(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    assert MPIClusterEnvironment.detect() is False


def test_detect_is_false_when_mpi_fails(monkeypatch: pytest.MonkeyPatch):
    class Broken:
        def Get_size(self) -> int:
            raise RuntimeError("MPI_Init failed")

    monkeypatch.setattr(MPI, "COMM_WORLD", Broken())
    assert MPIClusterEnvironment.detect() is False


# --- validate_settings ---------------------------------------------------------------------------


def validate(num_devices: int, num_nodes: int) -> Callable[[MPIClusterEnvironment, int], None]:
    return lambda env, rank: env.validate_settings(num_devices, num_nodes)


def test_validate_settings_accepts_the_launch():
    assert values(run_ranks(["a", "a", "b", "b"], validate(2, 2))) == [None] * 4


def test_validate_settings_rejects_more_devices_than_ranks_on_the_node():
    message = raised(run_ranks(["a", "a"], validate(4, 1)), ValueError)
    assert message == (
        "You set `devices=4`, but mpiexec started 2 ranks on this node. HINT: set `devices=2` or"
        " launch with `mpiexec -n 4 ...` (or `srun --ntasks-per-node=4`)."
    )


def test_validate_settings_rejects_devices_on_every_node():
    message = raised(run_ranks(["a", "b", "a", "b"], validate(1, 2)), ValueError)
    assert message.startswith(
        "You set `devices=1`, but mpiexec started 2 ranks on each of the 2 nodes. HINT: set"
        " `devices=2` or launch with `mpiexec -n 2 -ppn 1 ...`"
    )


def test_validate_settings_rejects_uneven_nodes_on_every_rank():
    message = raised(run_ranks(["a", "a", "b"], validate(2, 2)), ValueError)
    assert "uneven number of ranks per node (node 0: 2, node 1: 1)" in message
    assert "HINT: start the same number of ranks on every node" in message


def test_validate_settings_rejects_wrong_num_nodes():
    message = raised(run_ranks(["a", "b"], validate(1, 1)), ValueError)
    assert message.startswith(
        "You set `num_nodes=1`, but mpiexec started ranks on 2 nodes. HINT: set `num_nodes=2`"
    )


# --- Slurm cross-check ---------------------------------------------------------------------------


def check_slurm(
    environs: Sequence[Mapping[str, str]] | None = None,
) -> Callable[[MPIClusterEnvironment, int], None]:
    """Check with each rank's own variables, or with ``os.environ`` when ``environs`` is None."""
    if environs is None:
        return lambda env, rank: env.check_slurm_consistency()
    return lambda env, rank: env.check_slurm_consistency(environs[rank])


def srun_env(
    hosts: Sequence[str], *, ntasks: int | None = None, nnodes: int | None = None
) -> list[dict[str, str]]:
    """What srun tells each task when it places rank ``r`` on ``hosts[r]``."""
    localids = [hosts[:r].count(host) for r, host in enumerate(hosts)]
    return [
        {
            "SLURM_NTASKS": str(len(hosts) if ntasks is None else ntasks),
            "SLURM_PROCID": str(r),
            "SLURM_LOCALID": str(localids[r]),
            "SLURM_NNODES": str(len(set(hosts)) if nnodes is None else nnodes),
        }
        for r in range(len(hosts))
    ]


def test_slurm_check_gathers_the_variables_on_rank_zero_alone():
    # Only rank 0 receives every rank's variables; the others receive its verdict.
    hosts = ["a", "a", "b", "b"]
    environs = srun_env(hosts)

    def probe(env: MPIClusterEnvironment, rank: int) -> list[str]:
        env.check_slurm_consistency(environs[rank])
        return env.world_comm().calls

    for calls in values(run_ranks(hosts, probe)):
        assert calls.count("gather") == 1 and calls.count("bcast") == 1
        assert calls.count("allgather") == 1  # the layout's node leaders, 8 bytes a rank


def test_slurm_check_passes_outside_slurm():
    assert values(run_ranks(["a", "a"], check_slurm())) == [None, None]


def test_slurm_check_passes_when_srun_and_mpi_agree():
    hosts = ["a", "b", "a", "b"]
    assert values(run_ranks(hosts, check_slurm(srun_env(hosts)))) == [None] * 4


def test_slurm_check_passes_for_a_single_task(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert values(run_ranks(["a"], check_slurm())) == [None]


def test_slurm_check_passes_for_mpiexec_inside_an_allocation(monkeypatch: pytest.MonkeyPatch):
    # mpiexec forwards the batch step's variables: every rank reads SLURM_PROCID=0.
    for name, value in {"SLURM_NTASKS": "8", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}.items():
        monkeypatch.setenv(name, value)
    assert values(run_ranks(["a", "a", "b", "b"], check_slurm())) == [None] * 4


@pytest.mark.parametrize("variable", ["SLURM_NTASKS", "SLURM_NPROCS"])
def test_slurm_check_rejects_srun_without_mpi_plugin(
    monkeypatch: pytest.MonkeyPatch, variable: str
):
    monkeypatch.setenv(variable, "4")
    monkeypatch.setenv("SLURM_PROCID", "2")
    message = raised(run_ranks(["a"], check_slurm()), RuntimeError)
    assert message.startswith(
        f"srun started 4 tasks but each sees an MPI world of size 1 (Slurm: {variable}=4,"
        " SLURM_PROCID=2; MPI: rank 0 of 1). Likely cause: srun ran without an MPI plugin"
    )
    assert "HINT: launch with `srun --mpi=pmix` (or `--mpi=pmi2`" in message
    assert "or with `mpiexec -n 4 python train.py`" in message


def test_slurm_check_rejects_python_run_directly_under_sbatch(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SLURM_NTASKS", "2")
    message = raised(run_ranks(["a"], check_slurm()), RuntimeError)
    assert message.startswith("srun started 2 tasks but each sees an MPI world of size 1")
    assert "directly in the sbatch/salloc shell" in message


def test_slurm_check_rejects_more_tasks_than_mpi_ranks():
    # srun -n 4 whose tasks formed two MPI worlds of two: this world holds tasks 0 and 1.
    message = raised(run_ranks(["a", "a"], check_slurm(srun_env("aa", ntasks=4))), RuntimeError)
    assert message.startswith(
        "srun started 4 tasks (SLURM_NTASKS=4) but the MPI world has 2 ranks. Likely cause:"
    )
    assert "HINT: launch once" in message


def test_slurm_check_rejects_different_rank_numbering():
    environs = srun_env(["a", "a"])
    environs[0]["SLURM_PROCID"], environs[1]["SLURM_PROCID"] = "1", "0"
    message = raised(run_ranks(["a", "a"], check_slurm(environs)), RuntimeError)
    assert message.startswith(
        "Slurm and MPI number the tasks differently on 2 of 2 ranks (MPI rank 0 has"
        " SLURM_PROCID=1, MPI rank 1 has SLURM_PROCID=0). Likely cause:"
    )
    assert "HINT: build MPIClusterEnvironment on `MPI.COMM_WORLD`" in message


def test_slurm_check_rejects_tasks_split_into_more_nodes_than_slurm_placed():
    # Slurm put all four tasks on one host; MPI sees two shared-memory groups (two containers).
    hosts = ["a", "a", "b", "b"]
    environs = srun_env(["a"] * 4)
    message = raised(run_ranks(hosts, check_slurm(environs)), RuntimeError)
    assert message.startswith(
        "Slurm placed the tasks on 1 nodes (SLURM_NNODES=1) but MPI groups the ranks into 2"
        " nodes of ranks that share memory. Likely cause: tasks on one host run in separate"
        " containers"
    )
    assert "HINT: run all tasks of a host in one container" in message


def test_slurm_check_prefers_step_node_count_over_allocation(monkeypatch: pytest.MonkeyPatch):
    environs = srun_env(["a", "a"], nnodes=3)  # SLURM_NNODES counts the allocation ...
    for environ in environs:
        environ["SLURM_STEP_NUM_NODES"] = "1"  # ... the step runs on one node
    assert values(run_ranks(["a", "a"], check_slurm(environs))) == [None, None]
    message = raised(run_ranks(["a", "a"], check_slurm(srun_env("aa", nnodes=3))), RuntimeError)
    assert "(SLURM_NNODES=3) but MPI groups the ranks into 1 node " in message
    assert "counts the whole allocation rather than this job step" in message


def test_slurm_check_rejects_local_rank_mismatch():
    environs = srun_env(["a", "b", "a", "b"])
    environs[2]["SLURM_LOCALID"] = "0"
    message = raised(run_ranks(["a", "b", "a", "b"], check_slurm(environs)), RuntimeError)
    assert message.startswith(
        "Slurm and MPI disagree on local ranks on 1 of 4 ranks (MPI rank 2 is local rank 1 but"
        " has SLURM_LOCALID=0). Likely cause:"
    )
    assert "HINT:" in message


def test_slurm_check_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SLURM_NPROCS", "3")
    with pytest.raises(RuntimeError, match="srun started 3 tasks"):
        MPIClusterEnvironment(FakeComm(_FakeGroup(1), 0, ["a"])).check_slurm_consistency()


# --- Under mpiexec -------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_real_values_under_mpiexec():
    comm = MPI.COMM_WORLD
    env = MPIClusterEnvironment()
    # Every collective runs unconditionally on every rank; asserts come last.
    env.check_slurm_consistency(environ={})
    env.check_slurm_consistency(environ={"SLURM_NTASKS": "2", "SLURM_PROCID": "0"})
    env.check_slurm_consistency(
        environ={
            "SLURM_NTASKS": str(comm.Get_size()),
            "SLURM_PROCID": str(comm.Get_rank()),
            "SLURM_LOCALID": str(comm.Get_rank()),
            "SLURM_NNODES": "1",
        }
    )
    mine = (
        env.global_rank(),
        env.local_rank(),
        env.node_rank(),
        env.num_nodes,
        env.local_world_size,
        env.world_size(),
        env.main_address,
        env.main_port,
    )
    everyone = comm.allgather(mine)
    size = comm.Get_size()
    with pytest.raises(ValueError, match=f"mpiexec started {size} ranks on this node"):
        env.validate_settings(num_devices=size + 1, num_nodes=1)
    env.validate_settings(num_devices=size, num_nodes=1)

    assert MPIClusterEnvironment.detect() is True
    assert sorted(r[0] for r in everyone) == list(range(size))
    assert mine[0] == comm.Get_rank()
    assert [r[1] for r in everyone] == list(range(size))  # one host: local rank == global rank
    assert {r[2:6] for r in everyone} == {(0, 1, size, size)}
    assert len({r[6] for r in everyone}) == 1
    if comm.Get_rank() == 0:
        assert mine[6] == socket.gethostname()
    assert len({r[7] for r in everyone}) == 1
