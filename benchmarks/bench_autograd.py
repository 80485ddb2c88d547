"""Distributed autograd benchmark: ours vs torch.distributed.autograd over TensorPipe.

Run (2 ranks on one node; rank 0 drives, rank 1 serves)::

    mpiexec -n 2 python -m mpi4py benchmarks/bench_autograd.py [--quick]

On a quiet 2-core machine ``--quick`` takes well under a minute and the default run
about a minute. On a busy one every iteration gets slower: steps stop early
(``SIZE_CAP_S``) and no new round starts after ``--max-time``, so the runs stay within
about 1.5 and 5 minutes (fewer rounds then; the report says how busy the machine was).

Measured, side by side in one run (rounds interleave the steps, rotating their order):

* ``ours`` / ``tp``: the design note's example per full iteration, with
  ``lightning_distgrad.{rpc,autograd}`` and with ``torch.distributed.{rpc,autograd}`` over
  TensorPipe (default options, started inside the same MPI job: rank/world size from MPI,
  ``tcp://127.0.0.1:<port>``, a fresh port each time, chosen by rank 0). Torch's
  ``init_rpc`` works again after ``shutdown`` in one process (as ``bench_rpc.py`` found;
  a step that fails is reported and left out of later rounds), so every round
  re-initialises both stacks::

      with dist_autograd.context() as ctx:
          t3 = rpc.rpc_sync("worker1", torch.add, (t1, t2))
          t4 = rpc.rpc_sync("worker1", torch.mul, (t1, t2))
          loss = (t3 * t4).sum()
          dist_autograd.backward(ctx, [loss])
          grads = dist_autograd.get_gradients(ctx)

  timed from context enter to context exit, for 3x3 and 1024x1024 float32 ``t1``, ``t2``
  requiring grad. Rank 0 also records a per-phase breakdown (enter, the two RPCs, the local
  ops, backward, get_gradients, exit).
* ``mlp``: engine overhead on a purely local graph, rank 0 only (rank 1 idles). A 20-layer
  MLP (width 256, batch 64, ReLU, float32, ``torch.set_num_threads(1)``); every iteration
  builds the forward anew and runs either plain ``torch.autograd.backward(loss)`` or our
  ``dist_autograd.backward(ctx, [loss])`` inside one of our contexts (the two alternate
  ABBA, iteration by iteration). Forward+backward and backward alone are timed (wall
  clock; the headline is backward alone), plus the backward's CPU time on the calling
  thread (which runs a CPU graph's backward; other processes' load barely changes it).
  The context enter/exit and ``get_gradients`` are timed apart ("ctx"). Our RPC agent is
  initialised for this step, as it must be for a context.
* ``floor``: what the design note's iteration costs with no RPC stack at all, its kernels
  at local autograd's speed (one fwd+bwd of the same graph, rank 0) plus its six messages
  at raw MPI's (``Isend``/``Irecv`` of the same tensor sizes in the same order, each tensor
  its own page-aligned buffer allocated once, both ranks), one after the other as the example's data
  dependencies order them. ``floor/TP`` above a target means the target asks for less
  than moving those bytes and running those kernels takes on this machine.

Correctness is asserted, not assumed: every seed and MLP step checks the gradients of its first
iteration and of its last timed one against plain local autograd on the same values
(``torch.testing.assert_close``), the run checks ours against TensorPipe's, and the MLP
step checks our per-parameter gradients against plain ``.grad``. A failed check marks
the step as an error, prints FAIL and makes the exit status 1.

The machine may be shared: before each step rank 0 waits (``--wait-quiet``) until other
processes use < 0.15 cores, measures other processes' CPU load during the step (from
``/proc/stat``), and re-runs a step that saw more than ``--max-load`` cores (keeping the
least disturbed attempt) while within ``--budget``. If the machine is still busy when a
wait ends, the load is not a burst: later waits are short and busy steps are not re-run.

Reported numbers are medians over rounds of per-round medians. Rank 0 prints a table, the
target checks, and writes ``benchmarks/results/<tag>.json`` and ``<tag>.png``.

Where our 3x3 time goes (both run after the rounds, ours only; combine with
``--steps ours --rounds 1`` for just that):

* ``--trace N``: N iterations with the library's internal steps (``TRACE_POINTS``: send,
  deliver, pickle, record send/recv, engine regions, ``torch.autograd.grad`` ...) wrapped
  with timestamps on every thread of both ranks. Prints per iteration how long each rank
  was busy in library code, how long neither was (messages in flight, wake-ups), and each
  step's calls, time per call and per iteration. The wrappers add a few us per step.
* ``--profile N``: N iterations under cProfile on every thread of both ranks (wall time,
  waits included); prints the hottest functions per thread and writes
  ``benchmarks/results/<tag>_profile_rank<r>_<thread>.pstats``.

A step that hangs (``--hang-timeout``) dumps every thread's stack on both ranks and ends
the job.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import cProfile
import faulthandler
import functools
import gc
import io
import json
import os
import pstats
import statistics
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

T_PROCESS = time.perf_counter()  # startup (imports, MPI) counts towards the run time
os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import torch  # noqa: E402
from _common import (  # noqa: E402
    REPO,
    RESULTS_DIR,
    StepLoad,
    add_max_load_arg,
    agree,
    agreed_reason,
    base_env,
    busy_again,
    busy_warning,
    error_lines,
    fmt_time,
    init_on_all,
    keep_quietest,
    load_average,
    load_note,
    load_summary,
    med,
    print_step_error,
    quiet_barrier,
    result_paths,
    start_watchdog,
    summarize,
    target_line,
    tensorpipe_kwargs,
    tensorpipe_unavailable,
    timed,
    two_rank_comm,
    wait_quiet,
)
from mpi4py import MPI  # noqa: E402

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run from a checkout without installing the package

# (side of the square tensors, timed iterations, warm-up iterations) per round.
SEED_PLAN = [(3, 800, 80), (1024, 50, 5)]
QUICK_SEED_PLAN = [(3, 150, 20), (1024, 12, 2)]
MLP_ITERS, QUICK_MLP_ITERS = 50, 12  # per variant and round (plus 2 warm-up)
MLP_LAYERS, MLP_WIDTH, MLP_BATCH = 20, 256, 64
# Per size and round: stop early once a backend took this long (>= 5 samples), so a very
# slow (or very busy) run still ends in time. Default run / --quick.
SIZE_CAP_S, QUICK_SIZE_CAP_S = 8.0, 3.0
WARMUP_S = 0.3  # per size and round, at least (both backends)

TARGET_SEED_SMALL = 0.4  # ours / TP at 3x3
TARGET_SEED_BIG = 0.7  # ours / TP at 1024x1024
TARGET_MLP_BACKWARD = 1.2  # ours / plain autograd, backward alone

MLP_KEYS = [
    "plain_fwd_bwd",
    "plain_bwd",
    "plain_bwd_cpu",
    "ours_fwd_bwd",
    "ours_bwd",
    "ours_bwd_cpu",
    "ours_ctx",
]
PHASES = ["enter", "rpc add", "rpc mul", "local", "backward", "get_grads", "exit"]
STEP_LABELS = {
    "ours": "ours (lightning_distgrad)",
    "tp": "TensorPipe (torch.distributed)",
    "mlp": "local MLP (ours vs plain)",
    "floor": "sequential floor (local autograd + raw MPI)",
}
# The seed iteration's messages in order, as (sender, n x n float32 tensors): the two
# requests (t1, t2) and their results, the root's gradients for t3 and t4, and the worker's
# gradients for the t1 and t2 of both RPCs (those of ``add`` are one tensor, so three).
FLOOR_MESSAGES = ((0, 2), (1, 1), (0, 2), (1, 1), (0, 2), (1, 3))


# --------------------------------------------------------------------------------------------
# The seed example
# --------------------------------------------------------------------------------------------


def seed_inputs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234 + n)
    t1 = torch.rand((n, n), generator=g).requires_grad_()
    t2 = torch.rand((n, n), generator=g).requires_grad_()
    return t1, t2


def seed_reference(t1: torch.Tensor, t2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same computation with plain local autograd."""
    a, b = t1.detach().requires_grad_(), t2.detach().requires_grad_()
    loss = ((a + b) * (a * b)).sum()
    ga, gb = torch.autograd.grad(loss, [a, b])
    return ga, gb


