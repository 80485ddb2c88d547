"""Jobs whose ranks span two nodes, emulated on this machine (see ``_emulated_nodes``).

Serial tests (the plain ``pytest`` pass): each starts a 4-rank job, 2 ranks per node,
and checks how it ended. Skipped, with the reason, where the nodes cannot be emulated
(not root, no ``unshare``, no hydra ``mpiexec``, namespaces refused).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from _emulated_nodes import NODE_NAMES, mpiexec_two_nodes, node_env, skip_reason
from _job_runner import PACKAGE_ROOT, TESTS
from mpi_launch import JobResult, run_job

RANKS_PER_NODE = 2
WORLD = RANKS_PER_NODE * len(NODE_NAMES)
#: A hung job is killed after this long (the suite job ends in about 40 s when idle).
NODE_FACTS_TIMEOUT_S = 150
SUITE_TIMEOUT_S = 240
#: The MPI tests that run with their ranks split across the nodes: RPC, RRefs,
#: distributed autograd, the distributed optimizer and Lightning's fit.
SUITE = (
    "test_rpc_api.py",
    "test_rref.py",
    "test_dist_autograd_backward.py",
    "test_dist_optim.py",
    "test_lightning_strategy.py",
)


@pytest.fixture(autouse=True)
def emulated_nodes() -> None:
    """Skip, saying why, where two nodes cannot be emulated (probed once, at first use:
    never while collecting, which every rank of an MPI pass does)."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)


def run_on_two_nodes(
    tmp_path: Path, *command: str, timeout_s: float, per_rank_output: bool = False
) -> JobResult:
    """Run ``python command...`` on both nodes; with ``per_rank_output`` each rank's
    output goes to ``tmp_path/rank<r>.out`` instead of the job's output."""
    pattern = str(tmp_path / "rank%r.out") if per_rank_output else None
    # A temp folder per job: pytest sessions inside it must not race over a shared one.
    env = node_env({"TMPDIR": str(tmp_path), "MPIEXEC_TIMEOUT": str(int(timeout_s) - 5)})
    argv = mpiexec_two_nodes(
        RANKS_PER_NODE, sys.executable, "-m", "mpi4py", *command, output_pattern=pattern
    )
    return run_job(argv, timeout_s=timeout_s, cwd=PACKAGE_ROOT, env=env)


def rank_outputs(folder: Path) -> list[str]:
    """Each rank's output, by rank (see ``per_rank_output``)."""
    files = [folder / f"rank{r}.out" for r in range(WORLD)]
    return [p.read_text() if p.exists() else "<no output>" for p in files]


def describe(result: JobResult, outputs: list[str]) -> str:
    ranks = "\n".join(f"----- rank {r} -----\n{t[-6000:]}" for r, t in enumerate(outputs))
    return f"{result.describe()}\n{ranks}"


def node_facts(outputs: list[str]) -> list[dict]:
    """Each rank's facts from ``jobs/node_local.py``, by rank."""
    facts = []
    for rank, text in enumerate(outputs):
        lines = [ln for ln in text.splitlines() if ln.startswith("NODE_FACTS ")]
        assert len(lines) == 1, f"rank {rank}:\n{text}"
        facts.append(json.loads(lines[0].split(" ", 1)[1]))
    assert [f["rank"] for f in facts] == list(range(WORLD)), facts
    return facts


def test_node_local_mechanisms_work_per_node(tmp_path):
    result = run_on_two_nodes(
        tmp_path,
        str(TESTS / "jobs" / "node_local.py"),
        timeout_s=NODE_FACTS_TIMEOUT_S,
        per_rank_output=True,
    )
    outputs = rank_outputs(tmp_path)
    assert result.code == 0, describe(result, outputs)
    facts = node_facts(outputs)
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


def test_rpc_autograd_optimizer_and_fit_tests_pass_across_nodes(tmp_path):
    files = [str(Path("tests") / name) for name in SUITE]
    result = run_on_two_nodes(
        tmp_path,
        "-m",
        "pytest",
        "--with-mpi",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "faulthandler_timeout=120",
        *files,
        timeout_s=SUITE_TIMEOUT_S,
        per_rank_output=True,
    )
    texts = rank_outputs(tmp_path)
    report = describe(result, texts)
    assert result.code == 0, report
    passed = []
    for rank, text in enumerate(texts):
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
