"""The benchmarks' shared harness: a figure is a list of ``row``s. Nothing here imports MPI
at module level: a driver that starts jobs (``drive``) must not initialise it."""

import argparse
import json
import operator
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

MiB, GiB = 1 << 20, 1 << 30
RESULTS = Path(__file__).resolve().parent / "results"
TP = "TensorPipe"
#: The anchor of a call's messages sent with no agent around them (``rpc_latency.wire_floor``).
FLOOR = "our pickling and frames alone, no agent"
LOAD_AT_START = os.getloadavg()
_OPS = {"<=": operator.le, ">=": operator.ge}
warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")  # torch's RPC start-up
os.environ.setdefault("OMP_NUM_THREADS", "1")  # read when torch first runs an operator
os.environ["MPLBACKEND"] = "Agg"  # plots are files only


def parse(doc: str, **options: dict) -> argparse.Namespace:
    """``--quick``, ``--out`` and ``options`` (``max_bytes={...}`` adds ``--max-bytes``)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    ap.add_argument("--out", type=Path, help="result file (default: results/<name>.json)")
    for name, kwargs in options.items():
        ap.add_argument(f"--{name.replace('_', '-')}", **kwargs)
    return ap.parse_args()


def run(name: str, ranks: int | None, measure, args: argparse.Namespace) -> None:
    """``measure(comm, args) -> (rows, extra)`` on ``COMM_WORLD`` of ``ranks`` ranks (None:
    two or more), torch on one thread; rank 0 writes what it returns as ``name``'s result."""
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD.Dup()
    if comm.Get_size() != (ranks or max(2, comm.Get_size())):
        n = ranks or "N >= 2"
        raise SystemExit(f"{name} runs as mpiexec -n {n} python -m mpi4py benchmarks/{name}.py")
    rows, extra = measure(comm, args)
    env = {"quick": args.quick, "date": time.strftime("%F %T"), "host": socket.gethostname()}
    env |= {"cpus": os.cpu_count(), "torch": torch.__version__, "ranks": comm.Get_size()}
    env["nodes"] = len(set(comm.allgather(MPI.Get_processor_name())))
    env["mpi_library"] = MPI.Get_library_version().strip().splitlines()[0]
    env["THP_MEM_ALLOC_ENABLE"] = os.environ.get("THP_MEM_ALLOC_ENABLE")
    env["loadavg"] = {"start": LOAD_AT_START, "end": os.getloadavg()}
    if comm.Get_rank() == 0:
        write(name, rows, env, args.out, **extra)


