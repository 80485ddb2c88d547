"""RPC round-trip benchmark: raw MPI vs our MPI agent vs torch's TensorPipe, side by side.

Run (2 ranks on one node; rank 0 drives, rank 1 serves)::

    THP_MEM_ALLOC_ENABLE=1 mpiexec -n 2 python -m mpi4py benchmarks/bench_rpc.py [--quick]

``--quick`` runs few iterations (about a minute); the default run about 3 minutes (more
if other processes load the machine).
``THP_MEM_ALLOC_ENABLE=1`` is recommended: without transparent huge pages, fresh 64 MiB
receive tensors cost ~45 ms of page faults on small VMs and dominate big-message RTTs.

Backends (see ``BACKENDS``; pick with ``--backends mpi,py,ours,tp``):

* ``mpi``:  raw mpi4py buffer ping-pong (``Send``/``Recv`` of tensor memory on a
  ``COMM_WORLD.Dup()``, pre-allocated buffers, echo): the physical limit.
* ``py``:   the smallest Python RPC (``MinimalPython``): one thread per rank and no agent, only
  the steps every Python RPC takes (pickle the call around a tensor table, ``Isend``, poll
  with ``Improbe``, unpickle, run, answer the same way): the floor of any Python
  per-message path on this machine, for small messages.
* ``ours``: ``lightning_distgrad.rpc`` (skipped with a note while it has no ``init_rpc``).
* ``tp``:   ``torch.distributed.rpc`` with its TensorPipe backend, default options, started
  inside the same MPI job (rank/world size from MPI, ``tcp://127.0.0.1:<port>`` chosen by rank 0).

What is measured, per round and backend (rounds interleave backends: mpi, py, ours, tp, mpi, ...):

1. init time;
2. round-trip time of ``rpc_sync("worker1", torch.add, (t, 1))`` (raw MPI: send ``t``, receive it
   back) for float32 tensors of 8 B .. 64 MiB, after a warm-up (the planned calls, and for the
   RPC backends at least 0.3 s; they are also timed for at least 0.5 s, so that both are
   sampled over stretches of the same length); per-size median; at the largest
   size also ``rpc_sync("worker1", echo, (t,))`` (``echo`` returns its argument): the tensor's
   plain round trip, what raw MPI does (the add of 64 MiB alone costs about as much as both
   copies, page faults of its fresh result included); the same ``echo`` of the 8 B tensor (a
   Python function, the path of user functions, where torch operators take a shortcut); and
   ``rpc_async(...).wait()`` of the 8 B
   add after 20 ms without traffic (an idle agent naps, so the first call after a quiet spell
   pays for waking it);
3. idle CPU: agent initialised, both main threads sleep 2 s, ``time.process_time()`` delta / wall;
4. compute slowdown: right after (3), a single-threaded compute block (256x256 ``torch.mm`` and
   a pure-Python loop, ``torch.set_num_threads(1)``) on both ranks with the agent idle (ON),
   over the same sleep + block run without any agent (OFF) just before init and just after
   shutdown (paired, both ranks computing); ON/OFF per round, then the median over rounds;
5. shutdown time.

The machine may be shared: before each step rank 0 waits (``--wait-quiet``, up to 20 s) until
other processes use < 0.15 cores; the CPU load of other processes during each step is measured
(``/proc/stat`` minus our two ranks), a step that saw more than ``--max-load`` cores is re-run
once (``--retries``; waits and re-runs stop after ``--budget`` s) keeping the quieter attempt,
and the report warns if the numbers are contaminated. Message sizes whose warm-up shows they
would take more than 3 s get fewer timed calls (at least 5).

Extra transports: subclass ``Backend`` (``init``/``roundtrip``/``shutdown``, plus ``serve`` if
rank 1 must act per message) or ``RpcBackend`` (anything with the ``torch.distributed.rpc`` API)
and add it to ``BACKENDS``.

Reported numbers are medians over rounds of the per-round medians. Rank 0 prints a table and
the target checks, and writes ``benchmarks/results/<tag>.json`` and ``<tag>.png``.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import pickle
import sys
import time
import traceback
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import torch  # noqa: E402
from _common import (  # noqa: E402
    REPO,
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

KiB, MiB = 1024, 1024 * 1024
# (message size in bytes, timed iterations, warm-up iterations) for the default run.
PLAN = [
    (8, 2000, 200),
    (64, 2000, 200),
    (1 * KiB, 2000, 200),
    (64 * KiB, 500, 50),
    (1 * MiB, 200, 20),
    (16 * MiB, 20, 3),
    (64 * MiB, 8, 2),
]
QUICK_PLAN = [(n, max(5, it // 10), max(2, w // 10)) for n, it, w in PLAN]
SIZE_CAP_S = 3.0  # per size and round: fewer timed calls (>= 5) if the warm-up says it is slow

TARGET_TINY_VS_TP = 0.25  # ours / TP at 8 B
TARGET_BIG_VS_MPI = 2.0  # ours / raw MPI at 64 MiB
TARGET_IDLE_CPU = 0.05  # ours, cores per rank


def size_label(nbytes: int) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


# --------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------


def echo(t: torch.Tensor) -> torch.Tensor:
    """The remote end of a plain tensor round trip (runs on rank 1, found there by name)."""
    return t


class Backend:
    """One transport under test. Rank 0 calls ``roundtrip`` in a timed loop while rank 1 is in
    ``serve``; both ranks call ``init``/``shutdown`` together."""

    name = "base"
    label = "base"
    #: Warm up, and time, for at least this long too (0: the planned calls only). For the
    #: RPC backends, so that both are sampled over stretches of the same length: this VM's
    #: speed changes over hundreds of ms, and a fixed count gave the faster backend the
    #: shorter warm-up (after a quiet spell ours runs 1.5-2x slower for ~0.1 s, more than
    #: 200 8 B calls) and a window a slow stretch could cover whole.
    warm_for_s = 0.0
    time_for_s = 0.0

    def __init__(self, comm: MPI.Comm):
        self.comm = comm  # harness communicator, for setup only
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.peer = 1 - self.rank

    def unavailable(self) -> str | None:
        """None if the backend can run here, else the reason it is skipped."""
        return None

    def init(self) -> None:
        pass

    def begin_size(self, t: torch.Tensor) -> None:
        """Rank 0, before the first call of one message size (e.g. allocate receive buffers)."""

    def begin_timed(self, iters: int) -> None:
        """Rank 0, after the warm-up: ``iters`` timed calls follow (fewer than planned if slow)."""

    def roundtrip(self, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def echo(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t`` sent and returned unchanged; None if ``roundtrip`` already is that."""
        return None

    def async_roundtrip(self, t: torch.Tensor) -> torch.Tensor | None:
        """``roundtrip`` through ``rpc_async(...).wait()``; None if not an RPC backend."""
        return None

    def expected(self, t: torch.Tensor) -> torch.Tensor:
        return t + 1

    def serve(self, plan: list[tuple[int, int, int]]) -> None:
        """Rank 1, while rank 0 times ``plan``."""

    def shutdown(self) -> None:
        pass


