"""Jobs whose ranks span two nodes, emulated on this machine (see ``_emulated_nodes``).

Serial tests (the plain ``pytest`` pass). One 4-rank job, 2 ranks per node, serves them
all (``jobs/two_nodes.py``): each rank reports what it sees of its node, then the MPI tests
of :data:`SUITE` run across the nodes. Skipped, with the reason, where the nodes cannot be
emulated (not root, no ``unshare``, no hydra ``mpiexec``, namespaces refused).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from _emulated_nodes import NODE_NAMES, mpiexec_two_nodes, node_env, skip_reason
from _job_runner import PACKAGE_ROOT, TESTS
from _timing import scaled
from mpi_launch import JobResult, run_job

RANKS_PER_NODE = 2
WORLD = RANKS_PER_NODE * len(NODE_NAMES)
#: A hung job is killed after this long (it ends in about 40 s when idle).
JOB_TIMEOUT_S = scaled(300)
#: The MPI tests that run with their ranks split across the nodes: RPC, RRefs,
#: distributed autograd, the distributed optimizer and Lightning's fit.
SUITE = (
    "test_rpc_api.py",
    "test_rref.py",
    "test_dist_autograd_backward.py",
    "test_dist_optim.py",
    "test_lightning_strategy.py",
)


class TwoNodeJob:
    """How the job ended, and each rank's output, by rank."""

    def __init__(self, result: JobResult, outputs: list[str]):
        self.result = result
        self.outputs = outputs

    def describe(self) -> str:
        ranks = "\n".join(f"----- rank {r} -----\n{t[-6000:]}" for r, t in enumerate(self.outputs))
        return f"{self.result.describe()}\n{ranks}"


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> TwoNodeJob:
    """The job, run once for the module; skipped, saying why, where two nodes cannot be
    emulated (probed at first use: never while collecting, which every rank of an MPI pass
    does)."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp("two_nodes")
    # A temp folder of its own: pytest sessions inside it must not race over a shared one.
    # Each rank's output goes to a file of its own.
    env = node_env({"TMPDIR": str(folder), "MPIEXEC_TIMEOUT": str(int(JOB_TIMEOUT_S) - 5)})
    pytest_args = ["--with-mpi", "-q", "-p", "no:cacheprovider"]
    pytest_args += ["-o", f"faulthandler_timeout={scaled(120):.0f}"]
    pytest_args += [str(Path("tests") / name) for name in SUITE]
    script = str(TESTS / "jobs" / "two_nodes.py")
    argv = mpiexec_two_nodes(
        RANKS_PER_NODE,
        *(sys.executable, "-m", "mpi4py", script, *pytest_args),
        output_pattern=str(folder / "rank%r.out"),
    )
    result = run_job(argv, timeout_s=JOB_TIMEOUT_S, cwd=PACKAGE_ROOT, env=env)
    files = [folder / f"rank{r}.out" for r in range(WORLD)]
    return TwoNodeJob(result, [p.read_text() if p.exists() else "<no output>" for p in files])


def node_facts(job: TwoNodeJob) -> list[dict]:
    """Each rank's facts from ``jobs/node_local.py``, by rank."""
    facts = []
    for rank, text in enumerate(job.outputs):
        lines = [ln for ln in text.splitlines() if ln.startswith("NODE_FACTS ")]
        assert len(lines) == 1, f"rank {rank}: no node facts\n{job.describe()}"
        facts.append(json.loads(lines[0].split(" ", 1)[1]))
    assert [f["rank"] for f in facts] == list(range(WORLD)), facts
    return facts


def test_node_local_mechanisms_work_per_node(job):
    facts = node_facts(job)
    for f in facts:
        rank, node = f["rank"], f["rank"] // RANKS_PER_NODE
        same_node = [r for r in range(WORLD) if r // RANKS_PER_NODE == node]
        others = [r for r in same_node if r != rank]
        why = f"rank {rank}: {f}"
        # Each node is its own shared-memory domain with its own /dev/shm.
        assert f["host"] == NODE_NAMES[node], why
        assert f["node_size"] == RANKS_PER_NODE and f["node_ranks"] == same_node, why
        assert f["markers_seen"] == [f"node-marker-{same_node[0]}"], why
        # The doorbell knows only the peers of its node, and rings only them, only armed.
        assert f["bell_peers"] == others and f["agent_bell_peers"] == others, why
        assert f["has_board"] and f["agent_has_board"], why
        assert f["rings_armed"] == len(others) and f["rings_disarmed"] == 0, why
        # Nap boards are unlinked once every agent of the node mapped them.
        for key in (
            "boards_after_setup",
            "boards_after_close",
            "boards_with_rpc",
            "boards_after_rpc",
        ):
            assert f[key] == [], f"{key}: {why}"
        # The cluster environment's layout.
        assert (
            f["local_rank"],
            f["node_rank"],
            f["world_size"],
            f["local_world_size"],
            f["num_nodes"],
        ) == (rank % RANKS_PER_NODE, node, WORLD, RANKS_PER_NODE, 2), why
        assert f["main_address"] == NODE_NAMES[0], why
        # Local rank -> GPU: trainers of a node count from cuda:0; a serving rank gets none.
        assert f["gpu"] == f"cuda:{rank % RANKS_PER_NODE}", why
        expected = "cpu" if rank == 0 else f"cuda:{same_node.index(rank) - (node == 0)}"
        assert f["gpu_with_server_0"] == expected, why
        assert f["peer_hosts"] == [NODE_NAMES[r // RANKS_PER_NODE] for r in range(WORLD)], why
        # Big tensors: written into the memory of the node's other ranks, sent by MPI to
        # the other node's; either way they arrive exactly.
        assert f["writes_directly"] == others and all(f["big_tensors_echoed"]), why
    # One nap board per node, under a token of its own.
    boards = {f["board_path"] for f in facts}
    assert len(boards) == len(NODE_NAMES), facts


def test_rpc_autograd_optimizer_and_fit_tests_pass_across_nodes(job):
    report = job.describe()
    assert job.result.code == 0, report
    passed = []
    for rank, text in enumerate(job.outputs):
        counts = summary_counts(text)
        assert counts.get("passed", 0) > 0 and not counts.keys() & {"failed", "error", "errors"}, (
            f"rank {rank}: {counts}\n{report}"
        )
        passed.append(counts["passed"])
    assert len(set(passed)) == 1, f"ranks passed different numbers of tests: {passed}\n{report}"


def summary_counts(output: str) -> dict[str, int]:
    """The counts of pytest's final summary line ("151 passed, 1 xfailed in 33.95s")."""
    lines = output.strip().splitlines()
    return {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", lines[-1] if lines else "")}
