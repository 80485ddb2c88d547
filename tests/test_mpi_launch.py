"""tests/mpi_launch.py builds each launcher's command line (serial, nothing is started)."""

from __future__ import annotations

import os

import mpi_launch
import pytest
from mpi_launch import Launcher

HYDRA = Launcher("hydra", "/v/bin/mpiexec", "mpich")
OPENMPI = Launcher("openmpi", "/v/bin/mpiexec", "openmpi")
PROG = ["python", "-m", "mpi4py", "prog.py"]


@pytest.mark.parametrize(
    "text, library",
    [
        ("HYDRA build details:\n    Version:   5.0.2\n", "mpich"),
        ("mpiexec (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/", "openmpi"),
        ("Intel(R) MPI Library for Linux* OS, Version 2021.18.1 Build 20260626\n", "intel"),
        ("something else\n", "unknown"),
    ],
)
def test_version_output_names_the_library(text, library):
    assert mpi_launch.parse_version(text)[0] == library


def test_hydra_logs_per_rank_and_times_out_by_environment():
    cmd, env = mpi_launch.command(HYDRA, 4, PROG, logs="/l/mpi4", timeout_s=600)
    assert cmd == [
        "/v/bin/mpiexec",
        "-n",
        "4",
        "-outfile-pattern",
        "/l/mpi4.rank%r.out",
        "-errfile-pattern",
        "/l/mpi4.rank%r.err",
        *PROG,
    ]
    assert env == {"MPIEXEC_TIMEOUT": "600"}


def test_open_mpi_gets_its_own_flags():
    cmd, env = mpi_launch.command(
        OPENMPI, 64 * (os.cpu_count() or 1), PROG, logs="/l/x", timeout_s=30
    )
    assert cmd[cmd.index("--output") + 1] == "file=/l/x"
    assert cmd[cmd.index("--timeout") + 1] == "30"
    assert "--oversubscribe" in cmd and cmd[-4:] == PROG
    assert ("--allow-run-as-root" in cmd) == (os.geteuid() == 0)
    assert env == {}
    assert "--oversubscribe" not in mpi_launch.command(OPENMPI, 1, PROG)[0]


@pytest.mark.parametrize(
    "library, plugin", [("mpich", "pmi2"), ("intel", "pmi2"), ("openmpi", "pmix")]
)
def test_srun_picks_the_plugin_of_the_library(monkeypatch, library, plugin):
    monkeypatch.delenv("SRUN_MPI", raising=False)
    cmd, _ = mpi_launch.command(
        Launcher("srun", "srun", library), 2, PROG, logs="/l/s", timeout_s=61
    )
    assert f"--mpi={plugin}" in cmd and "--time=2" in cmd
    assert "--output=/l/s.rank%t.out" in cmd
    assert (cmd[-6:-4] == ["env", "PMIX_SECURITY_MODE=native"]) == (library == "openmpi")


def test_nested_job_environment_drops_only_the_outer_jobs_variables(monkeypatch):
    for name in (
        "PMI_RANK",
        "PMIX_RANK",
        "OMPI_COMM_WORLD_RANK",
        "HYDI_CONTROL_FD",
        "MPIEXEC_TIMEOUT",
        "OMPI_MCA_num_procs",
    ):
        monkeypatch.setenv(name, "1")
    for name in ("OMPI_MCA_btl", "MPIR_CVAR_CH4_NETMOD", "I_MPI_FABRICS", "OPAL_PREFIX"):
        monkeypatch.setenv(name, "kept")
    env = mpi_launch.job_env({"MPIEXEC_TIMEOUT": "5"})
    assert env["MPIEXEC_TIMEOUT"] == "5" and env["OMP_NUM_THREADS"] == "1"
    assert not {
        "PMI_RANK",
        "PMIX_RANK",
        "OMPI_COMM_WORLD_RANK",
        "HYDI_CONTROL_FD",
        "OMPI_MCA_num_procs",
    } & set(env)
    assert all(
        env[n] == "kept"
        for n in ("OMPI_MCA_btl", "MPIR_CVAR_CH4_NETMOD", "I_MPI_FABRICS", "OPAL_PREFIX")
    )


def test_open_mpi_log_names_are_made_uniform(tmp_path):
    for name in (
        "mpi4.prterun-host.example.org-123@1.0.out",
        "mpi4.prterun-host.example.org-123@1.3.err",
        "mpi2.rank0.out",
    ):
        (tmp_path / name).write_text(name)
    mpi_launch._rename_prrte_logs(str(tmp_path / "mpi4"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "mpi2.rank0.out",
        "mpi4.rank0.out",
        "mpi4.rank3.err",
    ]