def seed_iteration(rpc, dist_autograd, t1, t2, stamps: list | None = None):
    """One full iteration of the example; appends its 8 timestamps to ``stamps``."""
    clock = time.perf_counter
    a = clock()
    with dist_autograd.context() as ctx:
        b = clock()
        t3 = rpc.rpc_sync("worker1", torch.add, (t1, t2))
        c = clock()
        t4 = rpc.rpc_sync("worker1", torch.mul, (t1, t2))
        d = clock()
        loss = (t3 * t4).sum()
        e = clock()
        dist_autograd.backward(ctx, [loss])
        f = clock()
        grads = dist_autograd.get_gradients(ctx)
        g = clock()
    h = clock()
    if stamps is not None:
        stamps.append((a, b, c, d, e, f, g, h))
    return grads


def check_seed_grads(grads: dict, t1, t2, ref, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    keys = list(grads)
    if len(keys) != 2 or not any(k is t1 for k in keys) or not any(k is t2 for k in keys):
        raise AssertionError(f"{what}: get_gradients keys are not exactly (t1, t2): {keys!r}")
    got = (grads[t1], grads[t2])
    for name, g, r in zip(("t1", "t2"), got, ref, strict=True):
        torch.testing.assert_close(g, r, msg=lambda m, n=name: f"{what}: grad of {n}: {m}")
    return got


class SeedBackend:
    """An RPC + distributed-autograd stack with torch's API."""

    name = "base"

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()

    def modules(self):
        raise NotImplementedError

    def unavailable(self) -> str | None:
        return None

    def init(self) -> None:
        self.rpc, self.dist_autograd = self.modules()
        self.rpc.init_rpc(
            f"worker{self.rank}", rank=self.rank, world_size=self.size, **self.init_kwargs()
        )

    def init_kwargs(self) -> dict:
        return {}

    def shutdown(self) -> None:
        self.rpc.shutdown()


class Ours(SeedBackend):
    name = "ours"

    def unavailable(self) -> str | None:
        try:
            import lightning_distgrad.autograd as dist_autograd
            import lightning_distgrad.rpc as rpc
        except Exception as exc:  # any import problem means "not ready yet"
            return f"import lightning_distgrad failed: {exc!r}"
        if not hasattr(rpc, "init_rpc") or not hasattr(dist_autograd, "backward"):
            return "lightning_distgrad has no init_rpc / autograd.backward yet"
        return None

    def modules(self):
        import lightning_distgrad.autograd as dist_autograd
        import lightning_distgrad.rpc as rpc

        return rpc, dist_autograd

    def init(self) -> None:
        self.rpc, self.dist_autograd = self.modules()
        self.rpc.init_rpc()  # names worker{rank}, rank and size from MPI


class TensorPipe(SeedBackend):
    name = "tp"

    def unavailable(self) -> str | None:
        return tensorpipe_unavailable()

    def modules(self):
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc

        return rpc, dist_autograd

    def init_kwargs(self) -> dict:
        return tensorpipe_kwargs(self.rpc, self.comm)


class Floor(SeedBackend):
    """No RPC stack: the floor step times local autograd and raw MPI (see time_floor)."""

    name = "floor"

    def init(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def time_floor(comm: MPI.Comm, plan) -> dict:
    """Both ranks; rank 0 returns, per size, what an iteration of the seed example costs
    if its kernels ran at local autograd's speed and its messages at raw MPI's, one after
    another (``transfers`` + ``kernels``).

    The example's data dependencies order nearly everything: each ``rpc_sync`` waits for
    its result, and each gradient message waits for the kernels before it. The floor is
    optimistic where it can be: every message is one ``Isend``/``Irecv`` per tensor
    between buffers allocated once (page-aligned, so MPI's single-copy path runs at full
    speed), and the kernels are one local fwd+bwd of the same graph. Each tensor has a
    buffer of its own, as in the iteration, where they coexist (saved for the backward):
    buffers shared between messages would move the bytes far slower than the iteration does.
    """
    # The receive buffers' allocator of our transport: page-aligned numpy arrays.
    from lightning_distgrad.rpc._wire import _aligned_empty

    rank = comm.Get_rank()
    peer = 1 - rank
    out = {}
    for n, iters, warmup in plan:
        # One buffer per tensor of the iteration, as many as it moves: at 1024x1024 they
        # (44 MiB) outgrow the cache, as the iteration's tensors do.
        buffers = [[_aligned_empty(n * n * 4) for _ in range(t)] for _, t in FLOOR_MESSAGES]
        transfers = []
        for i in range(warmup + iters):
            start = time.perf_counter()
            for (sender, _), message in zip(FLOOR_MESSAGES, buffers, strict=True):
                post = comm.Isend if sender == rank else comm.Irecv
                requests = [post([b, MPI.BYTE], peer, 7) for b in message]
                while not MPI.Request.Testall(requests):
                    pass
            if i >= warmup:
                transfers.append(time.perf_counter() - start)
        quiet_barrier(comm)  # rank 1 sleeps while rank 0 times the kernels
        if rank == 0:
            t1, t2 = seed_inputs(n)
            kernels = []
            for i in range(warmup + iters):
                start = time.perf_counter()
                seed_reference(t1, t2)
                if i >= warmup:
                    kernels.append(time.perf_counter() - start)
            phases = {"transfers": med(transfers), "kernels": med(kernels)}
            out[n] = {"median": sum(phases.values()), "phases": phases}
        quiet_barrier(comm)
    return out


def time_seed(backend: SeedBackend, plan, cap_s: float, keep_grads: dict) -> dict:
    """Rank 0: per-size statistics of the full iteration and its phases."""
    out = {}
    for n, iters, warmup in plan:
        t1, t2 = seed_inputs(n)
        ref = seed_reference(t1, t2)
        what = f"{backend.name} {n}x{n}"
        check_seed_grads(
            seed_iteration(backend.rpc, backend.dist_autograd, t1, t2), t1, t2, ref, what
        )
        start = time.perf_counter()
        done = 0
        # The planned iterations, and at least WARMUP_S: after a quiet spell an RPC agent
        # runs slower for ~0.1 s (bench_rpc.py), and a count favours the slower backend.
        while done < warmup or time.perf_counter() - start < WARMUP_S:
            seed_iteration(backend.rpc, backend.dist_autograd, t1, t2)
            done += 1
            if time.perf_counter() - start > cap_s / 4:
                break
        gc.collect()
        stamps: list = []
        start = time.perf_counter()
        grads = None
        for _ in range(iters):
            grads = seed_iteration(backend.rpc, backend.dist_autograd, t1, t2, stamps)
            if len(stamps) >= 5 and time.perf_counter() - start > cap_s:
                break
        got = check_seed_grads(grads, t1, t2, ref, what + " (last timed iteration)")
        keep_grads[n] = [g.clone() for g in got]
        total = [s[-1] - s[0] for s in stamps]
        phases = {name: med([s[i + 1] - s[i] for s in stamps]) for i, name in enumerate(PHASES)}
        out[n] = summarize(total) | {"phases": phases}
    return out


# --------------------------------------------------------------------------------------------
# Local MLP: engine overhead
# --------------------------------------------------------------------------------------------


class MLP:
    def __init__(self):
        g = torch.Generator().manual_seed(99)
        scale = MLP_WIDTH**-0.5
        self.weights = [
            (torch.randn(MLP_WIDTH, MLP_WIDTH, generator=g) * scale).requires_grad_()
            for _ in range(MLP_LAYERS)
        ]
        self.biases = [torch.zeros(MLP_WIDTH).requires_grad_() for _ in range(MLP_LAYERS)]
        self.params = [p for pair in zip(self.weights, self.biases, strict=True) for p in pair]
        self.x = torch.randn(MLP_BATCH, MLP_WIDTH, generator=g)

    def loss(self) -> torch.Tensor:
        h = self.x
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            h = torch.nn.functional.linear(h, w, b)
            if i < MLP_LAYERS - 1:
                h = torch.relu(h)
        return h.pow(2).mean()

    def clear(self) -> None:
        for p in self.params:
            p.grad = None

    def plain(self, out: dict | None) -> None:
        self.clear()
        clock, cpu = time.perf_counter, time.thread_time
        a = clock()
        loss = self.loss()
        b, b_cpu = clock(), cpu()
        torch.autograd.backward(loss)
        c, c_cpu = clock(), cpu()
        if out is not None:
            out["plain_fwd_bwd"].append(c - a)
            out["plain_bwd"].append(c - b)
            out["plain_bwd_cpu"].append(c_cpu - b_cpu)

    def ours(self, dist_autograd, out: dict | None) -> dict:
        clock, cpu = time.perf_counter, time.thread_time
        a = clock()
        with dist_autograd.context() as ctx:
            b = clock()
            loss = self.loss()
            c, c_cpu = clock(), cpu()
            dist_autograd.backward(ctx, [loss])
            d, d_cpu = clock(), cpu()
            grads = dist_autograd.get_gradients(ctx)
        f = clock()
        if out is not None:
            out["ours_fwd_bwd"].append(d - b)
            out["ours_bwd"].append(d - c)
            out["ours_bwd_cpu"].append(d_cpu - c_cpu)
            out["ours_ctx"].append((b - a) + (f - d))  # enter + get_gradients + exit
        return grads

    def check(self, dist_autograd) -> bool:
        """Our gradients against plain ``.grad``; returns whether they are bitwise equal."""
        self.plain(None)
        expected = [p.grad.clone() for p in self.params]
        self.clear()
        grads = self.ours(dist_autograd, None)
        if any(p.grad is not None for p in self.params):
            raise AssertionError("mlp: our backward wrote .grad (it must only fill the context)")
        if len(grads) != len(self.params):
            raise AssertionError(f"mlp: {len(grads)} gradients for {len(self.params)} params")
        exact = True
        for i, (p, e) in enumerate(zip(self.params, expected, strict=True)):
            torch.testing.assert_close(grads[p], e, msg=lambda m, i=i: f"mlp param {i}: {m}")
            exact = exact and torch.equal(grads[p], e)
        return exact


def time_mlp(dist_autograd, iters: int) -> dict:
    mlp = MLP()
    exact = mlp.check(dist_autograd)
    for _ in range(2):
        mlp.plain(None)
        mlp.ours(dist_autograd, None)
    gc.collect()
    samples: dict[str, list[float]] = {k: [] for k in MLP_KEYS}
    for i in range(iters):  # ABBA: neither variant always runs first
        if i % 2 == 0:
            mlp.plain(samples)
            mlp.ours(dist_autograd, samples)
        else:
            mlp.ours(dist_autograd, samples)
            mlp.plain(samples)
    exact = mlp.check(dist_autograd) and exact
    return {k: summarize(v) for k, v in samples.items()} | {"bitwise_equal": exact}


# --------------------------------------------------------------------------------------------
# Rounds
# --------------------------------------------------------------------------------------------


def run_step(name: str, backends: dict, args, comm: MPI.Comm, keep_grads: dict) -> dict:
    """One step of one round: init, timed work on rank 0 (rank 1 serves/idles), shutdown."""
    rank = comm.Get_rank()
    backend = backends["ours" if name == "mlp" else name]
    step: dict = {"step": name}
    err = None
    quiet_barrier(comm)
    # A hung step (e.g. a deadlock in the library under test) dumps every thread's stack on
    # both ranks and ends the job, instead of waiting for --timeout.
    faulthandler.dump_traceback_later(args.hang_timeout, exit=True)
    if not init_on_all(backend, comm, step):
        faulthandler.cancel_dump_traceback_later()
        return step
    quiet_barrier(comm)
    try:
        if name == "floor":
            floor = time_floor(comm, args.plan)
            if rank == 0:
                step["seed"] = floor
        elif rank == 0:
            if name == "mlp":
                step["mlp"] = time_mlp(backend.dist_autograd, args.mlp_iters)
            else:
                grads: dict = {}
                step["seed"] = time_seed(backend, args.plan, args.size_cap, grads)
                keep_grads.setdefault(name, []).append(grads)
    except Exception:
        err = traceback.format_exc()
    quiet_barrier(comm)  # rank 1: serves from its agent threads, main thread asleep
    if not agree(comm, err is None):
        step["error"] = err or "failed on the other rank"
    step["shutdown_s"] = timed(backend.shutdown)
    faulthandler.cancel_dump_traceback_later()
    return step


def run_rounds(backends: dict, names: list[str], args, comm: MPI.Comm, t_start: float):
    rank = comm.Get_rank()
    steps, discarded, disabled = [], [], set()
    keep_grads: dict = {}
    persistently_busy = False
    for rnd in range(args.rounds):
        late = rnd > 0 and time.perf_counter() - t_start > args.max_time
        if comm.bcast(late, root=0):
            if rank == 0:
                print(
                    f"--max-time {args.max_time:.0f} s reached: stopping after {rnd} round(s)",
                    flush=True,
                )
            break
        order = names[rnd % len(names) :] + names[: rnd % len(names)]  # rotate each round
        for name in order:
            if name in disabled:
                continue
            attempts = []
            while True:
                # Waiting (and re-running) only helps against bursts: once a wait ended with
                # the machine still busy, later waits are short and busy steps are kept.
                wait = args.wait_quiet if time.perf_counter() - t_start < args.budget else 0
                if persistently_busy:
                    wait = min(wait, 1.0)
                step = {"round": rnd, "foreign_before": wait_quiet(comm, wait)}
                persistently_busy = comm.bcast(
                    (step["foreign_before"] or 0) > args.max_load, root=0
                )
                load = StepLoad(comm)
                step |= run_step(name, backends, args, comm, keep_grads)
                step |= load.stop()  # CPU of this job and of other processes, rank 0
                attempts.append(step)
                in_budget = time.perf_counter() - t_start < args.budget
                again = not persistently_busy and busy_again(step, len(attempts), args, in_budget)
                if rank == 0:
                    print_step(step, t_start, again)
                if not comm.bcast(again, root=0):
                    break
            best = keep_quietest(comm, attempts, steps, discarded)
            if comm.bcast("error" in best, root=0):
                disabled.add(name)
    return steps, discarded, keep_grads


def print_step(step: dict, t_start: float, again: bool) -> None:
    head = f"[round {step['round'] + 1}] {step['step']:>4}:"
    if print_step_error(head, step):
        return
    if "seed" in step:
        body = ", ".join(f"{n}x{n} {fmt_time(r['median'])}" for n, r in step["seed"].items())
    else:
        m = step["mlp"]
        body = (
            f"bwd plain {fmt_time(m['plain_bwd']['median'])} ours "
            f"{fmt_time(m['ours_bwd']['median'])}, fwd+bwd plain "
            f"{fmt_time(m['plain_fwd_bwd']['median'])} ours {fmt_time(m['ours_fwd_bwd']['median'])}"
        )
    print(
        f"{head} {body}, init {fmt_time(step['init_s'])}, "
        f"shutdown {fmt_time(step['shutdown_s'])}, " + load_note(step, again, t_start),
        flush=True,
    )


# --------------------------------------------------------------------------------------------
# Cross-check and reporting (rank 0)
# --------------------------------------------------------------------------------------------


def cross_check(keep_grads: dict) -> dict:
    """Ours vs TensorPipe gradients (same inputs every round)."""
    out: dict = {}
    ours, tp = keep_grads.get("ours", []), keep_grads.get("tp", [])
    if not ours or not tp:
        return {"skipped": "needs both ours and tp"}
    for n in ours[0]:
        a = [g for rnd in ours if n in rnd for g in rnd[n]]
        b = [g for rnd in tp if n in rnd for g in rnd[n]]
        if not a or not b:
            continue
        diff = max(float((x - y).abs().max()) for x, y in zip(a, b, strict=False))
        for x, y in zip(a, b, strict=False):
            torch.testing.assert_close(x, y, msg=lambda m, n=n: f"ours vs TP at {n}x{n}: {m}")
        out[n] = {
            "max_abs_diff": diff,
            "bitwise_equal": all(torch.equal(x, y) for x, y in zip(a, b, strict=False)),
        }
    return out


def aggregate(steps: list[dict], names: list[str], sizes: list[int]) -> dict:
    summary: dict = {}
    for name in names:
        mine = [s for s in steps if s["step"] == name]
        ok = [s for s in mine if "error" not in s]
        b: dict = {"rounds_ok": len(ok), "errors": [s["error"] for s in mine if "error" in s]}
        b["init_s"] = med([s["init_s"] for s in ok])
        b["shutdown_s"] = med([s["shutdown_s"] for s in ok])
        if name == "mlp":
            for key in MLP_KEYS:
                per_round = [s["mlp"][key]["median"] for s in ok]
                b[key] = {
                    "median": med(per_round),
                    "min": min(per_round, default=None),
                    "max": max(per_round, default=None),
                    "per_round": per_round,
                }
            for kind in ("bwd", "fwd_bwd", "bwd_cpu"):
                per_round = [
                    s["mlp"][f"ours_{kind}"]["median"] / s["mlp"][f"plain_{kind}"]["median"]
                    for s in ok
                ]
                b[f"ratio_{kind}_per_round"] = per_round
            b["bitwise_equal"] = all(s["mlp"]["bitwise_equal"] for s in ok) if ok else None
        else:
            seed = {}
            for n in sizes:
                per_round = [s["seed"][n]["median"] for s in ok if n in s["seed"]]
                if not per_round:
                    continue
                seed[n] = {
                    "median": med(per_round),
                    "min": min(per_round),
                    "max": max(per_round),
                    "per_round": per_round,
                    "phases": {
                        p: med([s["seed"][n]["phases"][p] for s in ok if n in s["seed"]])
                        for p in next(s["seed"][n]["phases"] for s in ok if n in s["seed"])
                    },
                }
            b["seed"] = seed
        summary[name] = b
    summary["others_load_cores"] = load_summary(steps)
    return summary


def print_report(summary: dict, names, sizes, skipped: dict, grad_checks: dict) -> list[str]:
    lines: list[str] = []

    def p(line: str = "") -> None:
        lines.append(line.rstrip())

    def get(name, n):
        return summary.get(name, {}).get("seed", {}).get(n, {}).get("median")

    def ratio(a, b):
        return a / b if a is not None and b is not None else None

    def fr(x):
        return f"{x:.2f}" if x is not None else "-"

    p("Seed example, full iteration (context enter .. exit), rank 0;")
    p("median over rounds of per-round medians [min-max over rounds]:")
    p(f"{'size':>10}  {'ours':<31}{'TensorPipe':<31}{'ours/TP':>8}{'target':>9}")
    for n in sizes:
        cells = []
        for name in ("ours", "tp"):
            r = summary.get(name, {}).get("seed", {}).get(n)
            cells.append(
                f"{fmt_time(r['median'])} [{fmt_time(r['min'])}-{fmt_time(r['max'])}]" if r else "-"
            )
        target = TARGET_SEED_SMALL if n == sizes[0] else TARGET_SEED_BIG
        p(
            f"{f'{n}x{n}':>10}  {cells[0]:<31}{cells[1]:<31}"
            f"{fr(ratio(get('ours', n), get('tp', n))):>8}{'<= ' + str(target):>9}"
        )
    if summary.get("floor", {}).get("seed"):
        p()
        p("Sequential floor: the same kernels with local autograd plus the same messages with")
        p("raw MPI between aligned buffers, one after the other (see time_floor):")
        p(
            f"{'size':>10}  {'kernels':>10}{'transfers':>11}{'floor':>10}{'floor/TP':>10}"
            f"{'ours/floor':>12}"
        )
        for n in sizes:
            r = summary["floor"]["seed"].get(n)
            if r:
                p(
                    f"{f'{n}x{n}':>10}  {fmt_time(r['phases']['kernels']):>10}"
                    f"{fmt_time(r['phases']['transfers']):>11}{fmt_time(r['median']):>10}"
                    f"{fr(ratio(r['median'], get('tp', n))):>10}"
                    f"{fr(ratio(get('ours', n), r['median'])):>12}"
                )
    p()
    p("Phase breakdown, rank 0 (median per phase; phases sum to about the total):")
    p(f"{'':>15}" + "".join(f"{ph:>11}" for ph in PHASES))
    for n in sizes:
        for name in ("ours", "tp"):
            r = summary.get(name, {}).get("seed", {}).get(n)
            if r:
                row = "".join(f"{fmt_time(r['phases'][ph]):>11}" for ph in PHASES)
                p(f"{f'{n}x{n} {name}':>15}{row}")
    m = summary.get("mlp")
    if m and m["rounds_ok"]:
        p()
        p(
            f"Local {MLP_LAYERS}-layer MLP (width {MLP_WIDTH}, batch {MLP_BATCH}, 1 thread), "
            "rank 0, median over rounds of per-round medians:"
        )
        p(f"{'':>16}{'plain autograd':>16}{'ours (context)':>16}{'ours/plain':>12}  per round")
        for kind, label in (
            ("bwd", "backward alone"),
            ("fwd_bwd", "forward+backward"),
            ("bwd_cpu", "backward CPU"),
        ):
            a, b = m[f"plain_{kind}"]["median"], m[f"ours_{kind}"]["median"]
            per = " ".join(f"{x:.2f}" for x in m[f"ratio_{kind}_per_round"])
            p(f"{label:>16}{fmt_time(a):>16}{fmt_time(b):>16}{fr(b / a):>12}  {per}")
        p(
            f"{'ctx (ours)':>16}{'':>16}{fmt_time(m['ours_ctx']['median']):>16}"
            "              (context enter + get_gradients + exit, not in the above)"
        )
        p(
            f"{'':>16}(backward CPU: the main thread's CPU time, which other processes' load "
            "barely affects; on CPU the engine runs the backward on the calling thread)"
        )
    p()
    p(
        "init / shutdown (rank 0, median): "
        + ", ".join(
            f"{n} {fmt_time(summary[n]['init_s'])} / {fmt_time(summary[n]['shutdown_s'])}"
            for n in names
            if summary[n]["rounds_ok"]
        )
    )
    load = summary["others_load_cores"]
    if load["median"] is not None:
        p(
            f"other processes' CPU load during the steps (cores): median {load['median']:.2f}, "
            f"max {load['max']:.2f}" + busy_warning(load["max"])
        )
    for name, why in skipped.items():
        p(f"  [{name} skipped: {why}]")
    for line in error_lines(summary, names):
        p(line)
    p()

    def check(desc, value, limit):
        p(target_line(desc, value, limit))

    p("Targets:")
    small, big = sizes[0], sizes[-1]
    check(
        f"seed {small}x{small} ours/TP",
        ratio(get("ours", small), get("tp", small)),
        TARGET_SEED_SMALL,
    )
    check(f"seed {big}x{big} ours/TP", ratio(get("ours", big), get("tp", big)), TARGET_SEED_BIG)
    mlp_ratio = None
    if m and m["rounds_ok"]:
        mlp_ratio = m["ours_bwd"]["median"] / m["plain_bwd"]["median"]
    check("MLP backward alone ours/plain", mlp_ratio, TARGET_MLP_BACKWARD)
    p("Gradient checks:")
    for line in grad_checks["lines"]:
        p(f"  {line}")
    print("\n".join(lines), flush=True)
    return lines


def plot(summary: dict, sizes: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    def bars(ax, groups: list[str], series: list[tuple[str, list]], ratio: str, log=False):
        """Grouped bars (median, min-max error bars) and the second/first ratio on top."""
        width = 0.38
        for k, (label, rs) in enumerate(series):
            xs = [i + (k - 0.5) * width for i, r in enumerate(rs) if r]
            ok = [r for r in rs if r]
            if ok:
                err = [[r["median"] - r["min"] for r in ok], [r["max"] - r["median"] for r in ok]]
                ax.bar(xs, [r["median"] for r in ok], width, yerr=err, capsize=3, label=label)
        for i, (a, b) in enumerate(zip(series[0][1], series[1][1], strict=True)):
            if a and b:
                top = max(a["max"], b["max"])
                ax.annotate(
                    f"{ratio} {b['median'] / a['median']:.2f}",
                    (i, top),
                    textcoords="offset points",
                    xytext=(0, 6),
                    ha="center",
                    fontsize=8,
                )
        ax.set_xticks(range(len(groups)), groups)
        if log:
            ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: fmt_time(y)))
        if log:  # label the 2x and 5x minor ticks of each decade too
            ax.yaxis.set_minor_formatter(
                FuncFormatter(lambda y, _: fmt_time(y) if f"{y:.0e}"[0] in "25" else "")
            )
        else:
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.margins(y=0.15)
        ax.legend(fontsize=8, loc="upper left")

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.5))
    seed = {name: summary.get(name, {}).get("seed", {}) for name in ("ours", "tp")}
    bars(
        ax1,
        [f"{n}x{n}" for n in sizes],
        [
            (STEP_LABELS["tp"], [seed["tp"].get(n) for n in sizes]),
            (STEP_LABELS["ours"], [seed["ours"].get(n) for n in sizes]),
        ],
        "ours/TP",
        log=True,
    )
    ax1.set_ylabel("median over rounds (bars: min-max)")
    ax1.set_title("seed example, full iteration (rpc add, rpc mul, backward, ...)", fontsize=9)
    m = summary.get("mlp")
    if m and m["rounds_ok"]:
        kinds = [("bwd", "backward"), ("fwd_bwd", "forward+backward"), ("bwd_cpu", "bwd CPU")]
        bars(
            ax2,
            [label for _, label in kinds],
            [
                ("plain autograd", [m[f"plain_{kind}"] for kind, _ in kinds]),
                ("ours (context)", [m[f"ours_{kind}"] for kind, _ in kinds]),
            ],
            "ours/plain",
        )
        ax2.set_title(
            f"local {MLP_LAYERS}-layer MLP, width {MLP_WIDTH}, batch {MLP_BATCH}, 1 thread",
            fontsize=9,
        )
    load = summary.get("others_load_cores", {})
    if load.get("median") is not None:
        title += f"; other processes' load during steps: median {load['median']:.2f} cores"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Profile of our 3x3 loop
