"""Starting whole MPI jobs from serial tests: a clean environment and a hang timeout.

Serial tests only (the plain ``pytest`` pass): a job started from inside an MPI job
would join it. A job runs in a session of its own, so a hung one is killed with
every process it started.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import lightning_distgrad

#: The mpiexec next to this interpreter (the venv's MPICH), else the one on PATH.
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
#: The tests folder (job scripts and the modules they import live here).
TESTS = Path(__file__).resolve().parent
#: The folder that holds the package under test; jobs import it from there.
PACKAGE_ROOT = Path(lightning_distgrad.__file__).resolve().parents[1]
#: How long a hung job may take to end after SIGTERM before it is killed.
TERM_GRACE_S = 10


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a fresh job.

    Drops the process-manager variables of any job this pytest runs inside (a nested
    ``mpiexec`` must not join it), makes the job import the package this test imports,
    and keeps each job to one thread per rank (the jobs oversubscribe the cores).
    """
    prefixes = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPIR_", "OMPI_", "MPI_LOCAL")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(prefixes) and k != "MPIEXEC_TIMEOUT"}
    path = [str(PACKAGE_ROOT), *filter(None, env.get("PYTHONPATH", "").split(":"))]
    env["PYTHONPATH"] = ":".join(dict.fromkeys(path))
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


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


def run_job(argv: Sequence[str], *, timeout_s: float, cwd: str | Path,
            env: Mapping[str, str]) -> JobResult:
    """Run ``argv`` to its end, or kill its whole process group after ``timeout_s``."""
    start = time.monotonic()
    proc = subprocess.Popen(list(argv), cwd=cwd, env=dict(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
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
