"""Slurm auto-requeue of ``DistAutogradStrategy``: one common stop step, one hpc checkpoint, resume.

Run under ``mpiexec -n N python -m mpi4py -m pytest --with-mpi`` (N = 2 or 4): the last rank
serves, the others train. A Slurm job is faked by its variables (``SLURM_JOB_ID``,
``SLURM_NTASKS``) and ``scontrol requeue`` is replaced by a recorder; the signal is sent for
real, to one rank, in the middle of a training step. ``tests/test_slurm.py`` runs the same job
on a real Slurm, requeue included.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from _dist_utils import make_trainer, wait_until

from lightning_distgrad import DistAutogradStrategy
from lightning_distgrad import rpc as dist_rpc
from lightning_distgrad.lightning import _requeue
from lightning_distgrad.lightning._requeue import RequeueExit

sys.path.insert(0, str(Path(__file__).resolve().parent / "jobs"))
import requeue_train as job  # noqa: E402

STEPS = 8
SIGNAL_STEP = 2
TOL = 1e-5


def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


@pytest.fixture
def slurm_job(monkeypatch):
    """This process looks like a task of Slurm job 4242; requeues are recorded, not run."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_NTASKS", str(world().Get_size()))
    monkeypatch.delenv("SLURM_JOB_NAME", raising=False)
    requeued: list[str] = []
    monkeypatch.setattr(_requeue, "exit_for_requeue", requeued.append)
    _requeue.reset_signal()
    yield requeued
    _requeue.reset_signal()


@pytest.fixture
def no_slurm(monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_ARRAY_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    _requeue.reset_signal()
    yield
    _requeue.reset_signal()


def signal_rank(target: int, step: int, via_flag: bool = False):
    """A training-step hook: at ``step`` (after the forward pass), ``target`` (a global rank,
    trainer or server) gets SIGUSR1 from trainer 0, or has its flag set (``via_flag``)."""

    def on_step(module):
        if module.global_step != step or module.trainer.global_rank != 0:
            return
        if via_flag:
            dist_rpc.rpc_sync(f"worker{target}", _requeue.note_signal)
            return
        pid = dist_rpc.rpc_sync(f"worker{target}", os.getpid)
        os.kill(pid, signal.SIGUSR1)
        if target == module.trainer.strategy.server_ranks[0]:
            # A server passes the signal on within a poll of its serve loop: wait for it here,
            # so that the step it lands in is known.
            assert wait_until(lambda: _requeue._flag.received, timeout=60)

    return on_step


def fit(root: Path, on_step=None, **strategy_args):
    """Fit the job's model for ``STEPS`` steps in ``root``; (trainer, exception raised)."""
    strategy = DistAutogradStrategy(num_servers=1, **strategy_args)
    trainer = make_trainer(strategy, max_steps=STEPS, default_root_dir=str(root))
    model = job.RequeueModel(on_step)
    try:
        trainer.fit(model, job.loader(STEPS, strategy.num_trainers))
    except RequeueExit as e:
        return trainer, e
    return trainer, None


def final_state(trainer) -> dict[str, torch.Tensor]:
    state = trainer.strategy.lightning_module_state_dict()
    return {k: v.detach().cpu() for k, v in state.items()}


def assert_states_close(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        diff = (actual[key] - value).abs().max().item()
        assert diff <= TOL, f"{key}: max abs difference {diff:.3g}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("target", ["trainer0", "last_trainer", "server"])
def test_signal_to_one_rank_mid_step_stops_all_at_one_step_and_resumes(
    rpc_world, slurm_job, mpi_tmp_path, target
):
    comm = world()
    size = comm.Get_size()
    server = size - 1
    rank = {"trainer0": 0, "last_trainer": size - 2, "server": server}[target]
    trainer, stopped = fit(mpi_tmp_path, signal_rank(rank, SIGNAL_STEP))

    # Every rank, the server too, left fit with RequeueExit, a SystemExit of status 0.
    assert isinstance(stopped, RequeueExit) and stopped.code == 0 and stopped.job_id == "4242"
    steps = comm.allgather(None if trainer.strategy.is_server else trainer.global_step)
    stop_step = steps[0]
    assert steps[:-1] == [stop_step] * (size - 1), steps
    # The step that was running when the signal came (or, from the server, was relayed) is
    # the last.
    assert stop_step == SIGNAL_STEP + 1, steps
    # One checkpoint, written by trainer 0 at that step; only trainer 0 requeues.
    assert sorted(p.name for p in mpi_tmp_path.glob("hpc_ckpt_*")) == ["hpc_ckpt_1.ckpt"]
    # Every rank prepares its exit; only trainer 0 requeues.
    assert slurm_job == (["4242"] if comm.Get_rank() == 0 else [None]), slurm_job
    if comm.Get_rank() == 0:
        checkpoint = torch.load(mpi_tmp_path / "hpc_ckpt_1.ckpt", weights_only=False)
        assert checkpoint["global_step"] == stop_step
        assert "head.linear.weight" in checkpoint["state_dict"]
        remote = checkpoint["optimizer_states"][0]["distgrad_remote_optimizer_state"]
        assert list(remote) == [f"worker{server}"]  # the trainers' one remote optimizer
        assert all(s["state"] for s in remote.values())  # momentum

    # The requeued job: the same script, no ckpt_path; it resumes from the hpc checkpoint.
    _requeue.reset_signal()
    comm.Barrier()
    ran: list[int] = []
    resumed, stopped = fit(mpi_tmp_path, lambda module: ran.append(module.global_step))
    assert stopped is None
    if resumed.strategy.is_server:
        return
    assert ran == list(range(stop_step, STEPS))  # from the checkpoint on, not from the start
    assert resumed.global_step == STEPS
    assert_states_close(final_state(resumed), job.reference(STEPS, size - 1))


@pytest.mark.mpi(min_size=2)
def test_auto_requeue_false_trains_on(rpc_world, slurm_job, mpi_tmp_path):
    trainer, stopped = fit(
        mpi_tmp_path, signal_rank(0, SIGNAL_STEP, via_flag=True), auto_requeue=False
    )
    assert stopped is None
    assert not trainer.strategy.requeue.armed
    assert slurm_job == [] and not list(mpi_tmp_path.glob("hpc_ckpt_*"))
    if not trainer.strategy.is_server:
        assert trainer.global_step == STEPS


@pytest.mark.mpi(min_size=2)
def test_outside_slurm_the_signal_changes_nothing(rpc_world, no_slurm, mpi_tmp_path):
    trainer, stopped = fit(mpi_tmp_path, signal_rank(0, SIGNAL_STEP, via_flag=True))
    assert stopped is None
    assert not trainer.strategy.requeue.armed
    assert not list(mpi_tmp_path.glob("hpc_ckpt_*"))
    if not trainer.strategy.is_server:
        assert trainer.global_step == STEPS


def test_slurm_job_id_names_array_tasks():
    assert _requeue.slurm_job_id({"SLURM_JOB_ID": "17"}) == "17"
    array = {"SLURM_JOB_ID": "19", "SLURM_ARRAY_JOB_ID": "17", "SLURM_ARRAY_TASK_ID": "2"}
    assert _requeue.slurm_job_id(array) == "17_2"
    assert _requeue.slurm_job_id({}) is None
    assert _requeue.slurm_job_id({"SLURM_JOB_ID": "17; rm -rf"}) is None