# --------------------------------------------------------------------------------------------


class ThreadProfiles:
    """cProfile on every thread started while installed, plus the calling thread."""

    def __init__(self):
        self.profiles: dict[str, cProfile.Profile] = {}
        self._lock = threading.Lock()

    def _hook(self, frame, event, arg):  # runs once, first thing in each new thread
        sys.setprofile(None)
        self._start(threading.current_thread().name)

    def _start(self, name: str) -> None:
        prof = cProfile.Profile()
        with self._lock:
            key, i = name, 1
            while key in self.profiles:
                i += 1
                key = f"{name}#{i}"
            self.profiles[key] = prof
        prof.enable()

    def install(self) -> None:
        threading.setprofile(self._hook)

    def start_main(self) -> None:
        self._start("main")

    def uninstall(self) -> None:
        threading.setprofile(None)
        if "main" in self.profiles:
            self.profiles["main"].disable()
        # the agent's threads end, and stop profiling, at shutdown


def profile_ours(
    backend: Ours, comm: MPI.Comm, iters: int, tag: str, hang_timeout: float
) -> str | None:
    """N iterations of the 3x3 loop under cProfile on every thread of both ranks."""
    rank = comm.Get_rank()
    t1, t2 = seed_inputs(3)
    profiles = ThreadProfiles()
    quiet_barrier(comm)
    faulthandler.dump_traceback_later(hang_timeout, exit=True)
    profiles.install()  # before init_rpc: the agent's threads start profiled (with warm-up)
    backend.init()
    quiet_barrier(comm)
    wall = None
    if rank == 0:
        for _ in range(20):
            seed_iteration(backend.rpc, backend.dist_autograd, t1, t2)
        profiles.start_main()
        t0 = time.perf_counter()
        for _ in range(iters):
            seed_iteration(backend.rpc, backend.dist_autograd, t1, t2)
        wall = time.perf_counter() - t0
        profiles.profiles["main"].disable()
    quiet_barrier(comm)
    backend.shutdown()
    profiles.uninstall()
    faulthandler.cancel_dump_traceback_later()
    text = io.StringIO()
    text.write(f"==== rank {rank} ====\n")
    if wall is not None:
        text.write(
            f"{iters} profiled iterations (after 20 warm-up) in {wall:.2f} s: "
            f"{fmt_time(wall / iters)} per iteration under cProfile\n"
        )
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    for name, prof in profiles.profiles.items():
        stats = pstats.Stats(prof)
        if not stats.total_calls:
            continue
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
        stats.dump_stats(RESULTS_DIR / f"{tag}_profile_rank{rank}_{safe}.pstats")
        buf = io.StringIO()
        stats.stream = buf
        stats.sort_stats("tottime").print_stats(14)
        body = buf.getvalue()
        body = body[body.find("   ncalls") :] if "   ncalls" in body else body
        body = body.rstrip() + "\n"
        text.write(
            f"-- thread {name}: {stats.total_calls} calls, "
            f"{stats.total_tt:.2f} s total (wall, incl. waits) --\n{body}\n"
        )
    texts = comm.gather(text.getvalue(), root=0)
    return "".join(texts) if rank == 0 else None