class RawMPI(Backend):
    """Blocking Send/Recv of pre-allocated tensor memory on a private communicator (echo)."""

    name = "mpi"
    label = "raw MPI"
    TAG = 7

    def init(self) -> None:
        self.wire = self.comm.Dup()

    def begin_size(self, t: torch.Tensor) -> None:
        self.recv_buf = torch.zeros_like(t)  # pages faulted in outside the timed loop
        # numpy views made once: the timed loop is just the two MPI calls
        self.send_view, self.recv_view = t.numpy(), self.recv_buf.numpy()

    def roundtrip(self, t: torch.Tensor) -> torch.Tensor:
        self.wire.Send(self.send_view, dest=self.peer, tag=self.TAG)
        self.wire.Recv(self.recv_view, source=self.peer, tag=self.TAG)
        return self.recv_buf

    def expected(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def begin_timed(self, iters: int) -> None:
        self.wire.send(iters, dest=self.peer, tag=self.TAG + 1)

    def serve(self, plan: list[tuple[int, int, int]]) -> None:
        for nbytes, _, warmup in plan:
            buf = torch.zeros(nbytes // 4).numpy()
            for _ in range(1 + warmup):  # 1 checked call + warm-up, then the timed ones
                self.wire.Recv(buf, source=self.peer, tag=self.TAG)
                self.wire.Send(buf, dest=self.peer, tag=self.TAG)
            for _ in range(self.wire.recv(source=self.peer, tag=self.TAG + 1)):
                self.wire.Recv(buf, source=self.peer, tag=self.TAG)
                self.wire.Send(buf, dest=self.peer, tag=self.TAG)

    def shutdown(self) -> None:
        self.wire.Free()


class MinimalPython(Backend):
    """The least a Python RPC does per message, with no agent: no threads, futures, timeouts.

    The call ``(function, args)`` is pickled with tensors swapped for a table (bytes inline
    up to 64 KiB, else one more message), sent with ``Isend`` and polled for with
    ``Improbe`` + ``sched_yield``; rank 1 unpickles it, runs it and answers the same way.
    The function travels as its pickled reference, made once.
    """

    name = "py"
    label = "minimal Python RPC (one thread, no agent)"
    TAG = 9
    INLINE_BYTES = 64 * KiB

    def init(self) -> None:
        self.wire = self.comm.Dup()
        self.status = MPI.Status()
        self.add_ref = pickle.dumps(torch.add, pickle.HIGHEST_PROTOCOL)
        self.functions: dict[bytes, object] = {}

    def _send(self, obj) -> None:
        tensors: list[torch.Tensor] = []

        def table_index(o):
            if type(o) is torch.Tensor:
                tensors.append(o)
                return len(tensors) - 1
            return None

        buf = io.BytesIO()
        pickler = pickle.Pickler(buf, pickle.HIGHEST_PROTOCOL)
        pickler.persistent_id = table_index
        pickler.dump(obj)
        metas = [
            (t.dtype, t.shape, bytearray(t.numpy()) if t.nbytes <= self.INLINE_BYTES else None)
            for t in tensors
        ]
        raw = pickle.dumps((buf.getvalue(), metas), pickle.HIGHEST_PROTOCOL)
        requests = [self.wire.Isend([raw, MPI.BYTE], self.peer, self.TAG)]
        requests += [
            self.wire.Isend(t.numpy(), self.peer, self.TAG + 1)
            for t, meta in zip(tensors, metas, strict=True)
            if meta[2] is None
        ]
        MPI.Request.Waitall(requests)

    def _receive(self):
        while (message := self.wire.Improbe(self.peer, self.TAG, self.status)) is None:
            os.sched_yield()
        raw = bytearray(self.status.Get_count(MPI.BYTE))
        message.Recv([raw, MPI.BYTE])
        payload, metas = pickle.loads(raw)
        tensors = []
        for dtype, shape, data in metas:
            if data is None:
                t = torch.empty(shape, dtype=dtype)
                self.wire.Recv(t.numpy(), self.peer, self.TAG + 1)
            else:
                t = torch.frombuffer(data, dtype=dtype).view(shape)
            tensors.append(t)
        unpickler = pickle.Unpickler(io.BytesIO(payload))
        unpickler.persistent_load = tensors.__getitem__
        return unpickler.load()

    def roundtrip(self, t: torch.Tensor) -> torch.Tensor:
        self._send((self.add_ref, (t, 1)))
        return self._receive()

    def begin_timed(self, iters: int) -> None:
        self.wire.send(iters, dest=self.peer, tag=self.TAG + 2)

    def _serve_one(self) -> None:
        ref, args = self._receive()
        func = self.functions.get(ref)
        if func is None:
            func = self.functions[ref] = pickle.loads(ref)
        self._send(func(*args))

    def serve(self, plan: list[tuple[int, int, int]]) -> None:
        for _, _, warmup in plan:
            for _ in range(1 + warmup):  # 1 checked call + warm-up, then the timed ones
                self._serve_one()
            for _ in range(self.wire.recv(source=self.peer, tag=self.TAG + 2)):
                self._serve_one()

    def shutdown(self) -> None:
        self.wire.Free()


class RpcBackend(Backend):
    """Anything with the ``torch.distributed.rpc`` API: init_rpc / rpc_sync / shutdown."""

    warm_for_s = 0.3
    time_for_s = 0.5

    def rpc_module(self):
        raise NotImplementedError

    def init_kwargs(self) -> dict:
        return {}

    def init(self) -> None:
        self.rpc = self.rpc_module()
        self.rpc.init_rpc(
            f"worker{self.rank}", rank=self.rank, world_size=self.size, **self.init_kwargs()
        )
        self.peer_name = f"worker{self.peer}"

    def roundtrip(self, t: torch.Tensor) -> torch.Tensor:
        return self.rpc.rpc_sync(self.peer_name, torch.add, (t, 1))

    def echo(self, t: torch.Tensor) -> torch.Tensor:
        return self.rpc.rpc_sync(self.peer_name, echo, (t,))

    def async_roundtrip(self, t: torch.Tensor) -> torch.Tensor:
        return self.rpc.rpc_async(self.peer_name, torch.add, (t, 1)).wait()

    def shutdown(self) -> None:
        self.rpc.shutdown()


class Ours(RpcBackend):
    name = "ours"
    label = "ours (lightning_distgrad.rpc)"

    def unavailable(self) -> str | None:
        try:
            import lightning_distgrad.rpc as rpc
        except Exception as exc:  # any import problem means "not ready yet"
            return f"import lightning_distgrad.rpc failed: {exc!r}"
        if not hasattr(rpc, "init_rpc"):
            return "lightning_distgrad.rpc has no init_rpc yet"
        return None

    def rpc_module(self):
        import lightning_distgrad.rpc as rpc

        return rpc


class TensorPipe(RpcBackend):
    name = "tp"
    label = "TensorPipe (torch.distributed.rpc)"

    def unavailable(self) -> str | None:
        return tensorpipe_unavailable()

    def rpc_module(self):
        import torch.distributed.rpc as rpc

        return rpc

    def init_kwargs(self) -> dict:
        return tensorpipe_kwargs(self.rpc, self.comm)


BACKENDS: dict[str, type[Backend]] = {
    "mpi": RawMPI,
    "py": MinimalPython,
    "ours": Ours,
    "tp": TensorPipe,
}


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------


def time_sizes(backend: Backend, plan: list[tuple[int, int, int]]) -> dict[int, dict]:
    """Rank 0: per-size RTT statistics (seconds)."""
    out = {}
    for nbytes, iters, warmup in plan:
        t = torch.ones(nbytes // 4)
        backend.begin_size(t)
        result = backend.roundtrip(t)
        if not torch.equal(result, backend.expected(t)):
            raise RuntimeError(f"{backend.name}: wrong result for {size_label(nbytes)}")
        del result
        t0 = time.perf_counter()
        done = 0
        while done < warmup or (
            backend.warm_for_s
            and done < 100 * warmup
            and time.perf_counter() - t0 < backend.warm_for_s
        ):
            backend.roundtrip(t)
            done += 1
        per_call = max(time.perf_counter() - t0, 1e-9) / max(done, 1)
        if backend.time_for_s:  # as many calls as fill that time (at most 100x the plan)
            iters = max(iters, min(100 * iters, int(backend.time_for_s / per_call)))
        iters = max(5, min(iters, int(SIZE_CAP_S / per_call)))  # bound the time on a slow box
        gc.collect()
        backend.begin_timed(iters)
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            backend.roundtrip(t)
            samples.append(time.perf_counter() - t0)
        out[nbytes] = summarize(samples)
    out["echo"] = time_echo(backend, t, iters)
    out["echo_small"] = time_echo(backend, torch.ones(plan[0][0] // 4), iters)
    out["after_quiet"] = time_after_quiet(backend, torch.ones(plan[0][0] // 4), iters)
    return out


QUIET_S = 0.02


def time_after_quiet(backend: Backend, t: torch.Tensor, iters: int) -> dict | None:
    """Rank 0: ``backend.async_roundtrip(t)`` after ``QUIET_S`` without traffic, ``iters`` times."""
    if backend.async_roundtrip(t) is None:
        return None
    samples = []
    for _ in range(max(iters, 10)):
        time.sleep(QUIET_S)
        samples.append(timed(lambda: backend.async_roundtrip(t)))
    return summarize(samples)


def time_echo(backend: Backend, t: torch.Tensor, iters: int) -> dict | None:
    """Rank 0: RTT statistics of ``backend.echo(t)``; None if the backend has no echo."""
    result = backend.echo(t)
    if result is None:
        return None
    if not torch.equal(result, t):
        raise RuntimeError(f"{backend.name}: echo returned a different tensor")
    del result
    backend.echo(t)  # warm-up
    gc.collect()
    return summarize([timed(lambda: backend.echo(t)) for _ in range(iters)])


class Compute:
    """Fixed single-threaded work for the main thread: 256x256 mm and a pure-Python loop."""

    def __init__(self, mm_iters: int, py_iters: int, reps: int):
        self.mm_iters, self.py_iters, self.reps = mm_iters, py_iters, reps
        self.a, self.b = torch.randn(256, 256), torch.randn(256, 256)
        self.c = torch.empty(256, 256)

    def run(self, comm: MPI.Comm) -> dict[str, list[float]]:
        quiet_barrier(comm)  # both ranks compute at the same time
        times: dict[str, list[float]] = {"mm": [], "py": [], "other_threads_cpu": []}
        for _ in range(self.reps):
            cpu0, thr0 = time.process_time(), time.thread_time()
            t0 = time.perf_counter()
            for _ in range(self.mm_iters):
                torch.mm(self.a, self.b, out=self.c)
            t1 = time.perf_counter()
            acc = 0
            for i in range(self.py_iters):
                acc += i & 7
            t2 = time.perf_counter()
            times["mm"].append(t1 - t0)
            times["py"].append(t2 - t1)
            # CPU used by threads other than this one (agent threads) per wall second.
            other = (time.process_time() - cpu0) - (time.thread_time() - thr0)
            times["other_threads_cpu"].append(max(0.0, other) / (t2 - t0))
        return times


def quiet_phase(comm: MPI.Comm, compute: Compute, seconds: float) -> dict:
    """Idle CPU, then the compute block. Run the same way with an agent initialised (ON) and
    without one (OFF), so both see the same history (a sleeping vCPU may come back faster)."""
    quiet_barrier(comm)
    cpu0, t0 = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    # process CPU time (all threads) per wall second while the main thread sleeps
    idle = (time.process_time() - cpu0) / (time.perf_counter() - t0)
    return {"idle_cpu": idle, **compute.run(comm)}


def run_step(backend: Backend, plan, args, comm: MPI.Comm, compute: Compute) -> dict:
    """One backend, one round: init, RTTs, idle CPU + compute (ON), shutdown."""
    rank = comm.Get_rank()
    step: dict = {"backend": backend.name}
    err = None
    quiet_barrier(comm)
    if not init_on_all(backend, comm, step):
        return step

    quiet_barrier(comm)
    try:
        if rank == 0:
            step["rtt"] = time_sizes(backend, plan)
        else:
            backend.serve(plan)
    except Exception:
        err = traceback.format_exc()
    quiet_barrier(comm)
    if not agree(comm, err is None):
        step["error"] = err or "failed on the other rank"
    else:
        step["on"] = quiet_phase(comm, compute, args.idle_seconds)
        step["idle_cpu"] = step["on"]["idle_cpu"]

    quiet_barrier(comm)
    step["shutdown_s"] = timed(backend.shutdown)
    return step


def run_rounds(backends, names, plan, args, comm, compute, t_start):
    """Interleaved rounds of steps, each followed by an agent-free OFF phase. A step during which
    other processes used more than --max-load cores is run again (--retries times at most, while
    within --budget), keeping the least disturbed attempt. Returns (steps, discarded attempts)."""
    rank = comm.Get_rank()
    sizes = [n for n, _, _ in plan]
    Compute(compute.mm_iters, compute.py_iters, reps=2).run(comm)  # warm-up, discarded
    last_off = quiet_phase(comm, compute, args.idle_seconds)
    steps, discarded, disabled = [], [], set()
    for rnd in range(args.rounds):
        for name in names:
            if name in disabled:
                continue
            attempts = []
            while True:
                in_budget = time.perf_counter() - t_start < args.budget
                max_wait = args.wait_quiet if in_budget else 0.0
                step = {"round": rnd, "foreign_before": wait_quiet(comm, max_wait)}
                load = StepLoad(comm)
                step |= run_step(backends[name], plan, args, comm, compute)
                off = quiet_phase(comm, compute, args.idle_seconds)
                step["off_before"], step["off_after"], last_off = last_off, off, off
                foreign = load.stop().get("foreign_cores")  # CPU of other processes, rank 0
                if foreign is not None:
                    step["foreign_cores"] = foreign
                attempts.append(step)
                again = busy_again(step, len(attempts), args, in_budget)
                if rank == 0:
                    print_step(step, name, sizes, t_start, again)
                if not comm.bcast(again, root=0):
                    break
            keep_quietest(comm, attempts, steps, discarded)
            if "error" in step:
                disabled.add(name)  # e.g. TensorPipe refusing a second init_rpc
    return steps, discarded


def print_step(step: dict, name: str, sizes: list[int], t_start: float, again: bool) -> None:
    head = f"[round {step['round'] + 1}] {name:>4}:"
    if print_step_error(head, step):
        return
    r = step["rtt"]
    print(
        f"{head} init {fmt_time(step['init_s'])}, "
        f"{size_label(sizes[0])} {fmt_time(r[sizes[0]]['median'])}, "
        f"{size_label(sizes[-1])} {fmt_time(r[sizes[-1]]['median'])}"
        + (f" (echo {fmt_time(r['echo']['median'])})" if r.get("echo") else "")
        + ", "
        f"idle CPU {step['idle_cpu']:.2f}, shutdown {fmt_time(step['shutdown_s'])}, "
        + load_note(step, again, t_start),
        flush=True,
    )


# --------------------------------------------------------------------------------------------
# Reporting (rank 0)
# --------------------------------------------------------------------------------------------


def aggregate(steps0: list[dict], steps1: list[dict], names, sizes):
    """Medians over rounds of per-round medians, per backend."""
    summary: dict = {}
    for name in names:
        idx = [i for i, s in enumerate(steps0) if s["backend"] == name]
        ok = [i for i in idx if "error" not in steps0[i] and "error" not in steps1[i]]
        b: dict = {"rounds_ok": len(ok), "errors": [steps0[i].get("error") for i in idx]}
        b["errors"] = [e for e in b["errors"] if e]
        rtt = {}
        for n in sizes:
            per_round = [steps0[i]["rtt"][n]["median"] for i in ok if n in steps0[i]["rtt"]]
            if per_round:
                rtt[n] = {
                    "median": med(per_round),
                    "min": min(per_round),
                    "max": max(per_round),
                    "per_round": per_round,
                }
        b["rtt"] = rtt
        # The plain tensor round trip at the largest size (raw MPI's round trip is one).
        echoes = [
            (steps0[i]["rtt"].get("echo") or steps0[i]["rtt"][sizes[-1]])["median"]
            for i in ok
            if sizes[-1] in steps0[i]["rtt"]
        ]
        b["echo"] = med(echoes) if echoes else None
        for key in ("after_quiet", "echo_small"):
            found = [steps0[i]["rtt"][key]["median"] for i in ok if steps0[i]["rtt"].get(key)]
            b[key] = med(found) if found else None
        b["init_s"] = med([steps0[i]["init_s"] for i in ok])
        b["shutdown_s"] = med([steps0[i]["shutdown_s"] for i in ok])
        for rank, steps in ((0, steps0), (1, steps1)):
            b[f"idle_cpu_rank{rank}"] = med([steps[i]["idle_cpu"] for i in ok])
            for kind in ("mm", "py"):
                ratios = []
                for i in ok:
                    off = steps[i]["off_before"][kind] + steps[i]["off_after"][kind]
                    ratios.append(med(steps[i]["on"][kind]) / med(off))
                b[f"slowdown_{kind}_rank{rank}"] = med(ratios)
                b[f"slowdown_{kind}_rank{rank}_per_round"] = ratios
            b[f"agent_threads_cpu_during_compute_rank{rank}"] = med(
                [med(steps[i]["on"]["other_threads_cpu"]) for i in ok]
            )
        summary[name] = b
    summary["no agent"] = {
        f"idle_cpu_rank{rank}": med([s["off_after"]["idle_cpu"] for s in steps])
        for rank, steps in ((0, steps0), (1, steps1))
    }
    summary["others_load_cores"] = load_summary(steps0)
    return summary


def print_report(summary: dict, names: list[str], sizes: list[int], skipped: dict) -> list[str]:
    lines: list[str] = []

    def p(line: str) -> None:
        lines.append(line.rstrip())

    cols = [n for n in ("mpi", "py", "ours", "tp") if n in names] + [
        n for n in names if n not in ("mpi", "py", "ours", "tp")
    ]
    have = {n: bool(summary.get(n, {}).get("rtt")) for n in cols}

    def rtt(name, n):
        return summary[name]["rtt"].get(n, {}).get("median") if have.get(name) else None

    def ratio(a, b):
        return f"{a / b:.2f}" if a is not None and b is not None else "-"

    header = f"{'size':>8} " + "".join(f"{n + ' RTT':>13}" for n in cols)
    header += f"{'ours/TP':>9}{'ours/MPI':>10}"
    p("Round-trip time, median over rounds of per-round medians (rank 0 -> rank 1 -> rank 0):")
    p(header)
    for n in sizes:
        row = f"{size_label(n):>8} " + "".join(f"{fmt_time(rtt(c, n)):>13}" for c in cols)
        row += f"{ratio(rtt('ours', n), rtt('tp', n)):>9}{ratio(rtt('ours', n), rtt('mpi', n)):>10}"
        p(row)
    echo = {c: summary[c].get("echo") if have[c] else None for c in cols}
    row = f"{size_label(sizes[-1]) + ' echo':>8} "
    row += "".join(f"{fmt_time(echo[c]):>13}" for c in cols)
    row += f"{ratio(echo.get('ours'), echo.get('tp')):>9}"
    row += f"{ratio(echo.get('ours'), echo.get('mpi')):>10}"
    p(row)
    p(
        "  (echo: rpc_sync(echo, (t,)) returns t unchanged, the tensor's plain round trip;"
        " raw MPI's row above is one)"
    )
    small = {c: summary[c].get("echo_small") if have[c] else None for c in cols}
    row = f"{size_label(sizes[0]) + ' fn':>8} " + "".join(f"{fmt_time(small[c]):>13}" for c in cols)
    p(row + f"{ratio(small.get('ours'), small.get('tp')):>9}")
    p(
        f"  (fn: rpc_sync(echo, ({size_label(sizes[0])} tensor,)), a Python function: "
        "the path of user functions)"
    )
    quiet = {c: summary[c].get("after_quiet") if have[c] else None for c in cols}
    row = f"{'quiet':>8} " + "".join(f"{fmt_time(quiet[c]):>13}" for c in cols)
    p(row + f"{ratio(quiet.get('ours'), quiet.get('tp')):>9}")
    p(
        f"  (quiet: rpc_async(torch.add, ({size_label(sizes[0])} tensor, 1)).wait() after "
        f"{QUIET_S * 1000:.0f} ms without traffic)"
    )
    for name, why in skipped.items():
        p(f"  [{name} skipped: {why}]")
    p("")
    p("Per backend, medians over rounds (r0 = rank 0 driving, r1 = rank 1 serving):")
    p("  idle CPU: cores used by the process while its main thread sleeps, agent initialised;")
    p("  slowdown: single-threaded compute with the agent idle (ON) / without any agent (OFF);")
    p("  agent CPU: cores used by other threads of the process during that compute.")
    p(
        f"{'':>8}{'init':>10}{'shutdown':>10}  {'idle CPU r0/r1':>15}  {'slowdown mm r0/r1':>18}"
        f"  {'python r0/r1':>14}  {'agent CPU r0/r1':>15}"
    )
    for n in [c for c in cols if have[c]]:
        b = summary[n]
        p(
            f"{n:>8}{fmt_time(b['init_s']):>10}{fmt_time(b['shutdown_s']):>10}"
            f"  {b['idle_cpu_rank0']:>7.3f}/{b['idle_cpu_rank1']:<7.3f}"
            f"  {b['slowdown_mm_rank0']:>9.3f}/{b['slowdown_mm_rank1']:<8.3f}"
            f"  {b['slowdown_py_rank0']:>7.3f}/{b['slowdown_py_rank1']:<6.3f}"
            f"  {b['agent_threads_cpu_during_compute_rank0']:>7.2f}/"
            f"{b['agent_threads_cpu_during_compute_rank1']:<7.2f}"
        )
    b = summary["no agent"]
    p(f"{'no agent':>8}{'':>20}  {b['idle_cpu_rank0']:>7.3f}/{b['idle_cpu_rank1']:<7.3f}")
    load = summary["others_load_cores"]
    if load["median"] is not None:
        p(
            f"other processes' CPU load during the steps (cores): median {load['median']:.2f}, "
            f"max {load['max']:.2f}; {summary.get('steps_rerun_because_busy', 0)} steps re-run"
            + busy_warning(load["max"])
        )
    for line in error_lines(summary, cols):
        p(line)
    p("")

    def check(desc, value, limit):
        p(target_line(desc, value, limit))

    p("Targets:")
    tiny, big = sizes[0], sizes[-1]
    r = rtt("ours", tiny), rtt("tp", tiny)
    check(
        f"{size_label(tiny)} RTT ours/TP", r[0] / r[1] if None not in r else None, TARGET_TINY_VS_TP
    )
    r = rtt("py", tiny), rtt("tp", tiny), rtt("ours", tiny)
    if None not in r:
        p(
            f"  info  {size_label(tiny)} RTT minimal Python/TP = {r[0] / r[1]:.3f} (the floor of "
            f"any Python per-message path here); ours/minimal Python = {r[2] / r[0]:.2f}"
        )
    r = echo.get("ours"), echo.get("mpi")
    check(
        f"{size_label(big)} tensor round trip (echo) ours/raw MPI",
        r[0] / r[1] if None not in r else None,
        TARGET_BIG_VS_MPI,
    )
    r = rtt("ours", big), rtt("mpi", big)
    if None not in r:
        p(
            f"  info  {size_label(big)} RTT with the remote torch.add ours/raw MPI = "
            f"{r[0] / r[1]:.3f} (raw MPI only echoes)"
        )
    idle = None
    if have.get("ours"):
        idle = max(summary["ours"]["idle_cpu_rank0"], summary["ours"]["idle_cpu_rank1"])
    check("ours idle CPU, max over ranks (cores)", idle, TARGET_IDLE_CPU)
    print("\n".join(lines), flush=True)
    return lines


def plot(summary: dict, names: list[str], sizes: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(7, 5))
    for name in names:
        rtt = summary.get(name, {}).get("rtt", {})
        xs = [n for n in sizes if n in rtt]
        if not xs:
            continue
        ys = [rtt[n]["median"] for n in xs]
        lo = [rtt[n]["median"] - rtt[n]["min"] for n in xs]
        hi = [rtt[n]["max"] - rtt[n]["median"] for n in xs]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=BACKENDS[name].label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [size_label(n) for n in sizes], fontsize=8)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: fmt_time(y)))
    ax.set_xlabel("message size (float32 tensor, sent and returned)")
    ax.set_ylabel("round-trip time (median over rounds; bars: min-max)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="few iterations (< ~60 s)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument(
        "--backends", default="mpi,py,ours,tp", help="comma list of " + ",".join(BACKENDS)
    )
    ap.add_argument(
        "--idle-seconds",
        type=float,
        default=None,
        help="main-thread sleep for the idle-CPU probe (default 2, --quick 1)",
    )
    ap.add_argument("--tag", default=None, help="output file stem (default bench_rpc[_quick])")
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=20.0,
        metavar="S",
        help="before each step wait up to S s for other processes to go idle "
        "(shared machine); 0 disables",
    )
    add_max_load_arg(ap)
    ap.add_argument("--retries", type=int, default=1, help="re-runs per busy step (default 1)")
    ap.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="S",
        help="no waits or re-runs after S s (default 150, --quick 40)",
    )
    ap.add_argument("--timeout", type=float, default=900, help="abort the job after this many s")
    args = ap.parse_args()

    warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")  # torch rpc init noise
    torch.set_num_threads(1)
    comm = two_rank_comm("bench_rpc")
    rank = comm.Get_rank()
    timer = start_watchdog(
        args.timeout, f"[rank {rank}] bench_rpc: timeout after {args.timeout} s, aborting"
    )

    plan = QUICK_PLAN if args.quick else PLAN
    if args.idle_seconds is None:
        args.idle_seconds = 1.0 if args.quick else 2.0
    if args.budget is None:
        args.budget = 40.0 if args.quick else 150.0
    sizes = [n for n, _, _ in plan]
    compute = Compute(mm_iters=300, py_iters=600_000, reps=2 if args.quick else 5)
    tag = args.tag or ("bench_rpc_quick" if args.quick else "bench_rpc")

    names, skipped, backends = [], {}, {}
    for name in args.backends.split(","):
        backend = BACKENDS[name.strip()](comm)
        why = agreed_reason(comm, backend.unavailable())  # both ranks must agree
        if why:
            skipped[backend.name] = why
        else:
            names.append(backend.name)
            backends[backend.name] = backend

    env = base_env() | {
        "mpi_thread_level": MPI.Query_thread(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE"),
        "torch_threads": torch.get_num_threads(),
    }
    if rank == 0:
        thp = env["THP_MEM_ALLOC_ENABLE"]
        print(
            f"bench_rpc: {env['host']}, {env['cpus']} CPUs, torch {env['torch']}, "
            f"mpi4py {env['mpi4py']}, {env['mpi_library']}"
        )
        print(
            f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}, torch threads {env['torch_threads']}, "
            f"THP_MEM_ALLOC_ENABLE={thp or 'unset'}"
            + ("" if thp == "1" else " (recommended: THP_MEM_ALLOC_ENABLE=1)")
        )
        print(
            f"backends: {', '.join(names)}; skipped: "
            + (", ".join(f"{k} ({v})" for k, v in skipped.items()) or "none")
        )
        print(
            f"rounds: {args.rounds}, {'quick' if args.quick else 'default'} plan: "
            + ", ".join(f"{size_label(n)} x{it}" for n, it, _ in plan),
            flush=True,
        )

    t_start = time.perf_counter()
    steps, discarded = run_rounds(backends, names, plan, args, comm, compute, t_start)
    all_steps = comm.gather(steps, root=0)
    timer.cancel()
    if rank != 0:
        return

    # a rank-1 failure shows up in rank 0's step too
    for step0, step1 in zip(all_steps[0], all_steps[1], strict=True):
        if "error" in step1:
            step0.setdefault("error", "rank 1: " + step1["error"])
    summary = aggregate(all_steps[0], all_steps[1], names, sizes)
    summary["steps_rerun_because_busy"] = len(discarded)
    print(f"\nTotal {time.perf_counter() - t_start:.0f} s.\n")
    lines = print_report(summary, names, sizes, skipped)

    json_path, png_path = result_paths(tag)
    doc = {
        "command": " ".join(sys.argv),
        "env": env,
        "rounds": args.rounds,
        "plan": [{"bytes": n, "iters": it, "warmup": w} for n, it, w in plan],
        "skipped": skipped,
        "summary": summary,
        "report": lines,
        "steps": {"rank0": all_steps[0], "rank1": all_steps[1]},
        "discarded_busy_steps_rank0": discarded,
    }
    json_path.write_text(json.dumps(doc, indent=1, default=str))
    title = (
        f"RPC round trip, 2 ranks, {env['host']} ({env['cpus']} CPUs), "
        f"THP_MEM_ALLOC_ENABLE={env['THP_MEM_ALLOC_ENABLE'] or 'unset'}"
    )
    plot(summary, names, sizes, png_path, title)
    print(f"\nwrote {json_path.relative_to(REPO)} and {png_path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
