"""Machinery shared by the benchmark scripts (``bench_rpc.py``, ``bench_autograd.py``,
``bench_hybrid.py``).

The scripts run as ``mpiexec -n N python -m mpi4py benchmarks/<script>.py``, which puts this
folder on ``sys.path``: they import it as ``from _common import ...``. Nothing here imports
torch at module level, so a script can still set ``OMP_NUM_THREADS`` before torch is loaded.

What is here: formatting and statistics helpers, sleeping MPI barriers and agreement, the
shared-machine probes (``/proc/stat`` busy time, load average, waiting for a quiet machine,
other processes' load during a step), the re-run bookkeeping of busy steps, start-up pieces
(watchdog timer, the 2-rank communicator, environment record, TensorPipe's port) and report
lines common to the scripts.
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import sys
import threading
import time
import traceback
from argparse import ArgumentParser, Namespace
from pathlib import Path

from mpi4py import MPI

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"
BUSY_WARNING_CORES = 0.3  # other processes' peak load above which a report warns


# --------------------------------------------------------------------------------------------
# Formatting and statistics


def fmt_time(seconds: float | None) -> str:
    """A duration with a readable unit (us, ms or s); ``-`` for None."""
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def med(values: list[float]) -> float | None:
    """The median, or None for no values."""
    return statistics.median(values) if values else None


def summarize(samples: list[float]) -> dict:
    """Count, median, 10th and 90th percentile and minimum of timing samples."""
    s = sorted(samples)
    return {
        "n": len(s),
        "median": statistics.median(s),
        "p10": s[len(s) // 10],
        "p90": s[(9 * len(s)) // 10],
        "min": s[0],
    }


# --------------------------------------------------------------------------------------------
# MPI helpers


def quiet_barrier(comm: MPI.Comm, max_sleep: float = 0.05, first_sleep: float = 1e-3) -> None:
    """Barrier that sleeps instead of spinning (MPICH's blocking calls burn a core, which would
    compete with the threads under test; short sleeps would steal their GIL)."""
    req = comm.Ibarrier()
    delay = first_sleep
    while not req.Test():
        time.sleep(delay)
        delay = min(2 * delay, max_sleep)


def agree(comm: MPI.Comm, ok: bool) -> bool:
    """True on every rank if ``ok`` is true on every rank."""
    return bool(comm.allreduce(int(ok), op=MPI.MIN))


def agreed_reason(comm: MPI.Comm, why: str | None) -> str | None:
    """The first rank's reason not to run something, so that all ranks decide alike."""
    return next((w for w in comm.allgather(why) if w), None)


def two_rank_comm(script: str) -> MPI.Intracomm:
    """A private duplicate of COMM_WORLD; aborts the job unless it has exactly 2 ranks."""
    comm = MPI.COMM_WORLD.Dup()
    if comm.Get_size() != 2:
        if comm.Get_rank() == 0:
            print(f"{script} needs exactly 2 ranks: mpiexec -n 2 python -m mpi4py ...")
        MPI.COMM_WORLD.Abort(2)
    return comm


def start_watchdog(timeout: float, message: str, stream=None) -> threading.Timer:
    """Abort the whole job (status 3) after ``timeout`` s, printing ``message`` first (to
    ``stream``, stdout by default). Cancel the returned timer when done."""

    def watchdog() -> None:
        print(message, file=stream or sys.stdout, flush=True)
        MPI.COMM_WORLD.Abort(3)

    timer = threading.Timer(timeout, watchdog)
    timer.daemon = True
    timer.start()
    return timer


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tensorpipe_kwargs(rpc, comm: MPI.Comm) -> dict:
    """``init_rpc`` keyword arguments for TensorPipe with default options on a fresh port
    chosen by rank 0 (every round: TCPStore may keep the old one busy)."""
    port = comm.bcast(free_port() if comm.Get_rank() == 0 else None, root=0)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    return {"rpc_backend_options": opts}


def tensorpipe_unavailable() -> str | None:
    """None if ``torch.distributed.rpc`` can run here, else the reason it is skipped."""
    import torch.distributed.rpc as rpc

    return None if rpc.is_available() else "torch.distributed.rpc is not available"


# --------------------------------------------------------------------------------------------
# The machine (may be shared with other processes)


def system_busy_s() -> float | None:
    """Busy CPU seconds of the whole machine since boot (Linux), None elsewhere."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (Linux), None elsewhere."""
    try:
        with open("/proc/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except (OSError, ValueError):
        return None


def base_env() -> dict:
    """Host, CPUs and software versions, for the result files."""
    import torch

    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mpi4py": sys.modules["mpi4py"].__version__,
        "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
    }


def wait_quiet(comm: MPI.Comm, max_wait: float, threshold: float = 0.15) -> float | None:
    """Wait (at most max_wait s) until other processes use < threshold cores; the box is shared.
    Returns the last measured foreign load (cores) on rank 0."""
    foreign = None
    if comm.Get_rank() == 0 and max_wait > 0 and system_busy_s() is not None:
        deadline = time.perf_counter() + max_wait
        while True:
            b0, c0, t0 = system_busy_s(), time.process_time(), time.perf_counter()
            time.sleep(0.5)  # the other ranks sleep in quiet_barrier meanwhile
            wall = time.perf_counter() - t0
            foreign = (system_busy_s() - b0 - (time.process_time() - c0)) / wall
            if foreign < threshold or time.perf_counter() > deadline:
                break
    quiet_barrier(comm)
    return foreign