# --------------------------------------------------------------------------------------------
# Timeline of our 3x3 iteration across both ranks
# --------------------------------------------------------------------------------------------

# The library's internal steps to time, as {(module, class or None): [(function, label)]}.
# Names missing from the version under test are skipped (the trace says which).
_TRACED = {
    ("lightning_distgrad.rpc._transport", "Transport"): [
        ("send", "transport.send"),
        ("_deliver", "transport.deliver"),
        ("drive_until", "transport.drive_until"),
    ],
    ("lightning_distgrad.rpc._agent", "Agent"): [
        ("call", "agent.call"),
        ("_serve", "agent.serve"),
        ("_reply", "agent.reply"),
    ],
    ("lightning_distgrad.rpc._agent", None): [
        ("encode_payload", "pickle"),
        ("decode_payload", "unpickle"),
    ],
    ("lightning_distgrad.autograd", "_AutogradHooks"): [
        ("outgoing", "record send"),
        ("incoming", "record recv"),
    ],
    ("lightning_distgrad.autograd", None): [
        ("_new_context", "context enter"),
        ("_release_context", "context exit"),
    ],
    ("lightning_distgrad.autograd._pass", "Pass"): [
        ("__init__", "pass setup (graph)"),
        ("deliver_roots", "pass.deliver_roots"),
        ("deliver_sends", "pass.deliver_sends"),
        ("return_credit", "pass.return_credit"),
        ("_run_region", "pass.run_region"),
        ("report", "pass.report"),
    ],
    ("lightning_distgrad.autograd._engine", None): [
        ("_propagate_gradients", "gradient message"),
        ("_ship", "pass.ship"),
        ("_check_all_sends_used", "pass.final check"),
    ],
    ("torch.autograd", None): [("grad", "torch.autograd.grad")],
}
# (module, class or None, function, label), in the order above.
TRACE_POINTS = [
    (mod_name, cls_name, fn_name, label)
    for (mod_name, cls_name), points in _TRACED.items()
    for fn_name, label in points
]
_FRAME_KINDS = {0: "REQ", 1: "RESP", 2: "CTRL"}
_WAITS = {"transport.drive_until"}  # the caller waiting (spinning) for an answer


