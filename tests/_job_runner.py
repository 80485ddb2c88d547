"""Starting whole MPI jobs from serial tests: a clean environment and a hang timeout.

Serial tests only (the plain ``pytest`` pass): a job started from inside an MPI job
would join it. A job runs in a session of its own, so a hung one is killed with
every process it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import mpi_launch

import lightning_distgrad

#: The launcher of this interpreter's MPI (hydra, Open MPI or srun), or None.
LAUNCHER = mpi_launch.find_launcher()
#: The tests folder (job scripts and the modules they import live here).
TESTS = Path(__file__).resolve().parent
#: The folder that holds the package under test; jobs import it from there.
PACKAGE_ROOT = Path(lightning_distgrad.__file__).resolve().parents[1]
#: How long a hung job may take to end after SIGTERM before it is killed.
TERM_GRACE_S = 10


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a fresh job (:func:`mpi_launch.job_env`: no variables of a job
    this pytest runs inside, one thread per rank) that imports the package under test."""
    env = mpi_launch.job_env()
    path = [str(PACKAGE_ROOT), *filter(None, env.get("PYTHONPATH", "").split(":"))]
    env["PYTHONPATH"] = ":".join(dict.fromkeys(path))
    env.update(extra or {})
    return env


def mpi_job(
    n: int,
    argv: Sequence[str],
    timeout_s: float,
    cwd: str | Path,
    extra_env: Mapping[str, str] | None = None,
) -> JobResult:
    """Run ``argv`` on ``n`` ranks under this interpreter's MPI launcher; the launcher
    kills a hung job 5 s before ``timeout_s``, :func:`run_job` at ``timeout_s``."""
    cmd, launch_env = mpi_launch.command(LAUNCHER, n, list(argv), timeout_s=int(timeout_s) - 5)
    env = clean_env({**launch_env, **(extra_env or {})})
    return run_job(cmd, timeout_s=timeout_s, cwd=cwd, env=env)


@dataclass
class JobResult:
    """How a job ended: exit code (None: killed as hung), combined output, seconds."""

    argv: list[str]
    code: int | None
    output: str
    seconds: float

    @property
    def hung(self) -> bool:
        return self.code is None

    def describe(self) -> str:
        """For assertion messages: the command, how it ended, and its output."""
        ended = "hung and was killed" if self.hung else f"exited with {self.code}"
        return f"{' '.join(self.argv)}\n{ended} after {self.seconds:.1f} s. Output:\n{self.output}"


def run_job(
    argv: Sequence[str], *, timeout_s: float, cwd: str | Path, env: Mapping[str, str]
) -> JobResult:
    """Run ``argv`` to its end, or kill its whole process group after ``timeout_s``."""
    start = time.monotonic()
    proc = subprocess.Popen(
        list(argv),
        cwd=cwd,
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        out = _stop(proc)
        code = None
    finally:
        if proc.poll() is None:  # interrupted: leave no rank behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return JobResult(list(argv), code, out, time.monotonic() - start)


def _stop(proc: subprocess.Popen) -> str:
    """End a hung job; its remaining output.

    SIGTERM first: mpiexec then tears down its proxies, which run in sessions of their
    own and so outlive a SIGKILL of mpiexec's group for a few seconds.
    """
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    return out
