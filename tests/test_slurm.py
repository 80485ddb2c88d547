"""Submit slurm/cpu_example.sbatch to a real Slurm and check the MPI job ran; and the Lightning
strategy's auto-requeue there: a 3-rank job signalled with SIGUSR1 is requeued and resumes, a
job whose trainer is killed resumes when submitted again (both end with the parameters of an
uninterrupted run).

Plain pytest (not under MPI). The job runs this interpreter's MPI (the wheel of its venv:
MPICH, Open MPI or Intel MPI), and the script must pick that MPI's ``srun --mpi=`` plugin;
``.ci/run`` runs the launch tests under each MPI, the requeue tests under MPICH and Open
MPI. Skips unless `sbatch` is on PATH and a Slurm controller answers `sinfo`. For a
throwaway single-node cluster on this machine:

    apt-get install -y slurm-wlm munge libpmix2 libpmix-dev libpmi2-0
    slurm/local/start_local_cluster.sh      # as root; stop_local_cluster.sh after

Environment:
    SLURM_TEST_TIMEOUT  seconds one job may take, queueing included (default 300, times
                        LIGHTNING_DISTGRAD_TEST_SLOWDOWN)
    SLURM_TEST_OUTDIR   where job output goes; must be visible from the compute
                        node (default: pytest's tmp_path, fine for one node)
    SLURM_TEST_SBATCH_ARGS  extra sbatch options, e.g. "--partition=debug --account=x"
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from _timing import scaled

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "slurm" / "cpu_example.sbatch"
# The MPI program the batch script runs (its EXAMPLE variable) and what rank 0
# must print: 2 ranks each contribute rank+1 to an allreduce, so sum = 1 + 2.
EXAMPLE = "tests/slurm_job_check.py"
NTASKS = 2
EXPECTED = re.compile(r"SLURM_CHECK world=(\d+) sum=(\d+)")

TIMEOUT = scaled(float(os.environ.get("SLURM_TEST_TIMEOUT", "300")))

#: What cpu_example.sbatch must choose for each MPI library (first words of its version).
SRUN_MPI = {"Open MPI": "pmix", "Intel(R) MPI": "pmi2", "MPICH": "pmi2"}


def _mpi_library() -> str:
    """The first line of the MPI library version mpi4py loads here (MPI not initialised)."""
    code = (
        "import mpi4py; mpi4py.rc.initialize = False\n"
        "from mpi4py import MPI\n"
        "print(MPI.Get_library_version().splitlines()[0].rstrip(chr(0)))"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()


def _slurm_unavailable() -> str | None:
    """Why Slurm cannot be used here, or None if it can."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return "sbatch/sinfo not on PATH (no Slurm client installed)"
    try:
        # sinfo fails when there is no slurm.conf or no controller answers;
        # the timeout covers a controller that accepts but never replies.
        res = subprocess.run(
            ["sinfo", "-h", "-o", "%P %a %T %D"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 30 s"
    if res.returncode != 0:
        msg = (res.stderr.strip().splitlines() or ["no output"])[-1]
        return f"no Slurm controller answers (sinfo exit {res.returncode}: {msg})"
    if not res.stdout.strip():
        return "Slurm answers but has no partitions"
    return None


@pytest.fixture(scope="module", autouse=True)
def _require_slurm():
    # A fixture, not a collection-time skipif: sinfo runs only when these
    # tests are selected.
    reason = _slurm_unavailable()
    if reason is not None:
        pytest.skip(reason)


def _job_env(**extra: str) -> dict[str, str]:
    """Environment for sbatch (exported to the job by --export=ALL)."""
    # Drop launcher state in case pytest itself runs under mpiexec or inside a
    # Slurm job: stale PMI_*/SLURM_* values would confuse the job's own srun.
    stale = ("PMI_", "PMIX_", "HYDRA_", "MPI_LOCAL", "OMPI_COMM_WORLD", "SLURM_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(stale) or k == "SLURM_CONF"}
    # Run the job with this interpreter: the batch script activates $VENV when
    # it has bin/activate, and PATH covers a non-venv interpreter too.
    env["VENV"] = sys.prefix
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["EXAMPLE"] = EXAMPLE
    env.update(extra)
    return env


def _submit(tmp_path: Path, **extra_env: str) -> tuple[int, str]:
    """sbatch --wait the CPU script; return (job exit code, job output).

    Never hangs: on timeout the sbatch client is killed and the job cancelled
    by its unique name (sbatch --wait prints the job id only at the end).
    """
    outdir = Path(os.environ.get("SLURM_TEST_OUTDIR", tmp_path))
    outdir.mkdir(parents=True, exist_ok=True)
    name = f"ldg-slurm-check-{uuid.uuid4().hex[:8]}"
    outfile = outdir / f"{name}.out"
    cmd = [
        "sbatch",
        "--wait",
        f"--job-name={name}",
        f"--output={outfile}",
        f"--chdir={REPO}",
        "--nodes=1",
        f"--ntasks={NTASKS}",
        "--cpus-per-task=1",
        "--time=10",
        "--export=ALL",
        *shlex.split(os.environ.get("SLURM_TEST_SBATCH_ARGS", "")),
        str(SCRIPT),
    ]
    try:
        res = subprocess.run(
            cmd, env=_job_env(**extra_env), capture_output=True, text=True, timeout=TIMEOUT
        )
    except subprocess.TimeoutExpired:
        # run() already killed sbatch; the job itself lives on in Slurm.
        subprocess.run(["scancel", f"--name={name}"], capture_output=True, timeout=60)
        out = outfile.read_text() if outfile.exists() else "(no output file)"
        pytest.fail(f"job {name} did not finish within {TIMEOUT:.0f} s; cancelled.\n{out}")
    out = outfile.read_text() if outfile.exists() else ""
    if not out:
        # A job that never ran: sbatch's own complaint is the useful part.
        out = f"(no job output)\nsbatch stdout: {res.stdout}\nsbatch stderr: {res.stderr}"
    return res.returncode, out


def test_cpu_example_runs_two_rank_mpi_job(tmp_path):
    rc, out = _submit(tmp_path)
    assert rc == 0, f"job exit code {rc}\n{out}"
    m = EXPECTED.search(out)
    assert m, f"no 'SLURM_CHECK world=.. sum=..' line in job output\n{out}"
    world, total = int(m.group(1)), int(m.group(2))
    # world=1 would mean each rank came up as a singleton (PMI not wired up).
    assert world == NTASKS, out
    assert total == NTASKS * (NTASKS + 1) // 2, out
    # Both ranks ran (and as separate Slurm tasks when launched by srun).
    assert len(re.findall(r"^rank \d+/2 ", out, re.M)) == NTASKS, out
    library = _mpi_library()
    plugin = next((p for name, p in SRUN_MPI.items() if name in library), "pmi2")
    assert f"MPI: {library} (srun --mpi={plugin}" in out, out
    assert "Sorry!" not in out, out  # no PMIx complaint (Open MPI under --mpi=pmix)


def test_failing_rank_aborts_job(tmp_path):
    # An exception on one rank must end the job with an error, not leave the
    # other rank blocked in a collective until the time limit.
    rc, out = _submit(tmp_path, SLURM_CHECK_FAIL_RANK="1")
    assert rc != 0, f"job succeeded although rank 1 raised\n{out}"
    assert "SLURM_CHECK_FAIL_RANK" in out, out


# --- Auto-requeue of the Lightning strategy -----------------------------------------------------

#: The Lightning job of the requeue tests: 2 trainers and 1 serving rank, SGD with momentum.
REQUEUE_JOB = "tests/jobs/requeue_train.py"
REQUEUE_STEPS = 30


def _start(tmp_path: Path, ntasks: int, job_args: list[str], **extra_env: str) -> int:
    """sbatch the CPU script with ``job_args`` for its example (no --wait); the job id.

    ``--requeue`` and ``--open-mode=append`` are in the script (the requeued run appends to
    the first run's output). ``--overcommit`` places the ranks on one allocated CPU, and
    ``CPU_BIND=none`` lets them run on every core (3 ranks on a 2-core test machine).
    """
    cmd = [
        "sbatch",
        "--parsable",
        f"--output={tmp_path / 'job-%j.out'}",
        f"--chdir={REPO}",
        "--nodes=1",
        f"--ntasks={ntasks}",
        "--overcommit",
        "--time=30",
        "--export=ALL",
        *shlex.split(os.environ.get("SLURM_TEST_SBATCH_ARGS", "")),
        str(SCRIPT),
        *job_args,
    ]
    env = _job_env(EXAMPLE=REQUEUE_JOB, CPU_BIND="none", **extra_env)
    # The package of this checkout first; the suite's own entries (its test mode) stay.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=True)
    return int(res.stdout.strip().split(";")[0])


def _job_state(job: int) -> str | None:
    """The job's state in the queue (PENDING, RUNNING, ...), or None once it has left it."""
    res = subprocess.run(
        ["squeue", "-h", "-j", str(job), "-o", "%T"], capture_output=True, text=True, timeout=60
    )
    return res.stdout.strip() or None


def _wait(what: str, done, job: int, out: Path) -> None:
    """Poll ``done()`` every half second for up to SLURM_TEST_TIMEOUT; cancel the job and fail
    with its output if it never comes true."""
    deadline = time.monotonic() + TIMEOUT
    while not done():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", str(job)], capture_output=True, timeout=60)
            text = out.read_text() if out.exists() else "(no output)"
            pytest.fail(f"job {job}: {what} did not happen within {TIMEOUT:.0f} s.\n{text}")
        time.sleep(0.5)


def _printed(out: Path, pattern: str) -> re.Match | None:
    return re.search(pattern, out.read_text()) if out.exists() else None


def _assert_uninterrupted_result(out_file: Path, text: str) -> None:
    """The job's final parameters equal those of an uninterrupted run (one process)."""
    sys.path.insert(0, str(REPO / "tests" / "jobs"))
    import requeue_train
    import torch

    final = torch.load(out_file, weights_only=True)
    assert final["global_step"] == REQUEUE_STEPS, text
    expected = requeue_train.reference(REQUEUE_STEPS, num_trainers=2)
    assert sorted(final["state"]) == sorted(expected)
    for name, value in expected.items():
        diff = (final["state"][name] - value).abs().max().item()
        assert diff <= 1e-5, f"{name}: max abs difference {diff:.3g}\n{text}"


def test_usr1_requeues_the_lightning_job_which_resumes_exactly(tmp_path):
    # What `#SBATCH --signal=USR1@120` does before a time limit: SIGUSR1 to every task.
    out_file = tmp_path / "final.pt"
    args = ["--root", str(tmp_path), "--steps", str(REQUEUE_STEPS), "--out", str(out_file)]
    job = _start(tmp_path, 3, [*args, "--step-sleep", "0.3"])
    out = tmp_path / f"job-{job}.out"
    _wait("step 5", lambda: _printed(out, r"REQUEUE_JOB step=5\b"), job, out)
    subprocess.run(["scancel", "--signal=USR1", str(job)], check=True, timeout=60)
    # Requeued: back in the queue, held for a while (Slurm's BeginTime); release it now.
    _wait("the requeue", lambda: _job_state(job) == "PENDING", job, out)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True, timeout=60)
    _wait("the end of the requeued run", lambda: _job_state(job) is None, job, out)

    text = out.read_text()
    saved = re.search(r"auto-requeue: saved (\S+hpc_ckpt_1\.ckpt) at step (\d+)", text)
    assert saved, text
    stop_step = int(saved.group(2))
    assert 5 <= stop_step < REQUEUE_STEPS, text
    # The requeued run (SLURM_RESTART_COUNT=1) started from the hpc checkpoint, by itself.
    assert f"REQUEUE_JOB start step={stop_step} restarts=1" in text, text
    assert f"REQUEUE_JOB done step={REQUEUE_STEPS}" in text, text
    _assert_uninterrupted_result(out_file, text)


def test_killed_trainer_resubmitted_resumes_from_the_last_periodic_checkpoint(tmp_path):
    # A trainer dies by SIGKILL at step 12; srun's --kill-on-bad-exit ends the job. The same
    # job submitted again resumes from ModelCheckpoint's last.ckpt (step 10).
    out_file = tmp_path / "final.pt"
    args = ["--root", str(tmp_path), "--steps", str(REQUEUE_STEPS), "--out", str(out_file)]
    args += ["--every", "5", "--kill-at", "12"]
    first = _start(tmp_path, 3, args)
    first_out = tmp_path / f"job-{first}.out"
    _wait("the end of the killed run", lambda: _job_state(first) is None, first, first_out)
    assert "killing trainer 1 at step=12" in first_out.read_text()
    assert not out_file.exists(), first_out.read_text()

    again = _start(tmp_path, 3, args)
    out = tmp_path / f"job-{again}.out"
    _wait("the end of the resubmitted run", lambda: _job_state(again) is None, again, out)
    text = out.read_text()
    assert "REQUEUE_JOB start step=10 restarts=0" in text, text
    _assert_uninterrupted_result(out_file, text)