class Tracer:
    """Wraps TRACE_POINTS; every call appends (start, end, label, thread) on this rank."""

    def __init__(self):
        self.events: list[tuple[float, float, str, str]] = []
        self.recording = False
        self.patched: list[tuple[object, str, object]] = []
        self.missing: list[str] = []

    def install(self) -> None:
        import importlib

        for mod_name, cls_name, fn_name, label in TRACE_POINTS:
            try:
                owner = importlib.import_module(mod_name)
                if cls_name is not None:
                    owner = getattr(owner, cls_name)
                original = getattr(owner, fn_name)
            except (ImportError, AttributeError):
                self.missing.append(f"{mod_name}.{cls_name + '.' if cls_name else ''}{fn_name}")
                continue
            setattr(owner, fn_name, self._wrap(original, label))
            self.patched.append((owner, fn_name, original))

    def uninstall(self) -> None:
        for owner, fn_name, original in reversed(self.patched):
            setattr(owner, fn_name, original)
        self.patched.clear()

    def _wrap(self, fn, label: str):
        events, clock, tracer = self.events, time.perf_counter, self

        def detail(args) -> str:
            if label.startswith("transport."):  # frame kind
                frame = args[2] if len(args) > 2 else None
                kind = _FRAME_KINDS.get(getattr(frame, "kind", None))
                return f" {kind}" if kind else ""
            if label == "agent.call" and len(args) > 2:  # the remote function
                return f" {getattr(args[2], '__name__', '?')}"
            return ""

        cpu = time.thread_time

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not tracer.recording:
                return fn(*args, **kwargs)
            c0, t0 = cpu(), clock()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = clock()
                name = threading.current_thread().name
                events.append((t0, t1, label + detail(args), name, cpu() - c0))

        return wrapper


