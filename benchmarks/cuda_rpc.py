"""CUDA tensors over RPC between 2 ranks sharing one GPU: ours vs TensorPipe, in one run.

Both ranks use cuda:0, with device maps {0: 0} both ways; rank 0 calls rank 1. Rank 0 times
``rpc_sync(echo)`` of float32 tensors of 1 MiB, 16 MiB, 256 MiB and 1 GiB (throughput ``2 *
bytes / round trip``, the GPU synchronised before and after each call, the echo compared with
what was sent once per size), and the design note's iteration (design_note.py) on the GPU at
1024x1024 and 4096x4096. Variants: ``ours`` (CUDA IPC between the ranks of a node),
``ours-staged`` (``LIGHTNING_DISTGRAD_CUDA_IPC=0``: through host memory) and ``tp``
(TensorPipe); each row is a variant of ours over TensorPipe.

``python benchmarks/cuda_rpc.py`` runs one ``mpiexec -n 2`` job per variant: a variant that
fails or hangs is killed and recorded and the others still run. Under ``mpiexec -n 2`` the
script runs the variants one after another in that job. Each measurement is in its own
``try``: an error is recorded in the result, not raised. ``--time-limit`` caps the whole run.
``--device cpu`` is a smoke test of the plumbing with CPU tensors (no device maps, small
sizes); it writes /tmp/cuda_rpc.cpu-smoke.json, never results/."""

import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from statistics import median

import torch
from _harness import (
    RESULTS,
    TP,
    GiB,
    MiB,
    Stack,
    echo,
    parse,
    row,
    run,
    sample,
    write,
)
from design_note import check, inputs, iteration

STARTED = time.monotonic()
IPC_ENV = "LIGHTNING_DISTGRAD_CUDA_IPC"  # read by our init_rpc
VARIANTS = {"ours": ("ours", {}), "ours-staged": ("ours", {IPC_ENV: "0"}), "tp": ("tp", {})}
VS_TP = {"ours": "", "ours-staged": ", IPC off"}  # each is a row over TensorPipe: metric suffix
# size: timed calls; few for big sizes (a staged 1 GiB round trip may take a second)
ECHO = {MiB: 50, 16 * MiB: 30, 256 * MiB: 10, GiB: 5}
ITERATION = {1024: 30, 4096: 10}  # n: timed iterations at n x n
QUICK = {MiB: 10, 16 * MiB: 5}, {1024: 5}
CPU = {MiB: 10, 16 * MiB: 5}, {256: 5}
RPC_TIMEOUT_S = 30  # a lost call fails well inside a variant's share of the time limit
MARGIN_S = 12  # of a variant's share, kept for its shutdown


def label(nbytes: int) -> str:
    return f"{nbytes // GiB} GiB" if nbytes >= GiB else f"{nbytes // MiB} MiB"


def plan(args) -> tuple[dict, dict]:
    """(echo sizes, iteration sizes), each with its timed repetitions."""
    return CPU if args.device == "cpu" else QUICK if args.quick else (ECHO, ITERATION)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def error_text(e: BaseException, where: str) -> str:
    """The error's last line, for the result; its traceback goes to stderr (a job's log)."""
    print(f"cuda_rpc: {where}: {traceback.format_exc()}", file=sys.stderr, flush=True)
    return "".join(traceback.format_exception_only(type(e), e)).strip()[-2000:]


class DeviceStack(Stack):
    """``Stack`` with device maps {0: 0} to the other worker (none for CPU tensors) and a
    shorter RPC timeout; ``Stack`` itself starts both stacks with their default options."""

    def __init__(self, kind: str, comm, device: torch.device) -> None:
        super().__init__(kind, comm)
        self.device = device

    def options(self, rpc, url: str | None):
        if url is None:
            options = rpc.MPIRpcBackendOptions(rpc_timeout=RPC_TIMEOUT_S)
        else:
            options = rpc.TensorPipeRpcBackendOptions(init_method=url, rpc_timeout=RPC_TIMEOUT_S)
        if self.device.type == "cuda":
            options.set_device_map(f"worker{1 - self.rank}", {0: 0})
        return options