class StepLoad:
    """CPU use during one step: this job's ranks and the machine's other processes."""

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self.busy0, self.cpu0, self.t0 = system_busy_s(), time.process_time(), time.perf_counter()

    def stop(self) -> dict[str, float]:
        """Collective. On rank 0 (where ``/proc/stat`` is readable): the step's ``wall_s``, the
        ranks' ``own_cores`` and the other processes' ``foreign_cores``; else empty."""
        cpus = self.comm.gather(time.process_time() - self.cpu0, root=0)
        if self.comm.Get_rank() != 0 or self.busy0 is None:
            return {}
        wall = time.perf_counter() - self.t0
        return {
            "wall_s": wall,
            "own_cores": sum(cpus) / wall,
            "foreign_cores": (system_busy_s() - self.busy0 - sum(cpus)) / wall,
        }


def add_max_load_arg(ap: ArgumentParser) -> None:
    """The ``--max-load`` option: re-run a step that saw other processes this busy."""
    ap.add_argument(
        "--max-load",
        type=float,
        default=0.3,
        metavar="CORES",
        help="re-run a step if other processes used more than this (default 0.3)",
    )


def result_paths(tag: str) -> tuple[Path, Path]:
    """``results/<tag>.json`` and ``.png`` (the folder created if needed)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    return RESULTS_DIR / f"{tag}.json", RESULTS_DIR / f"{tag}.png"


# --------------------------------------------------------------------------------------------
# Steps: init on every rank, re-runs of busy steps


def init_on_all(backend, comm: MPI.Comm, step: dict) -> bool:
    """``backend.init()`` on every rank, timed into ``step["init_s"]``. False (with the error
    in ``step``) unless it came up everywhere; a rank that did come up shuts down again."""
    err = None
    t0 = time.perf_counter()
    try:
        backend.init()
    except Exception:  # report, skip the backend, keep the job alive
        err = traceback.format_exc()
    step["init_s"] = time.perf_counter() - t0
    if agree(comm, err is None):
        return True
    step["error"] = err or "init failed on the other rank"
    if err is None:  # only this rank came up: try to take it down again
        try:
            backend.shutdown()
        except Exception:
            pass
    return False


def timed(fn) -> float:
    """Seconds ``fn()`` took."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def busy_again(step: dict, attempts: int, args: Namespace, in_budget: bool) -> bool:
    """Whether a step that saw other processes' load above ``--max-load`` is run again."""
    return (
        "error" not in step
        and step.get("foreign_cores", 0) > args.max_load
        and attempts <= args.retries
        and in_budget
    )


def keep_quietest(comm: MPI.Comm, attempts: list[dict], steps: list, discarded: list) -> dict:
    """Append rank 0's least disturbed attempt to ``steps``, the others to ``discarded``;
    returns the kept attempt."""
    best = comm.bcast(
        min(range(len(attempts)), key=lambda i: attempts[i].get("foreign_cores", 0)),
        root=0,
    )
    steps.append(attempts[best])
    discarded += [a for i, a in enumerate(attempts) if i != best]
    return attempts[best]


# --------------------------------------------------------------------------------------------
# Report lines


def print_step_error(head: str, step: dict) -> bool:
    """Print a failed step's error; returns whether the step failed."""
    if "error" in step:
        print(f"{head} ERROR, disabled for later rounds:\n{step['error']}", flush=True)
    return "error" in step


def load_note(step: dict, again: bool, t_start: float) -> str:
    """End of a step's progress line: others' load, re-run mark, time since the start."""
    return (
        f"others' load {step.get('foreign_cores', float('nan')):.2f} cores"
        + (" (busy: again)" if again else "")
        + f"  [{time.perf_counter() - t_start:.0f} s]"
    )


def load_summary(steps: list[dict]) -> dict:
    """Median and maximum of other processes' load (cores) over the steps."""
    loads = [s["foreign_cores"] for s in steps if s.get("foreign_cores") is not None]
    return {"median": med(loads), "max": max(loads, default=None)}


def busy_warning(max_load: float) -> str:
    """A warning to append to the load line if the machine was busy."""
    if max_load > BUSY_WARNING_CORES:
        return "  <-- WARNING: shared machine was busy, numbers are contaminated"
    return ""


def error_lines(summary: dict, names: list[str]) -> list[str]:
    """One line per recorded error: its last line."""
    return [
        f"  [{n} error] {e.strip().splitlines()[-1]}"
        for n in names
        for e in summary.get(n, {}).get("errors", [])
    ]


def target_line(desc: str, value: float | None, limit: float) -> str:
    """PASS/FAIL (or SKIP if not measured) of ``value <= limit``."""
    if value is None:
        return f"  SKIP  {desc} <= {limit}: not measured"
    return f"  {'PASS' if value <= limit else 'FAIL'}  {desc} = {value:.3f} (target <= {limit})"