def _thread_kind(name: str) -> str:
    if name == "MainThread":
        return "main"
    return "progress" if "progress" in name else "pool"


def _union(intervals: list[tuple[float, float]]) -> float:
    total, start, end = 0.0, None, None
    for a, b in sorted(intervals):
        if start is None or a > end:
            if start is not None:
                total += end - start
            start, end = a, b
        else:
            end = max(end, b)
    return total + (end - start if start is not None else 0.0)


def analyse_trace(
    events_by_rank: list[list], iterations: list[tuple[float, float]], process_cpu: list[float]
) -> str:
    """Per-iteration busy time per rank, and the time of each traced step."""
    events = sorted(
        (e[0], e[1], r, e[2], e[3], e[4]) for r, evs in enumerate(events_by_rank) for e in evs
    )
    n = len(iterations)
    totals: dict[str, list[float]] = collections.defaultdict(list)
    calls: dict[tuple, list[float]] = collections.defaultdict(list)  # step -> durations
    cpus: dict[tuple, list[float]] = collections.defaultdict(list)  # step -> CPU times
    starts = [e[0] for e in events]
    for a, h in iterations:
        items = events[bisect.bisect_left(starts, a) : bisect.bisect_right(starts, h)]
        outer = set()
        by_thread: dict[tuple, list] = collections.defaultdict(list)
        for e in items:
            by_thread[(e[2], e[4])].append(e)
        for evs in by_thread.values():
            end = -1.0
            for e in sorted(evs, key=lambda e: (e[0], -e[1])):
                if e[0] >= end:
                    outer.add(e)
                    end = e[1]
        work = [(e[0], min(e[1], h), e[2]) for e in outer if e[3] not in _WAITS]
        totals["iteration"].append(h - a)
        for r in (0, 1):
            totals[f"rank {r} busy"].append(_union([(b, c) for b, c, rr in work if rr == r]))
            totals[f"rank {r} CPU in steps"].append(
                sum(e[5] for e in outer if e[2] == r and e[3] not in _WAITS)
            )
        totals["either rank busy"].append(_union([(b, c) for b, c, _ in work]))
        for e in items:
            key = (e[2], _thread_kind(e[4]), e[3], "outer" if e in outer else "nested")
            calls[key].append(e[1] - e[0])
            cpus[key].append(e[5])
    out = io.StringIO()
    w = out.write
    w(f"{n} traced iterations (rank 0, context enter .. exit), medians per iteration:\n")
    for key in ("iteration", "rank 0 busy", "rank 1 busy", "either rank busy"):
        w(f"  {key:<18}{fmt_time(med(totals[key])):>11}\n")
    its, busy = totals["iteration"], totals["either rank busy"]
    gap = med([t - b for t, b in zip(its, busy, strict=True)])
    w(
        f"  {'neither busy':<18}{fmt_time(gap):>11}   (messages in flight, thread wake-ups,\n"
        f"  {'':<29}    scheduling; the caller spins in drive_until meanwhile)\n"
    )
    for r in (0, 1):
        w(
            f"  rank {r} CPU: {fmt_time(med(totals[f'rank {r} CPU in steps']))} in traced steps, "
            f"{fmt_time(process_cpu[r] / max(n, 1))} for the whole process (mean; polling "
            "and spinning included)\n"
        )
    w(
        "busy: some thread of ours is inside a traced library step on that rank.\n"
        "Per step: calls per iteration, median wall time per call and x calls, median CPU time\n"
        "per call (wall >> CPU: the thread was preempted or waited for a lock / the GIL);\n"
        "'outer' steps are not inside another traced step of the same thread (nested ones are\n"
        "part of them):\n"
    )
    w(
        f"{'rank':>4} {'thread':>8}  {'step':<38}{'kind':<7}{'per iter':>10}{'calls':>7}"
        f"{'per call':>10}{'CPU/call':>10}\n"
    )
    rows = []
    for key, durs in calls.items():
        per_call = statistics.median(durs)
        count = len(durs) / n
        if count >= 0.05:
            rows.append((key, per_call * count, count, per_call, statistics.median(cpus[key])))
    rows.sort(key=lambda r: (r[0][0], r[0][3] != "outer", -r[1]))
    for (rank, thread, step, kind), per_iter, count, per_call, cpu in rows:
        w(
            f"{rank:>4} {thread:>8}  {step:<38}{kind:<7}{fmt_time(per_iter):>10}{count:>7.2f}"
            f"{fmt_time(per_call):>10}{fmt_time(cpu):>10}\n"
        )
    return out.getvalue()