def sample(fn, reps: int, warmup: int = 1, min_s: float = 0.0, pause: float = 0.0) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn`` after ``warmup`` untimed ones; more calls
    (up to 100x ``reps``) until ``min_s`` seconds have passed; ``pause`` seconds before each.

    >>> len(sample(lambda: None, reps=5))
    5
    """
    for _ in range(warmup):
        fn()
    out: list[float] = []
    end = time.perf_counter() + min_s
    while len(out) < reps or (time.perf_counter() < end and len(out) < 100 * reps):
        if pause:
            time.sleep(pause)
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def ping_pong(comm, send, recv, reps: int, warmup: int = 1) -> float | None:
    """Rank 0: the median round trip of ``send`` to rank 1 and back into ``recv`` by
    ``Send``/``Recv`` (rank 1 echoes into its ``recv``); None on the other ranks."""
    if comm.Get_rank() == 0:
        ping = lambda: (comm.Send(send, dest=1), comm.Recv(recv, source=1))  # noqa: E731
        return statistics.median(sample(ping, reps, warmup))
    for _ in range(reps + warmup if comm.Get_rank() == 1 else 0):
        comm.Recv(recv, source=0)
        comm.Send(recv, dest=0)
    return None


def costs(comm, fn, reps: int) -> list[dict]:
    """Per rank (on every rank): its process's CPU seconds and voluntary and involuntary
    context switches per call while rank 0 calls ``fn`` ``reps`` times (the others serve).

    >>> costs(comm, lambda: rpc.rpc_sync("worker1", torch.add, (t, 1)), 1000)  # doctest: +SKIP
    [{'cpu_s': 6.1e-05, 'voluntary': 0.01, 'involuntary': 0.02}, {'cpu_s': 5.9e-05, ...}]
    """
    import resource

    def usage() -> tuple[float, int, int]:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime, r.ru_nvcsw, r.ru_nivcsw

    sleep_barrier(comm)
    before = usage()
    for _ in range(reps if comm.Get_rank() == 0 else 0):
        fn()
    sleep_barrier(comm)
    cpu, voluntary, involuntary = (a - b for a, b in zip(usage(), before, strict=True))
    mine = {"cpu_s": cpu / reps, "voluntary": voluntary / reps, "involuntary": involuntary / reps}
    return comm.allgather(mine)


def sleep_barrier(comm) -> None:
    """A barrier that sleeps instead of spinning: waiting ranks leave the CPU to the others."""
    req, delay = comm.Ibarrier(), 1e-4
    while not req.Test():
        time.sleep(delay)
        delay = min(2 * delay, 0.02)


def echo(t: object) -> object:
    """Runs on the callee: its argument, sent back."""
    return t


class Stack:
    """RPC and distributed autograd of one stack on every rank of ``comm`` (a collective
    context manager): ``"ours"`` or ``"tp"`` (``torch.distributed``, TensorPipe's default
    options, its TCP rendezvous on a port chosen by rank 0). Workers are ``worker{rank}``.

    >>> with Stack("ours", comm) as s:  # doctest: +SKIP
    ...     s.rpc.rpc_sync("worker1", torch.add, (torch.ones(2), 1))
    """

    def __init__(self, kind: str, comm) -> None:
        self.kind, self.comm, self.rank, self.size = kind, comm, comm.Get_rank(), comm.Get_size()

    def __enter__(self) -> "Stack":
        url = None
        if self.kind == "ours":
            import lightning_distgrad.autograd as autograd
            import lightning_distgrad.rpc as rpc
        else:
            import torch.distributed.autograd as autograd
            import torch.distributed.rpc as rpc

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = self.comm.bcast(s.getsockname()[1] if self.rank == 0 else None, root=0)
            url = f"tcp://127.0.0.1:{port}"
        options = self.options(rpc, url)
        kwargs = {} if options is None else {"rpc_backend_options": options}
        self.rpc, self.autograd = rpc, autograd
        sleep_barrier(self.comm)
        t0 = time.perf_counter()
        rpc.init_rpc(f"worker{self.rank}", rank=self.rank, world_size=self.size, **kwargs)
        self.init_s = time.perf_counter() - t0
        return self

    def options(self, rpc, url: str | None):
        """The backend options to start with (None: ours's defaults); ``url`` is
        TensorPipe's rendezvous, None for ours."""
        return None if url is None else rpc.TensorPipeRpcBackendOptions(init_method=url)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:  # the other ranks would wait for this one forever
            traceback.print_exception(exc_type, exc, tb)
            self.comm.Abort(1)
        sleep_barrier(self.comm)
        self.rpc.shutdown()


def row(metric: str, ours, anchor, anchor_name: str, unit: str, target=None) -> dict:
    """A value of ours beside its anchor; ``target``: ``("<=" | ">=", limit)`` on the ratio.

    >>> row("8 B round trip", 2e-5, 1e-4, "TensorPipe", "s", ("<=", 0.25))["ok"]
    True
    """
    r = dict(metric=metric, unit=unit, ours=ours, anchor=anchor, anchor_name=anchor_name)
    r["ratio"] = ours / anchor if ours is not None and anchor else None
    r["target"] = None if target is None else f"{target[0]} {target[1]}"
    r["ok"] = None if not target or r["ratio"] is None else _OPS[target[0]](r["ratio"], target[1])
    return r


def mpi_name(library: str) -> str:
    """A short name of an MPI library's version line: ``MPICH 5.0.2``, ``Open MPI 5.0.11``."""
    words = library.replace(",", " ").split()
    if library.startswith("Open MPI"):
        return f"Open MPI {words[2].lstrip('v')}"
    return " ".join(w for w in words[:3] if w != "Version:")


def fmt(value: float | None, unit: str) -> str:
    """A value with its unit, seconds as us or ms."""
    if value is None:
        return "-"
    if unit == "s" and value < 1.0:
        return f"{value * 1e6:.3g} us" if value < 1e-3 else f"{value * 1e3:.3g} ms"
    return f"{value:.0f} {unit}" if abs(value) >= 1000 else f"{value:.3g} {unit}"


def table(rows: list[dict], label=lambda r: r["metric"]) -> str:
    """The rows as a text table, each named by ``label(row)``."""
    w = max([len(label(r)) for r in rows] + [6])
    lines = [f"{'figure':{w}} {'ours':>13} {'anchor':>13}  {'ratio':>6}  target"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3g}"
        verdict = "" if r["ok"] is None else (" PASS" if r["ok"] else " FAIL")
        lines.append(
            f"{label(r):{w}} {fmt(r['ours'], r['unit']):>13} {fmt(r['anchor'], r['unit']):>13}"
            f"  {ratio:>6}  {r['target'] or ''}{verdict}  ({r['anchor_name']})"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str, label=lambda r: r["metric"]) -> None:
    """A bar per row: ours / anchor on a log scale, the target as a black tick."""
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["ratio"]]
    fig, ax = plt.subplots(figsize=(13, 1.2 + 0.28 * len(rows)))
    colors = [{None: "tab:gray", True: "tab:green", False: "tab:red"}[r["ok"]] for r in rows]
    ax.barh(range(len(rows)), [r["ratio"] for r in rows], color=colors)
    for y, r in enumerate(rows):
        if r["target"]:
            ax.plot([float(r["target"].split()[1])] * 2, [y - 0.4, y + 0.4], "k-", lw=2)
    ax.set_yticks(range(len(rows)), [f"{label(r)} / {r['anchor_name']}" for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(1.0, color="k", lw=0.5)
    ax.set_xlabel("ours / anchor (black tick: target; green: met, red: missed)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write(name: str, rows: list[dict], env: dict, out: Path | None = None, **extra) -> None:
    """Print the rows; write them, ``env`` (and this command) and ``extra``, and a plot."""
    env = env | {"command": " ".join(sys.argv)}
    suffix = ".openmpi" if env["mpi_library"].startswith("Open MPI") else ""
    suffix += f".{env['nodes']}nodes" if env["nodes"] > 1 else ""
    path = out or RESULTS / f"{name}{suffix}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"name": name, "env": env, "rows": rows, **extra}, indent=1))
    title = f"{name}: {mpi_name(env['mpi_library'])}, {env['ranks']} ranks, {env['host']}"
    print(f"{title}\n{table(rows)}", flush=True)
    plot(rows, path.with_suffix(".png"), title)
    print(f"wrote {path}", flush=True)


def drive(name: str, args: argparse.Namespace, jobs: dict[str, int], combine) -> None:
    """Run ``name``'s script (``--quick`` passed on) as one MPI job per ``jobs`` entry (tag:
    ranks), each writing ``parts/<name>.<tag>.json`` beside the result; write ``combine(their
    documents) -> (rows, extra)`` as the result."""
    parts = (args.out.resolve().parent if args.out else RESULTS) / "parts"
    mpiexec = Path(sys.executable).with_name("mpiexec")
    version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True).stdout
    flags = ["--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]
    script = [sys.executable, "-m", "mpi4py", Path(__file__).with_name(f"{name}.py")]
    docs = []
    for tag, ranks in jobs.items():
        out = parts / f"{name}.{tag}.json"
        argv = [mpiexec, *(flags if "Open MPI" in version else []), "-n", str(ranks), *script]
        subprocess.run([*argv, "--out", out, *["--quick"] * args.quick], check=True)
        docs.append(json.loads(out.read_text()))
    rows, extra = combine(docs)
    write(name, rows, docs[-1]["env"], args.out, **extra)