def time_echo(s: DeviceStack, nbytes: int, reps: int) -> dict:
    """Rank 0: the median round trip of ``rpc_sync(echo)`` of ``nbytes`` on ``s.device``."""
    sent = torch.arange(nbytes // 4, dtype=torch.float32, device=s.device)
    got = s.rpc.rpc_sync("worker1", echo, (sent,))
    sync(s.device)  # the bytes are ready when rpc_sync returns; this is only a safeguard
    correct = got.device == sent.device and torch.equal(got, sent)
    out = {"device_back": str(got.device), "correct": correct}
    del got
    # the synchronisation closes each call: the clock of the next one starts on an idle GPU
    call = lambda: (s.rpc.rpc_sync("worker1", echo, (sent,)), sync(s.device))
    sample(call, 1, warmup=0, min_s=0.2)  # a waking agent runs slower for a while
    times = sample(call, reps, warmup=0)
    rt = median(times)
    out |= {"round_trip_s": rt, "min_round_trip_s": min(times), "reps": len(times)}
    # The same values from a tensor of its own each call: what a fresh activation costs.
    fresh = iter([sent.clone() for _ in range(reps)])
    sync(s.device)
    fresh_times = sample(
        lambda: (s.rpc.rpc_sync("worker1", echo, (next(fresh),)), sync(s.device)), reps, warmup=0
    )
    out["fresh_gbps"] = 2 * nbytes / median(fresh_times) / 1e9
    return out | {"gbps": 2 * nbytes / rt / 1e9}


def time_iteration(s: DeviceStack, n: int, reps: int) -> dict:
    """Rank 0: the median design-note iteration at ``n`` x ``n`` on ``s.device``; its first
    gradients checked against local autograd's."""
    t1, t2 = (t.detach().to(s.device).requires_grad_() for t in inputs(n))
    out: dict = {"correct": True}
    try:
        check(iteration(s.rpc, s.autograd, t1, t2), t1, t2, f"{s.kind} {n}x{n}")
    except AssertionError as e:  # wrong gradients are a finding; the timing still counts
        out = {"correct": False, "check_error": error_text(e, f"{s.kind} {n}x{n} check")}
    step = lambda: (iteration(s.rpc, s.autograd, t1, t2), sync(s.device))
    sample(step, 3, warmup=0, min_s=0.3)  # a waking agent runs slower for a while
    times = sample(step, reps, warmup=0)
    return out | {"s": median(times), "ms": median(times) * 1e3, "reps": len(times)}


def attempt(deadline: float, fn, *args) -> dict:
    """``fn(*args)``, or its error; skipped past ``deadline``. Big tensors are freed after."""
    if time.monotonic() > deadline:
        return {"error": "skipped: past this variant's share of --time-limit"}
    try:
        return fn(*args)
    except Exception as e:
        return {"error": error_text(e, f"{fn.__name__}{args[1:]}")}
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_variant(comm, name: str, device: torch.device, sizes, deadline: float, out: dict):
    """Start the variant's stack on both ranks; rank 0 measures into ``out`` (as it goes, for
    the watchdog's partial result); rank 1 serves."""
    kind, env = VARIANTS[name]
    out |= {"stack": kind, "env": env, "echo": {}, "iteration": {}, "error": None}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # on both ranks, before init_rpc reads it
    try:
        with DeviceStack(kind, comm, device) as s:
            out["init_s"] = s.init_s
            for nbytes, reps in sizes[0].items() if comm.Get_rank() == 0 else ():
                out["echo"][str(nbytes)] = attempt(deadline, time_echo, s, nbytes, reps)
            for n, reps in sizes[1].items() if comm.Get_rank() == 0 else ():
                out["iteration"][str(n)] = attempt(deadline, time_iteration, s, n, reps)
    except Exception as e:  # init_rpc or shutdown
        out["error"] = error_text(e, f"{name} start or shutdown")
    finally:
        for k, v in saved.items():  # as it was, for the next variant
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def measure(comm, args) -> tuple[list[dict], dict]:
    """One MPI job: ``args.variants`` one after another, each with an equal share of the time
    left. A watchdog ends the job at ``--time-limit`` (a hung rank would never return),
    rank 0 first writing what it has to ``<result>.partial``."""
    names, rank = args.variants.split(","), comm.Get_rank()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    sizes = plan(args)
    info = {"device": str(device), "gpu": None, "cuda": torch.version.cuda, "errors": []}
    info |= {"echo_bytes": list(sizes[0]), "iteration_n": list(sizes[1]), "variants": {}}
    info["time_limit_s"] = args.time_limit
    partial = {"name": "cuda_rpc", "partial": True, "env": job_env(comm, args), "info": info}
    left = lambda: args.time_limit - (time.monotonic() - STARTED)
    watchdog = threading.Timer(max(1.0, left()), abort, (comm, partial_path(args), partial))
    watchdog.daemon = True
    watchdog.start()
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)  # its context made now, not in a timed call
            info["gpu"] = torch.cuda.get_device_name(device)
    except Exception as e:  # the measurements will record what follows from it
        info["errors"].append(f"cuda: {error_text(e, 'cuda')}")
    for i, name in enumerate(names):
        deadline = time.monotonic() + left() / (len(names) - i) - MARGIN_S
        run_variant(comm, name, device, sizes, deadline, info["variants"].setdefault(name, {}))
    watchdog.cancel()
    info["errors"] += errors(info["variants"])
    if rank == 0:
        print(summary(info), flush=True)
    return rows(info), info