def trace_ours(
    backend: Ours, comm: MPI.Comm, iters: int, hang_timeout: float, size: int = 3
) -> str | None:
    """N iterations of the seed loop with TRACE_POINTS timed on every thread of both ranks."""
    rank = comm.Get_rank()
    t1, t2 = seed_inputs(size)
    tracer = Tracer()
    quiet_barrier(comm)
    faulthandler.dump_traceback_later(hang_timeout, exit=True)
    tracer.install()
    backend.init()
    quiet_barrier(comm)
    iterations = []
    if rank == 0:
        for _ in range(20):
            seed_iteration(backend.rpc, backend.dist_autograd, t1, t2)
    quiet_barrier(comm)
    tracer.recording = True  # rank 1 too
    cpu0 = time.process_time()
    if rank == 0:
        stamps: list = []
        for _ in range(iters):
            seed_iteration(backend.rpc, backend.dist_autograd, t1, t2, stamps)
        iterations = [(s[0], s[-1]) for s in stamps]
        cpu = time.process_time() - cpu0
    quiet_barrier(comm)
    if rank == 1:
        cpu = time.process_time() - cpu0  # includes up to ~50 ms of the barrier's sleep loop
    tracer.recording = False
    backend.shutdown()
    tracer.uninstall()
    faulthandler.cancel_dump_traceback_later()
    # perf_counter is CLOCK_MONOTONIC on Linux: comparable between processes of one machine.
    events = comm.gather(tracer.events, root=0)
    process_cpu = comm.gather(cpu, root=0)
    if rank != 0:
        return None
    text = analyse_trace(events, iterations, process_cpu)
    if tracer.missing:
        text += "not traced (absent in this version): " + ", ".join(tracer.missing) + "\n"
    return text


