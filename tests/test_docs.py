"""The documentation tells the truth: the README's quick start runs as printed, and every
public function and class has a docstring with an example."""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _job_runner import LAUNCHER, mpi_job
from _timing import scaled

REPO = Path(__file__).resolve().parents[1]
PUBLIC_MODULES = [
    "lightning_distgrad.rpc",
    "lightning_distgrad.autograd",
    "lightning_distgrad.optim",
    "lightning_distgrad.nn",
    "lightning_distgrad.lightning",
    "lightning_distgrad.profiler",
]


def public_objects():
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj)):
                yield f"{module_name}.{name}", obj


def readme_block(first_line: str) -> str:
    """The README's fenced Python block that starts with ``first_line``."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    matches = [b for b in blocks if b.startswith(first_line)]
    assert len(matches) == 1, f"README has {len(matches)} python blocks starting {first_line!r}"
    return matches[0]


@pytest.mark.parametrize("qualname,obj", [pytest.param(*o, id=o[0]) for o in public_objects()])
def test_public_api_has_a_docstring_with_an_example(qualname, obj):
    doc = inspect.getdoc(obj) or ""
    assert "Example" in doc and ">>>" in doc, f"{qualname}: docstring without an example"


@pytest.mark.skipif(LAUNCHER is None, reason="needs an MPI launcher (mpiexec) beside python")
def test_readme_rpc_quick_start_runs_and_prints_what_it_says(tmp_path):
    script = tmp_path / "quickstart.py"
    script.write_text(readme_block("# quickstart.py"))
    job = mpi_job(
        2, [sys.executable, "-m", "mpi4py", str(script)], timeout_s=scaled(120), cwd=tmp_path
    )
    assert job.code == 0, job.describe()
    # The values the README's comments promise: dloss/dx = w = 1, and w after one SGD step.
    assert "tensor([1., 1., 1.])" in job.output, job.describe()
    assert "tensor([0.9000, 0.8000, 0.7000])" in job.output, job.describe()


@pytest.mark.skipif(LAUNCHER is None, reason="needs an MPI launcher (mpiexec) beside python")
def test_readme_lightning_quick_start_trains_with_a_server_rank(tmp_path):
    script = tmp_path / "train.py"
    report = (
        "if trainer.is_global_zero:\n"
        '    print("final", float(trainer.callback_metrics["train_loss"]))\n'
    )
    script.write_text(readme_block("# train.py") + report)
    job = mpi_job(
        3, [sys.executable, "-m", "mpi4py", str(script)], timeout_s=scaled(240), cwd=tmp_path
    )
    assert job.code == 0, job.describe()
    final = [float(x) for x in re.findall(r"^final ([0-9.e-]+)$", job.output, re.M)]
    # Predicting 0 scores about 0.27 on these targets, their mean about 0.02.
    assert len(final) == 1 and final[0] < 0.1, job.describe()


def readme_install_commands() -> list[str]:
    """The README's install block as ``.ci/run`` runs it: set-up with the main job, then the
    tests (``.ci/readme_command`` reads them)."""
    script = REPO / ".ci" / "readme_command"
    run = [
        subprocess.run([sys.executable, script, n], capture_output=True, text=True, check=True)
        for n in ("1", "2")
    ]
    return [r.stdout.strip() for r in run]


def test_readme_install_is_set_up_with_the_main_job_then_the_tests():
    setup, tests = readme_install_commands()
    install, main_job = setup.split(" && .venv/bin/mpiexec ")
    # A named torch: pip never brings PyPI's newest (a CUDA build of several GB) instead.
    assert re.fullmatch(
        r"python3 -m venv \.venv && \.venv/bin/pip install torch==[0-9.]+"
        r' -e "\.\[mpich,test,bench\]"',
        install,
    ), setup
    ranks, script = re.fullmatch(
        r"-n (\d+) \.venv/bin/python -m mpi4py (examples/\w+\.py)", main_job
    ).groups()
    # The example's own docstring says how to run it, with the same number of ranks.
    assert f"mpiexec -n {ranks} python -m mpi4py {script}" in (REPO / script).read_text()
    assert tests == ". .venv/bin/activate && bash tests/run_all.sh"


@pytest.mark.skipif(LAUNCHER is None, reason="needs an MPI launcher (mpiexec) beside python")
def test_readme_main_job_trains_and_ends_with_what_it_trained_where():
    ranks, script = re.search(
        r"-n (\d+) \S+ -m mpi4py (\S+)", readme_install_commands()[0]
    ).groups()
    argv = [sys.executable, "-m", "mpi4py", str(REPO / script), "--fast", "--epochs", "2"]
    job = mpi_job(int(ranks), argv, timeout_s=240, cwd=REPO)
    assert job.code == 0, job.describe()
    lines = [line for line in job.output.replace("\r", "\n").splitlines() if line.strip()]
    last = re.fullmatch(
        r"trained an EmbeddingBag\(200, 16\) held by rank 2 \(server\) and an MLP 16-32-1"
        r" replicated on ranks 0-1 \(trainers\) for 2 epochs \((\d+) steps\) in [0-9.]+ s;"
        r" loss: first ([0-9.]+) -> last ([0-9.]+)",
        lines[-1],
    )
    assert last, job.describe()
    steps, first, final = int(last[1]), float(last[2]), float(last[3])
    # --fast: 512 samples, 32 a batch on each of 2 trainers: 8 steps an epoch.
    assert steps == 16 and final < first, lines[-1]
    # A progress bar; only rank 0 speaks (Lightning's banner once); no warnings. Open MPI's
    # launcher gives rank 0 a pseudo-terminal of width 0 when its own output is no terminal,
    # in which tqdm draws no bar at all.
    if LAUNCHER.kind != "openmpi":
        assert "Epoch 1: 100%" in job.output, job.describe()
    assert "Traceback" not in job.output, job.describe()
    assert job.output.count("GPU available:") == 1, job.describe()
    assert not [line for line in lines if "warn" in line.lower()], job.describe()