def job_env(comm, args) -> dict:
    """The job's machine and MPI as ``_harness.run`` records them (collective), for a partial
    result, written before ``run`` would write them."""
    from mpi4py import MPI

    env = {"quick": args.quick, "date": time.strftime("%F %T"), "host": socket.gethostname()}
    env |= {"cpus": os.cpu_count(), "torch": torch.__version__, "ranks": comm.Get_size()}
    env["nodes"] = len(set(comm.allgather(MPI.Get_processor_name())))
    env["mpi_library"] = MPI.Get_library_version().strip().splitlines()[0]
    return env | {"command": " ".join(sys.argv)}


def partial_path(args) -> Path:
    """Where the watchdog writes: not ``*.json``, so report.py never reads it."""
    out = args.out or RESULTS / "cuda_rpc.json"
    return out.with_name(out.name + ".partial")


def abort(comm, path: Path, partial: dict) -> None:
    """The watchdog: rank 0 writes what it has measured; the job ends."""
    print("cuda_rpc: --time-limit reached, ending the job", file=sys.stderr, flush=True)
    if comm.Get_rank() == 0:
        try:
            info = partial.pop("info")
            info["errors"] = info["errors"] + errors(info["variants"]) + ["job: --time-limit"]
            path.write_text(json.dumps(partial | info, indent=1, default=str))
            print(f"cuda_rpc: wrote {path}", file=sys.stderr, flush=True)
        except Exception as e:
            error_text(e, "no partial result")
    else:
        time.sleep(2)  # rank 0 writes before this rank's Abort ends the job
    comm.Abort(3)


def errors(variants: dict) -> list[str]:
    """Every recorded error as ``variant what: text``."""
    out = []
    for name, v in variants.items():
        out += [f"{name}: {v['error']}"] if v.get("error") else []
        for what in ("echo", "iteration"):
            for size, r in v.get(what, {}).items():
                if r.get("error") or r.get("check_error"):
                    out.append(f"{name} {what} {size}: {r.get('error') or r['check_error']}")
    return out


def rows(info: dict) -> list[dict]:
    """A row per size and variant of ours, over TensorPipe."""
    v = info["variants"]
    get = lambda name, what, size: v.get(name, {}).get(what, {}).get(str(size), {})
    on = "CPU" if info["device"] == "cpu" else "GPU"
    figures = [("echo", n, f"rpc_sync echo {label(n)} on {on}: throughput", "gbps", "GB/s")
               for n in info["echo_bytes"]]  # fmt: skip
    figures += [("iteration", n, f"design-note iteration {n}x{n} on {on}", "s", "s")
                for n in info["iteration_n"]]  # fmt: skip
    out = []
    for what, size, metric, key, unit in figures:
        for name, suffix in VS_TP.items():
            if name not in v:
                continue
            ours, tp = get(name, what, size), get("tp", what, size)
            r = row(metric + suffix, ours.get(key), tp.get(key), TP, unit)
            flags = [ours.get("correct"), tp.get("correct")]
            r["correct"] = False if False in flags else (True if all(flags) else None)
            out.append(r)
    return out


def summary(info: dict) -> str:
    """Each variant's GB/s per echo size and ms per iteration; ``!``: wrong result, ``ERR``:
    an error, ``-``: not run."""
    heads = [label(n) for n in info["echo_bytes"]] + [f"it {n}" for n in info["iteration_n"]]
    lines = [f"{info['gpu'] or info['device']}: GB/s per echo, ms per iteration",
             f"{'variant':12}" + "".join(f"{h:>11}" for h in heads)]  # fmt: skip
    for name, v in info["variants"].items():
        echo, it = v.get("echo", {}), v.get("iteration", {})
        cells = [(echo.get(str(n)), "gbps") for n in info["echo_bytes"]]
        cells += [(it.get(str(n)), "ms") for n in info["iteration_n"]]
        texts = []
        for r, key in cells:
            if r is None:  # not run: its stack did not start, or the job ended
                text = "ERR" if v.get("error") else "-"
            else:
                text = "ERR" if key not in r else f"{r[key]:.3g}"
            texts.append(text + ("!" if r and r.get("correct") is False else ""))
        lines.append(f"{name:12}" + "".join(f"{t:>11}" for t in texts))
    return "\n".join(lines + [f"error: {e[:300]}" for e in info["errors"]])


