r"""Training throughput of the DDP + RPC hybrid program: ours vs torch.distributed.

Run (4 ranks: trainers 0 and 1, master 2, parameter server 3)::

    mpiexec -n 4 python -m mpi4py benchmarks/bench_hybrid.py [--quick] [--torch tp|tp_uv]

The program is ``examples/ddp_rpc.py`` (PyTorch's "DDP + RPC" tutorial: an
``nn.EmbeddingBag(100, 16, mode="sum")`` on ``ps`` as a RemoteModule, a replicated
``nn.Linear(16, 8)`` on both trainers, cross-entropy, ``DistributedOptimizer(optim.SGD,
lr=0.05)``, the master starting both trainers' loops with ``rpc_async``), with the same model
classes, batch generator (``get_next_batch``) and seeds, written twice:

* ``ours``: ``lightning_distgrad.{rpc,autograd,optim,nn.RemoteModule}`` over MPI, the dense
  layer a ``ReplicatedModule`` (``sync_gradients`` after the backward pass);
* ``tp``: ``torch.distributed.{rpc,autograd,optim}`` and torch's ``RemoteModule`` over
  TensorPipe with its default options, the dense layer in ``DistributedDataParallel`` over a
  gloo process group of the two trainers (``init_method`` ``tcp://127.0.0.1:<port>``, ports
  chosen by rank 0 and broadcast over MPI);
* ``tp_uv`` (``--torch tp_uv``): the same with ``TensorPipeRpcBackendOptions(_transports=
  ["uv"])``. TensorPipe's default shared-memory transport busy-polls (about 0.23 cores per
  process even when idle, measured here): with 4 ranks on a 2-core machine that takes CPU
  from the other ranks, so the TCP (libuv) transport may be the fairer comparison there.

Both stacks run in one job on the same ranks. torch's ``init_rpc`` works again after
``shutdown`` in one process, but its RRef context stays bound to the first agent (every RRef
message of a second session fails with "RPC is no longer running on this node"), so torch
gets one session per job, and one torch variant per job: the schedule is A B A, ``--rounds``
timed runs of ours, ``2 * rounds`` of torch, ``rounds`` of ours again (each stack's RPC is
shut down while the other runs). Every run builds a fresh model (new table on ``ps``, new
dense layers, new optimizer) and the same batches, runs ``warmup`` untimed and ``steps``
timed iterations on each trainer. The schedule is the tutorial's: no barrier between the
trainers' steps (the dense layer's allreduce, DDP's or ours, keeps them in step). A trainer
iteration is one distributed autograd context: forward (an RPC to ``ps``), cross-entropy,
distributed backward (gradients to ``ps``), the dense gradients' allreduce, and the optimizer
step (an RPC to ``ps`` for the table). Throughput is the number of samples (bags) both
trainers processed in the timed window divided by its length (between barriers of the
trainers). Reported: the median samples/s of each stack and their ratio, with the target
ours/torch >= 1.5 as PASS/FAIL; the ratios with ours' runs before and after torch's show drift.

Correctness first: in each stack's session, before the timed runs, a lockstep run (a barrier
after each step makes it reproducible) of 30 steps must end with the parameters and losses of
``examples/ddp_rpc.py``'s single-process ``reference`` within 1e-5 (otherwise FAIL and exit
status 1). Timed runs check that both trainers' dense layers ended identical and that the loss
went down.

The machine may be shared: trainer 0 measures, over each timed window, the CPU time of the
job's 4 processes and of everything else (from ``/proc``); the output shows both (cores).
``--wait-quiet S`` waits up to S s before each run for other processes to go idle.
Rank 2 (the master) prints the results and writes ``benchmarks/results/<tag>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import torch  # noqa: E402
from _common import (  # noqa: E402
    REPO,
    RESULTS_DIR,
    base_env,
    free_port,
    load_average,
    quiet_barrier,
    start_watchdog,
    system_busy_s,
)
from mpi4py import MPI  # noqa: E402
from torch import nn, optim  # noqa: E402

sys.path.insert(0, str(REPO / "examples"))

import ddp_rpc  # noqa: E402  (model, batch generator, seeds and the reference)

TRAINERS, MASTER, PS = ddp_rpc.TRAINERS, ddp_rpc.MASTER, ddp_rpc.PS
LABELS = {
    "ours": "ours (MPI, ReplicatedModule)",
    "tp": "torch (TensorPipe default + DDP/gloo)",
    "tp_uv": "torch (TensorPipe uv only + DDP/gloo)",
}
TARGET = 1.5
CHECK_EPOCHS = 3  # lockstep correctness run: 3 epochs of 10 batches
ATOL = 1e-5


def polite_barrier(comm: MPI.Comm) -> None:
    """A sleeping barrier with short sleeps (a trainer step takes milliseconds)."""
    quiet_barrier(comm, max_sleep=0.002, first_sleep=1e-4)


# --------------------------------------------------------------------------------------------
# CPU accounting (Linux /proc)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (0.0 if unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


class CpuMeter:
    """Job and foreign CPU use (cores) between ``start`` and ``stop``."""

    def __init__(self, pids: list[int]):
        self.pids = pids

    def sample(self) -> tuple[float, float | None, float]:
        return (time.perf_counter(), system_busy_s(), sum(process_cpu_s(p) for p in self.pids))

    @staticmethod
    def cores(a, b) -> dict:
        wall = b[0] - a[0]
        job = (b[2] - a[2]) / wall
        foreign = None if a[1] is None else max(0.0, (b[1] - a[1]) / wall - job)
        return {"job_cores": job, "foreign_cores": foreign}


def wait_quiet_here(pids: list[int], max_wait: float, threshold: float = 0.3):
    """Wait (at most max_wait s) until processes outside the job use < threshold cores.

    Called by the master between runs (the other ranks idle meanwhile); returns the last
    measured foreign load (cores), None if not measured.
    """
    foreign = None
    if max_wait > 0 and system_busy_s() is not None:
        meter, deadline = CpuMeter(pids), time.perf_counter() + max_wait
        while True:
            a = meter.sample()
            time.sleep(0.5)
            foreign = CpuMeter.cores(a, meter.sample())["foreign_cores"]
            if foreign < threshold or time.perf_counter() > deadline:
                break
    return foreign


# --------------------------------------------------------------------------------------------
# The trainers' loop, shared by both stacks


class Plan:
    def __init__(self, warmup: int, steps: int, lockstep: bool, seed: int = ddp_rpc.SEED):
        self.warmup, self.steps, self.lockstep, self.seed = warmup, steps, lockstep, seed


def batch_stream(rank: int, seed: int):
    next_epoch = ddp_rpc.get_next_batch(rank, seed)
    while True:
        yield from next_epoch()


_state: dict = {}  # per process: the trainers' MPI communicator, the pids, the meter


def trainer_loop(rank: int, plan: Plan, step_fn, fc: nn.Module) -> dict:
    """Run ``plan.warmup`` + ``plan.steps`` iterations of ``step_fn(indices, offsets, target)``;
    time the last ``plan.steps`` between barriers of the trainers."""
    comm: MPI.Intracomm = _state["trainers"]
    data = batch_stream(rank, plan.seed)
    losses, samples = [], 0
    t0 = cpu0 = None
    for i in range(plan.warmup + plan.steps):
        if i == plan.warmup:
            polite_barrier(comm)
            t0 = time.perf_counter()
            if comm.Get_rank() == 0:
                cpu0 = _state["meter"].sample()
        indices, offsets, target = next(data)
        losses.append(step_fn(indices, offsets, target))
        if i >= plan.warmup:
            samples += len(offsets)
        if plan.lockstep:
            polite_barrier(comm)
    polite_barrier(comm)
    t1 = time.perf_counter()
    cpu = CpuMeter.cores(cpu0, _state["meter"].sample()) if cpu0 is not None else None
    return {
        "elapsed": t1 - (t0 if t0 is not None else t1),
        "samples": samples,
        "losses": losses,
        "cpu": cpu,
        "fc": {k: v.detach().clone() for k, v in fc.state_dict().items()},
    }


def make_step(model: nn.Module, rpc, dist_autograd, optimizer_cls, sync_fc: bool):
    """The training step ``step(indices, offsets, target) -> loss`` with one stack's ``rpc``,
    ``dist_autograd`` and ``DistributedOptimizer`` class; ``sync_fc``: allreduce the dense
    layer's gradients explicitly (ours' ReplicatedModule; DDP does it inside the backward)."""
    params = model.remote_emb_module.remote_parameters()
    params += [rpc.RRef(p) for p in model.fc.parameters()]
    opt = optimizer_cls(optim.SGD, params, lr=ddp_rpc.LR)
    criterion = nn.CrossEntropyLoss()

    def step(indices, offsets, target) -> float:
        with dist_autograd.context() as context_id:
            loss = criterion(model(indices, offsets), target)
            dist_autograd.backward(context_id, [loss])  # torch: DDP's allreduce runs here
            if sync_fc:
                model.fc.sync_gradients(context_id)
            opt.step(context_id)
        return loss.item()

    return step


def _run_trainer_ours(remote_emb_module, rank: int, plan: Plan) -> dict:
    import lightning_distgrad.autograd as dist_autograd
    from lightning_distgrad import rpc
    from lightning_distgrad.optim import DistributedOptimizer

    model = ddp_rpc.HybridModel(remote_emb_module, _state["trainers"], plan.seed)
    step = make_step(model, rpc, dist_autograd, DistributedOptimizer, sync_fc=True)
    out = trainer_loop(rank, plan, step, model.fc.module)
    model.fc.comm.Free()
    return out


class TorchHybridModel(nn.Module):
    """The tutorial's HybridModel with torch's DDP (CPU, gloo)."""

    def __init__(self, remote_emb_module, seed: int):
        from torch.nn.parallel import DistributedDataParallel as DDP

        super().__init__()
        self.remote_emb_module = remote_emb_module
        self.fc = DDP(ddp_rpc.seeded_linear(ddp_rpc.EMBEDDING_DIM, ddp_rpc.NUM_CLASSES, seed))

    def forward(self, indices, offsets):
        return self.fc(self.remote_emb_module.forward(indices, offsets))


def _run_trainer_torch(remote_emb_module, rank: int, plan: Plan) -> dict:
    import torch.distributed.autograd as dist_autograd
    from torch.distributed import rpc
    from torch.distributed.optim import DistributedOptimizer

    model = TorchHybridModel(remote_emb_module, plan.seed)
    step = make_step(model, rpc, dist_autograd, DistributedOptimizer, sync_fc=False)
    return trainer_loop(rank, plan, step, model.fc.module)


# --------------------------------------------------------------------------------------------
# One session of one stack (a collective of the 4 ranks): init, the master's runs, shutdown


def role_name(rank: int) -> str:
    return {MASTER: "master", PS: "ps"}.get(rank, f"trainer{rank}")


def _torch_state_dict(module_rref) -> dict:
    return {k: v.detach().clone() for k, v in module_rref.local_value().state_dict().items()}


class Session:
    """``backend``'s RPC (and, for torch, the trainers' gloo process group) on every rank."""

    def __init__(self, backend: str, comm: MPI.Comm):
        self.backend, self.comm, self.rank = backend, comm, comm.Get_rank()
        self.torch = backend != "ours"

    def __enter__(self) -> Session:
        name = role_name(self.rank)
        if not self.torch:
            from lightning_distgrad import rpc
            from lightning_distgrad.nn import RemoteModule

            rpc.init_rpc(name)
            self.trainer_fn = _run_trainer_ours
        else:
            import torch.distributed as dist
            from torch.distributed import rpc
            from torch.distributed.nn.api.remote_module import RemoteModule

            ports = self.comm.bcast((free_port(), free_port()) if self.rank == 0 else None, 0)
            if self.rank in TRAINERS:
                dist.init_process_group(
                    "gloo",
                    rank=self.rank,
                    world_size=len(TRAINERS),
                    init_method=f"tcp://127.0.0.1:{ports[1]}",
                )
            kwargs = {"_transports": ["uv"]} if self.backend == "tp_uv" else {}
            options = rpc.TensorPipeRpcBackendOptions(
                init_method=f"tcp://127.0.0.1:{ports[0]}", **kwargs
            )
            rpc.init_rpc(
                name, rank=self.rank, world_size=self.comm.Get_size(), rpc_backend_options=options
            )
            self.trainer_fn = _run_trainer_torch
        self.rpc, self.RemoteModule = rpc, RemoteModule
        return self

    def run(self, plan: Plan) -> dict:
        """On the master: a fresh model (table on ps, dense layers on the trainers), trained."""
        rpc = self.rpc
        emb = self.RemoteModule(
            "ps",
            ddp_rpc.SeededEmbeddingBag,
            args=(ddp_rpc.NUM_EMBEDDINGS, ddp_rpc.EMBEDDING_DIM),
            kwargs={"mode": "sum", "seed": plan.seed},
        )
        # No RPC timeout (0): the whole run is this call; torch's default 60 s is too short
        # for TensorPipe's spinning transport on a busy machine.
        futs = [
            rpc.rpc_async(f"trainer{t}", self.trainer_fn, args=(emb, t, plan), timeout=0)
            for t in TRAINERS
        ]
        results = {"trainers": [f.wait() for f in futs]}
        state = (
            rpc.rpc_sync("ps", _torch_state_dict, (emb.get_module_rref(),))
            if self.torch
            else emb.remote_state_dict()
        )
        results["emb.weight"] = state["weight"]
        return results

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:  # the others would wait for this rank forever
            from lightning_distgrad.rpc._abort import abort_mpi_job

            traceback.print_exception(exc_type, exc, tb)
            abort_mpi_job(
                f"bench_hybrid: {self.backend} failed on rank {self.rank}; aborting the job\n"
            )
        # Every rank waits here (sleeping) until the master is done: torch's graceful shutdown
        # gives up after its store timeout if others are still busy.
        polite_barrier(self.comm)
        self.rpc.shutdown()
        if self.torch and self.rank in TRAINERS:
            import torch.distributed as dist

            dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Checks and summary (master)


def check_against_reference(backend: str, results: dict, reference: dict) -> list[str]:
    problems = []
    got = {"emb.weight": results["emb.weight"]}
    got.update({f"fc.{k}": v for k, v in results["trainers"][0]["fc"].items()})
    for key, expected in reference["params"].items():
        err = (got[key] - expected).abs().max().item()
        if not err <= ATOL:
            problems.append(f"{backend}: {key} differs from the reference by {err:.2e}")
    for t, r in enumerate(results["trainers"]):
        err = max(abs(a - b) for a, b in zip(r["losses"], reference["losses"][t], strict=True))
        if not err <= ATOL:
            problems.append(
                f"{backend}: trainer{t}'s losses differ from the reference by {err:.2e}"
            )
    return problems


def check_run(backend: str, results: dict) -> list[str]:
    problems = []
    fcs = [r["fc"] for r in results["trainers"]]
    if not all(torch.equal(fcs[0][k], f[k]) for f in fcs for k in f):
        problems.append(f"{backend}: the trainers' dense layers differ after the run")
    for t, r in enumerate(results["trainers"]):
        first = statistics.mean(r["losses"][:20])
        last = statistics.mean(r["losses"][-20:])
        if not last < first:
            problems.append(
                f"{backend}: trainer{t}'s loss did not go down ({first:.3f} -> {last:.3f})"
            )
    return problems


def measurement(results: dict) -> dict:
    trainers = results["trainers"]
    elapsed = max(r["elapsed"] for r in trainers)
    samples = sum(r["samples"] for r in trainers)
    cpu = trainers[0]["cpu"] or {}
    return {
        "samples_per_s": samples / elapsed,
        "elapsed_s": elapsed,
        "samples": samples,
        "steps_per_trainer": len(trainers[0]["losses"]),
        "job_cores": cpu.get("job_cores"),
        "foreign_cores": cpu.get("foreign_cores"),
        "final_loss_mean_last20": [statistics.mean(r["losses"][-20:]) for r in trainers],
    }


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


# --------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short runs (a few minutes in all)")
    ap.add_argument(
        "--torch",
        choices=("tp", "tp_uv"),
        default="tp",
        help="the torch stack: TensorPipe with default transports (tp) or with "
        "_transports=['uv'] (tp_uv); one per job (default tp)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="timed runs of ours before and after torch's (torch gets twice as "
        "many); default 2, quick 1",
    )
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per trainer per run (default 200, quick 60)",
    )
    ap.add_argument(
        "--warmup", type=int, default=None, help="untimed steps per run (default 20, quick 10)"
    )
    ap.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="skip the lockstep correctness runs against the reference",
    )
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="before each timed run wait up to S s for other processes to go idle",
    )
    ap.add_argument(
        "--tag", default=None, help="output file stem (default bench_hybrid[_uv][_quick])"
    )
    ap.add_argument("--timeout", type=float, default=1200, help="abort the job after this many s")
    args = ap.parse_args()
    rounds = args.rounds or (1 if args.quick else 2)
    steps = args.steps or (60 if args.quick else 200)
    warmup = args.warmup if args.warmup is not None else (10 if args.quick else 20)
    tp = args.torch
    tag = args.tag or (
        "bench_hybrid" + ("_uv" if tp == "tp_uv" else "") + ("_quick" if args.quick else "")
    )

    warnings.filterwarnings("ignore")  # torch RPC / DistributedOptimizer deprecation noise
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    if size != 4:
        if rank == 0:
            print(
                "bench_hybrid needs 4 ranks: mpiexec -n 4 python -m mpi4py "
                "benchmarks/bench_hybrid.py",
                flush=True,
            )
        return 2

    timer = start_watchdog(
        args.timeout, f"[rank {rank}] bench_hybrid: timeout after {args.timeout} s", sys.stderr
    )

    trainers = comm.Split(0 if rank in TRAINERS else MPI.UNDEFINED, rank)
    pids = comm.allgather(os.getpid())
    _state.update(trainers=trainers, meter=CpuMeter(pids))
    master = rank == MASTER

    def say(line: str) -> None:
        if master:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    env = base_env() | {"loadavg_start": load_average()}
    say(
        f"bench_hybrid: {env['host']}, {env['cpus']} CPUs, torch {env['torch']}, "
        f"{env['mpi_library']}; load average {env['loadavg_start']}"
    )
    say(
        f"schedule: ours x{rounds}, {tp} x{2 * rounds}, ours x{rounds} timed runs of "
        f"{warmup} + {steps} timed steps per trainer"
    )
    t_start = time.perf_counter()
    problems: list[str] = []
    checks: dict = {}
    runs: list[dict] = []
    reference = ddp_rpc.reference(epochs=CHECK_EPOCHS) if master and args.check else None
    check_plan = Plan(0, CHECK_EPOCHS * ddp_rpc.BATCHES_PER_EPOCH, lockstep=True)
    plan = Plan(warmup, steps, lockstep=False)

    # torch's RPC can be initialised again after shutdown, but its RRef context stays bound to
    # the first agent (RRef messages then fail: "RPC is no longer running on this node"), so
    # torch gets one session per process: ours before and after it (A B A).
    schedule = [("ours", "before", rounds), (tp, "", 2 * rounds), ("ours", "after", rounds)]
    for i, (backend, phase, n) in enumerate(schedule):
        with Session(backend, comm) as session:
            if not master:
                continue
            if args.check and phase != "after":
                found = check_against_reference(backend, session.run(check_plan), reference)
                checks[backend] = found or "ok"
                problems += found
                say(
                    f"check {backend:6s}: {'ok' if not found else 'FAIL'} ({check_plan.steps} "
                    "lockstep steps; final parameters and losses vs the single-process "
                    "reference, within 1e-5)"
                )
            for r in range(n):
                quiet = wait_quiet_here(pids, args.wait_quiet)
                results = session.run(plan)
                m = measurement(results)
                m.update(block=i, backend=backend, phase=phase, foreign_before=quiet)
                runs.append(m)
                found = check_run(backend, results)
                problems += found
                say(
                    f"{backend:6s} {phase:6s} run {r}: {m['samples_per_s']:8.1f} samples/s "
                    f"({m['samples']} samples in {m['elapsed_s']:.2f} s; job "
                    f"{fmt(m['job_cores'])} cores, others {fmt(m['foreign_cores'])} cores)"
                    + ("" if not found else "  " + "; ".join(found))
                )
    timer.cancel()
    if trainers != MPI.COMM_NULL:
        trainers.Free()
    if not master:
        return 0

    # Summary.
    def med(backend: str, phase: str | None = None) -> float:
        return statistics.median(
            m["samples_per_s"]
            for m in runs
            if m["backend"] == backend and (phase is None or m["phase"] == phase)
        )

    summary = {}
    for backend in ("ours", tp):
        mine = [m for m in runs if m["backend"] == backend]
        summary[backend] = {
            "samples_per_s_median": med(backend),
            "samples_per_s_all": [m["samples_per_s"] for m in mine],
            "job_cores_median": statistics.median(m["job_cores"] or 0 for m in mine),
            "foreign_cores_median": statistics.median(m["foreign_cores"] or 0 for m in mine),
        }
    ratio = med("ours") / med(tp)
    ratios = {
        f"ours/{tp}": {
            "ratio": ratio,
            "target": TARGET,
            "pass": ratio >= TARGET,
            "ours_before/torch": med("ours", "before") / med(tp),
            "ours_after/torch": med("ours", "after") / med(tp),
        }
    }
    lines = ["", f"{'stack':42s} {'samples/s':>10s} {'job cores':>10s} {'other cores':>12s}"]
    for backend in ("ours", tp):
        s_ = summary[backend]
        lines.append(
            f"{LABELS[backend]:42s} {s_['samples_per_s_median']:10.1f} "
            f"{s_['job_cores_median']:10.2f} {s_['foreign_cores_median']:12.2f}"
        )
    v = ratios[f"ours/{tp}"]
    lines += [
        "",
        f"ours/{tp}: {ratio:.2f}x (ours before torch's runs "
        f"{v['ours_before/torch']:.2f}x, after {v['ours_after/torch']:.2f}x); "
        f"target >= {TARGET}x: " + ("PASS" if v["pass"] else "FAIL"),
    ]
    if problems:
        lines.append("")
        lines += [f"FAIL  {p}" for p in problems]
    else:
        lines.append(
            "checks: all passed ("
            + ("reference match in lockstep, " if args.check else "")
            + "identical dense layers on both trainers, loss going down)"
        )
    env["loadavg_end"] = load_average()
    lines.append(
        f"load average {env['loadavg_start']} -> {env['loadavg_end']}; "
        f"{time.perf_counter() - t_start:.0f} s"
    )
    say("\n".join(lines))
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / f"{tag}.json"
    out.write_text(
        json.dumps(
            {
                "command": "mpiexec -n 4 python -m mpi4py " + " ".join(sys.argv),
                "env": env,
                "rounds": rounds,
                "warmup": warmup,
                "steps": steps,
                "torch": tp,
                "checks": checks,
                "summary": summary,
                "ratios": ratios,
                "runs": runs,
                "problems": problems,
                "report": lines,
            },
            indent=1,
        )
    )
    say(f"wrote {out.relative_to(REPO)}")
    return 1 if problems else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # Every rank must agree on the exit status (only the master knows about failures).
    code = MPI.COMM_WORLD.allreduce(code, op=MPI.MAX)
    sys.exit(code)
