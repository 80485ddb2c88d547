"""The example programs of the design documents train what a single process would.

Each example in ``examples/`` comes with a ``reference`` function: the same model, data and
seeds trained on one process with plain ``torch.autograd`` and ``torch.optim``. Two kinds of
tests compare the distributed training with it (parameters within 1e-5) and check that the
loss goes down:

* serial tests (the plain ``pytest`` pass) run each example as its users do, as a whole
  ``mpiexec -n K python -m mpi4py examples/<name>.py`` job (K = 2, 3, 4) with short settings
  and ``--dump``, and read the dump;
* ``mpi`` tests run the examples' training functions inside the test session's RPC world
  (``worker{rank}`` names): the 2-worker example on >= 2 ranks, the parameter server on >= 3
  (the last rank serves), the DDP + RPC hybrid with ReplicatedModule on >= 4 (ranks 0, 1
  train, 2 is the master, 3 the server), in lockstep and as the tutorial schedules it (the
  whole job runs it with torch's DDP, as the tutorial is written; more: ``tests/test_ddp.py``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from _job_runner import LAUNCHER, mpi_job
from _timing import scaled

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
if str(EXAMPLES) not in sys.path:
    # Imported under the same names on every rank, so their functions travel by reference.
    sys.path.insert(0, str(EXAMPLES))

import ddp_rpc  # noqa: E402
import dist_autograd_simple  # noqa: E402
import parameter_server  # noqa: E402

#: A whole example job on a busy 2-core machine: startup of K Python processes and training.
JOB_TIMEOUT_S = scaled(420)
ATOL = 1e-5
needs_mpiexec = pytest.mark.skipif(LAUNCHER is None, reason="no MPI launcher found")


# ---------------------------------------------------------------------------
# Helpers


def assert_params_close(got: dict, expected: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(expected), f"{what}: parameter names differ"
    for name, value in expected.items():
        actual = got[name] if isinstance(got[name], torch.Tensor) else torch.tensor(got[name])
        torch.testing.assert_close(
            actual, value, atol=ATOL, rtol=0, msg=lambda m, n=name: f"{what}: {n}: {m}"
        )


def assert_losses_close(got: list[float], expected: list[float], what: str) -> None:
    assert len(got) == len(expected), f"{what}: {len(got)} losses, expected {len(expected)}"
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64),
        torch.tensor(expected, dtype=torch.float64),
        atol=ATOL,
        rtol=1e-5,
        msg=lambda m: f"{what} losses: {m}",
    )


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def run_example(tmp_path: Path, ranks: int, script: str, *flags: str) -> tuple[dict, str]:
    """``mpiexec -n ranks python -m mpi4py examples/script flags --dump F``; the dump and output.

    A hung job is ended after ``JOB_TIMEOUT_S`` (see :func:`_job_runner.mpi_job`).
    """
    dump = tmp_path / "dump.json"
    argv = [sys.executable, "-m", "mpi4py", str(EXAMPLES / script), *flags, "--dump", str(dump)]
    result = mpi_job(ranks, argv, JOB_TIMEOUT_S, cwd=REPO)
    assert result.code == 0, result.describe()
    assert "Traceback" not in result.output, result.describe()
    return json.loads(dump.read_text()), result.output


# ---------------------------------------------------------------------------
# Serial: each example as a whole job


@needs_mpiexec
def test_dist_autograd_simple_job_matches_single_process(tmp_path):
    steps = 12
    dump, out = run_example(tmp_path, 2, "dist_autograd_simple.py", "--steps", str(steps))
    assert len(dump["ranks"]) == 2
    for rank, result in enumerate(dump["ranks"]):
        ref = dist_autograd_simple.reference(rank, steps)
        assert_params_close(result["params"], ref["params"], f"worker{rank}")
        assert_losses_close(result["losses"], ref["losses"], f"worker{rank}")
        assert result["losses"][-1] < 0.2 * result["losses"][0], result["losses"]
        assert f"worker{rank} step {steps - 1:3d} loss" in out, out


@needs_mpiexec
def test_parameter_server_job_matches_single_process(tmp_path):
    steps = 25
    dump, out = run_example(tmp_path, 3, "parameter_server.py", "--steps", str(steps))
    ref = parameter_server.reference(2, steps)
    assert_params_close(dump["params"], ref["params"], "ps")
    for t in range(2):
        losses = dump["losses"][t]
        assert_losses_close(losses, ref["losses"][t], f"trainer{t}")
        assert mean(losses[-5:]) < 0.5 * mean(losses[:5]), losses
        assert f"trainer{t} step {steps - 1:4d} loss" in out, out


@needs_mpiexec
def test_ddp_rpc_job_with_torch_ddp_matches_single_process(tmp_path):
    # The tutorial as written: the dense layer in torch's DistributedDataParallel over a gloo
    # process group of the two trainers, beside RPC; 5 steps.
    batches = 5
    flags = ("--epochs", "1", "--batches-per-epoch", str(batches))
    dump, out = run_example(tmp_path, 4, "ddp_rpc.py", *flags)
    ref = ddp_rpc.reference(1, batches)
    assert dump["equal_each_step"] == [True] * batches, "the trainers' dense layers differ"
    assert dump["fc_equal"], "the trainers' dense layers differ"
    assert_params_close(dump["params"], ref["params"], "ddp_rpc")
    for t in range(2):
        assert_losses_close(dump["losses"][t], ref["losses"][t], f"trainer{t}")
    assert "master: identical after every step: True" in out, out


def test_references_train():
    # The references themselves: the loss goes down (the jobs are compared with them).
    simple = dist_autograd_simple.reference(0, 30)
    assert simple["losses"][-1] < 1e-3 * simple["losses"][0]
    ps = parameter_server.reference(2, 60)
    assert all(mean(ls[-10:]) < 0.2 * mean(ls[:10]) for ls in ps["losses"])
    hybrid = ddp_rpc.reference(epochs=3)
    assert all(mean(ls[-10:]) < mean(ls[:10]) - 0.2 for ls in hybrid["losses"])


# ---------------------------------------------------------------------------
# MPI: the training functions inside the test session


@pytest.mark.mpi(min_size=2)
def test_dist_autograd_simple_in_session(rpc_world):
    steps = 8
    result = dist_autograd_simple.train(steps, verbose=False)  # remote tensors on the next rank
    ref = dist_autograd_simple.reference(rpc_world.rank, steps)
    assert_params_close(result["params"], ref["params"], rpc_world.name)
    assert_losses_close(result["losses"], ref["losses"], rpc_world.name)
    assert result["losses"][-1] < result["losses"][0]
    rpc_world.barrier()  # the next rank still reads the tensors this rank owns


@pytest.mark.mpi(min_size=3)
def test_parameter_server_in_session(rpc_world):
    from mpi4py import MPI

    steps, seed = 10, 7
    is_trainer = rpc_world.rank < rpc_world.size - 1
    trainers = rpc_world.comm.Split(0 if is_trainer else MPI.UNDEFINED, rpc_world.rank)
    if is_trainer:
        result = parameter_server.train(
            trainers, steps, seed=seed, ps=rpc_world.names[-1], verbose=False
        )
        ref = parameter_server.reference(rpc_world.size - 1, steps, seed=seed)
        me = trainers.Get_rank()
        trainers.Free()
        assert_params_close(result["params"], ref["params"], f"trainer {me}")
        assert_losses_close(result["losses"], ref["losses"][me], f"trainer {me}")
        assert mean(result["losses"][-3:]) < mean(result["losses"][:3])


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("lockstep", [True, False], ids=["lockstep", "no-lockstep"])
def test_ddp_rpc_in_session(rpc_world, lockstep):
    # With ReplicatedModule (torch's DDP in a session: tests/test_ddp.py); without lockstep,
    # as the tutorial schedules it, the table updates land whenever they land: the trainers'
    # dense layers still agree and the loss goes down, but the run is not reproducible.
    from mpi4py import MPI

    epochs, batches = (2, 5) if lockstep else (3, 10)
    rank = rpc_world.rank
    trainers = rpc_world.comm.Split(0 if rank in ddp_rpc.TRAINERS else MPI.UNDEFINED, rank)
    if rank in ddp_rpc.TRAINERS:
        ddp_rpc._trainers_comm = trainers
    rpc_world.barrier()  # every trainer is ready before the master starts them
    if rank == ddp_rpc.MASTER:
        result = ddp_rpc.run_master(
            epochs,
            batches,
            verbose=False,
            ps=rpc_world.names[ddp_rpc.PS],
            trainer_names=tuple(rpc_world.names[r] for r in ddp_rpc.TRAINERS),
            lockstep=lockstep,
            replicated_module=True,
        )
        assert result["fc_equal"], "the trainers' dense layers differ"
        if lockstep:
            ref = ddp_rpc.reference(epochs, batches)
            assert result["equal_each_step"] == [True] * (epochs * batches)
            assert_params_close(result["params"], ref["params"], "master")
            for t in range(2):
                assert_losses_close(result["losses"][t], ref["losses"][t], f"trainer{t}")
        else:
            for losses in result["losses"]:
                assert len(losses) == epochs * batches
                assert mean(losses[-batches:]) < mean(losses[:batches]), losses
    rpc_world.barrier()  # training is over everywhere
    if trainers != MPI.COMM_NULL:
        ddp_rpc._trainers_comm = None
        trainers.Free()
