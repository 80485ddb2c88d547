"""Starting whole MPI jobs of the package under test from serial tests.

Serial tests only (the plain ``pytest`` pass): a job started from inside an MPI job would join
it. :mod:`mpi_launch` builds the launcher's command line and runs the job (:class:`mpi_launch.Job`:
a session of its own, a hang timeout); this module adds what such a job needs to import the
package under test.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import mpi_launch
from mpi_launch import JobResult

import lightning_distgrad

#: The launcher of this interpreter's MPI (hydra, Open MPI or srun), or None.
LAUNCHER = mpi_launch.find_launcher()
#: The tests folder (job scripts and the modules they import live here).
TESTS = Path(__file__).resolve().parent
#: The folder that holds the package under test; jobs import it from there.
PACKAGE_ROOT = Path(lightning_distgrad.__file__).resolve().parents[1]


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
    kills a hung job 5 s before ``timeout_s``, :func:`mpi_launch.run_job` at ``timeout_s``."""
    return start_mpi_job(n, argv, timeout_s, cwd, extra_env).wait(timeout_s)


def start_mpi_job(
    n: int,
    argv: Sequence[str],
    timeout_s: float,
    cwd: str | Path,
    extra_env: Mapping[str, str] | None = None,
) -> mpi_launch.Job:
    """Start ``argv`` on ``n`` ranks (see :func:`mpi_job`) and return at once; wait for it
    with ``job.wait(timeout_s)``."""
    cmd, launch_env = mpi_launch.command(LAUNCHER, n, list(argv), timeout_s=int(timeout_s) - 5)
    env = clean_env({**launch_env, **(extra_env or {})})
    return mpi_launch.Job(cmd, cwd=cwd, env=env)