# --------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="few iterations (about a minute)")
    ap.add_argument(
        "--rounds", type=int, default=None, help="interleaved rounds (default 7, --quick 3)"
    )
    ap.add_argument("--steps", default="ours,tp,mlp,floor", help="comma list of ours,tp,mlp,floor")
    ap.add_argument("--tag", default=None, help="output file stem (default bench_autograd[_quick])")
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=None,
        metavar="S",
        help="before each step wait up to S s for other processes to go idle "
        "(default 8, --quick 2); 0 disables",
    )
    add_max_load_arg(ap)
    ap.add_argument(
        "--retries", type=int, default=None, help="re-runs per busy step (default 1, --quick 0)"
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="S",
        help="no waiting or re-runs after S s (default 150, --quick 35)",
    )
    ap.add_argument(
        "--max-time",
        type=float,
        default=None,
        metavar="S",
        help="start no new round after S s (default 180, --quick 30)",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after the rounds, profile N iterations of our 3x3 loop (cProfile)",
    )
    ap.add_argument(
        "--trace",
        type=int,
        default=0,
        metavar="N",
        help="after the rounds, time the library's internal steps in N iterations of our 3x3 "
        "loop on both ranks (timeline breakdown)",
    )
    ap.add_argument(
        "--trace-size",
        type=int,
        default=3,
        metavar="N",
        help="--trace times the NxN loop instead of 3x3",
    )
    ap.add_argument(
        "--hang-timeout",
        type=float,
        default=120,
        metavar="S",
        help="a step still running after S s dumps all stacks and ends the job",
    )
    ap.add_argument("--timeout", type=float, default=600, help="abort the job after this many s")
    args = ap.parse_args()

    warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")  # torch rpc init noise
    torch.set_num_threads(1)
    comm = two_rank_comm("bench_autograd")
    rank = comm.Get_rank()
    timer = start_watchdog(
        args.timeout, f"[rank {rank}] bench_autograd: timeout after {args.timeout} s, aborting"
    )

    args.plan = QUICK_SEED_PLAN if args.quick else SEED_PLAN
    args.mlp_iters = QUICK_MLP_ITERS if args.quick else MLP_ITERS
    if args.rounds is None:
        args.rounds = 3 if args.quick else 7
    if args.wait_quiet is None:
        args.wait_quiet = 2.0 if args.quick else 8.0
    if args.retries is None:
        args.retries = 0 if args.quick else 1
    if args.budget is None:
        args.budget = 35.0 if args.quick else 150.0
    if args.max_time is None:
        args.max_time = 30.0 if args.quick else 180.0
    args.size_cap = QUICK_SIZE_CAP_S if args.quick else SIZE_CAP_S
    sizes = [n for n, _, _ in args.plan]
    tag = args.tag or ("bench_autograd_quick" if args.quick else "bench_autograd")

    backends = {"ours": Ours(comm), "tp": TensorPipe(comm), "floor": Floor(comm)}
    names, skipped = [], {}
    for name in [s.strip() for s in args.steps.split(",") if s.strip()]:
        if name not in STEP_LABELS:
            raise SystemExit(f"unknown step {name!r}")
        why = backends["ours" if name == "mlp" else name].unavailable()
        why = agreed_reason(comm, why)  # both ranks must agree
        if why:
            skipped[name] = why
        else:
            names.append(name)

    env = base_env() | {
        "mpi_thread_level": MPI.Query_thread(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": load_average(),
    }
    if rank == 0:
        print(
            f"bench_autograd: {env['host']}, {env['cpus']} CPUs, torch {env['torch']}, "
            f"mpi4py {env['mpi4py']}, {env['mpi_library']}"
        )
        print(
            f"steps: {', '.join(names)}; skipped: "
            + (", ".join(f"{k} ({v})" for k, v in skipped.items()) or "none")
        )
        print(
            f"rounds: {args.rounds}; per round: "
            + ", ".join(f"{n}x{n} x{it}" for n, it, _ in args.plan)
            + f", MLP x{args.mlp_iters} per variant; load average at start "
            f"{env['loadavg_start']}; started in {time.perf_counter() - T_PROCESS:.0f} s",
            flush=True,
        )

    t_start = time.perf_counter()
    steps, discarded, keep_grads = run_rounds(backends, names, args, comm, t_start)
    profile_text = None
    if args.profile and "ours" in names:
        profile_text = profile_ours(backends["ours"], comm, args.profile, tag, args.hang_timeout)
    trace_text = None
    if args.trace and "ours" in names:
        trace_text = trace_ours(
            backends["ours"], comm, args.trace, args.hang_timeout, args.trace_size
        )
    env["loadavg_end"] = load_average()
    timer.cancel()
    if rank != 0:
        return 0

    summary = aggregate(steps, names, sizes)
    summary["steps_rerun_because_busy"] = len(discarded)
    grad_lines, grad_ok = [], True
    errors = [s for s in steps if "error" in s]
    for s in errors:
        grad_ok = grad_ok and "AssertionError" not in s["error"]
    if errors:
        grad_lines.append(f"FAIL  {len(errors)} step(s) failed (see errors above)")
    checked = [s["step"] for s in steps if "error" not in s and s["step"] != "floor"]
    if checked:
        grad_lines.append(
            f"PASS  every step's first and last timed iteration matched local autograd "
            f"({len(checked)} steps: {', '.join(sorted(set(checked)))})"
        )
    try:
        cross = cross_check(keep_grads)
        for n, c in cross.items():
            if isinstance(c, dict):
                grad_lines.append(
                    f"PASS  ours == TP at {n}x{n}: max abs diff {c['max_abs_diff']:.3g}"
                    f" (bitwise equal: {c['bitwise_equal']})"
                )
    except AssertionError as e:
        cross = {"error": str(e)}
        grad_ok = False
        grad_lines.append(f"FAIL  ours vs TP: {e}")
    m = summary.get("mlp")
    if m and m["rounds_ok"]:
        grad_lines.append(f"PASS  MLP: ours == plain .grad (bitwise equal: {m['bitwise_equal']})")
    print(
        f"\nTotal {time.perf_counter() - t_start:.0f} s; load average at end "
        f"{env['loadavg_end']}.\n"
    )
    lines = print_report(summary, names, sizes, skipped, {"lines": grad_lines})
    if trace_text:
        print("\nWhere our 3x3 iteration's time goes (--trace, timestamps on both ranks):")
        print(trace_text)
    if profile_text:
        print("\nProfile of our 3x3 loop (cProfile, every thread; wall time incl. waits):")
        print(profile_text)

    json_path, png_path = result_paths(tag)
    doc = {
        "command": " ".join(sys.argv),
        "env": env,
        "rounds": args.rounds,
        "seed_plan": [{"side": n, "iters": it, "warmup": w} for n, it, w in args.plan],
        "mlp": {
            "layers": MLP_LAYERS,
            "width": MLP_WIDTH,
            "batch": MLP_BATCH,
            "iters": args.mlp_iters,
        },
        "targets": {
            "seed_small_vs_tp": TARGET_SEED_SMALL,
            "seed_big_vs_tp": TARGET_SEED_BIG,
            "mlp_backward_vs_plain": TARGET_MLP_BACKWARD,
        },
        "skipped": skipped,
        "summary": summary,
        "gradient_checks": {"ours_vs_tp": cross, "lines": grad_lines},
        "report": lines,
        "profile": profile_text,
        "trace": trace_text,
        "steps": steps,
        "discarded_busy_steps": discarded,
    }
    json_path.write_text(json.dumps(doc, indent=1, default=str))
    title = f"distributed autograd, 2 ranks, {env['host']} ({env['cpus']} CPUs)"
    try:
        plot(summary, sizes, png_path, title)
        wrote = f"{json_path.relative_to(REPO)} and {png_path.relative_to(REPO)}"
    except ImportError as e:  # matplotlib is optional (the ``bench`` extra)
        wrote = f"{json_path.relative_to(REPO)} (no plot: {e})"
    print(f"\nwrote {wrote}; {time.perf_counter() - T_PROCESS:.0f} s since start")
    return 0 if grad_ok and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