def drive(args) -> None:
    """One ``mpiexec -n 2`` job per variant, each with an equal share of ``--time-limit``,
    killed (its whole process group) if it overruns; their results combined."""
    parts = (args.out.resolve().parent if args.out else RESULTS) / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    mpiexec = Path(sys.executable).with_name("mpiexec")  # the MPI of this Python's mpi4py
    mpiexec = str(mpiexec if mpiexec.exists() else shutil.which("mpiexec") or "mpiexec")
    version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True).stdout
    flags = ["--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]
    names = args.variants.split(",")
    share = args.time_limit / len(names)
    docs, variants = [], {}
    for name in names:
        out, log = parts / f"cuda_rpc.{name}.json", parts / f"cuda_rpc.{name}.log"
        partial = out.with_name(out.name + ".partial")
        for old in (out, partial):
            old.unlink(missing_ok=True)
        argv = [mpiexec, *(flags if "Open MPI" in version else []), "-n", "2", sys.executable]
        argv += ["-m", "mpi4py", str(Path(__file__).resolve()), "--variants", name]
        argv += ["--device", args.device, "--time-limit", f"{share:.0f}", "--out", str(out)]
        argv += ["--quick"] * args.quick
        print(f"cuda_rpc: job {name} ({share:.0f} s at most)", flush=True)
        job = run_job(argv, share + 10, log)  # the job's watchdog ends it first
        doc = read_doc(out) or read_doc(partial)
        docs += [doc] if doc else []
        failed = {"error": f"job failed (exit status {job['status']}); see {log}"}
        variants[name] = (doc or {}).get("variants", {}).get(name) or failed
        variants[name]["job"] = job
        if doc and doc.get("partial"):  # the watchdog's: what came before the time limit
            variants[name] |= {"partial": True, "error": "job ended at its --time-limit share"}
    if not docs:
        raise SystemExit(f"cuda_rpc: every job failed; see {parts}/cuda_rpc.*.log")
    info = {k: v for k, v in docs[0].items() if k not in ("name", "env", "rows", "partial")}
    info["gpu"] = next((d["gpu"] for d in docs if d["gpu"]), None)
    info["variants"], info["time_limit_s"] = variants, args.time_limit
    cuda = [e for d in docs for e in d["errors"] if e.startswith("cuda:")]
    info["errors"] = list(dict.fromkeys(cuda))  # each job's, once
    info["errors"] += errors(variants)
    env = docs[-1]["env"] | {"quick": args.quick}
    print(summary(info), flush=True)
    write("cuda_rpc", rows(info), env, args.out, **info)


def read_doc(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_job(argv: list[str], timeout: float, log: Path) -> dict:
    """Run one job, its stderr into ``log``; its exit status, time and stderr's end."""
    t0 = time.monotonic()
    with log.open("w") as f:  # its own session: on a timeout, the ranks are killed with it
        p = subprocess.Popen(argv, stderr=f, start_new_session=True)
        try:
            status = p.wait(timeout)
        except subprocess.TimeoutExpired:
            for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, None)):
                try:
                    os.killpg(p.pid, sig)
                    p.wait(wait)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            status = f"killed after {timeout:.0f} s"
    tail = log.read_text(errors="replace")[-2000:]
    if status != 0:
        print(f"cuda_rpc: job exit status {status}; its stderr ends:\n{tail}", file=sys.stderr)
    return {"status": status, "wall_s": time.monotonic() - t0, "stderr_tail": tail}


def launched_by_mpi() -> bool:
    """Whether an MPI launcher started this process (MPICH/Hydra, Open MPI, PMIx)."""
    return any(k in os.environ for k in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"))


if __name__ == "__main__":
    args = parse(
        __doc__,
        device={"choices": ["cuda", "cpu"], "default": "cuda", "help": "cpu: a smoke test"},
        variants={
            "default": ",".join(VARIANTS),
            "help": "comma-separated, of: ours,ours-staged,tp",
        },
        time_limit={"type": float, "default": 180.0, "help": "seconds for the whole run"},
    )
    if args.device == "cpu" and args.out is None:  # nothing from a smoke test lands in results/
        args.out = Path("/tmp/cuda_rpc.cpu-smoke.json")
    if unknown := set(args.variants.split(",")) - set(VARIANTS):
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    run("cuda_rpc", 2, measure, args) if launched_by_mpi() else drive(args)
