"""Helpers and remote functions shared by the distributed autograd tests.

Every rank imports this module (the test modules do), so the functions below
can be sent by reference in RPCs. Helpers that talk to the other ranks
(:func:`exchange`, :func:`wait_everywhere`) are collectives: call them
unconditionally on every rank.
"""

from __future__ import annotations

import contextlib
import enum
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import torch
from _timing import scaled
from torch.autograd.function import once_differentiable

import lightning_distgrad.autograd as dist_autograd
from lightning_distgrad import rpc

#: Bound for anything asynchronous to settle (context cleanup, late passes), before
#: :func:`_timing.scaled`.
SETTLE_TIMEOUT_S = 30.0


def make_trainer(strategy=None, **kwargs):
    """A quiet CPU ``lightning.Trainer`` (no logger, checkpoints, summary, progress bar or
    validation) on ``strategy``, by default ``DistAutogradStrategy(num_servers=1)``;
    ``kwargs`` add to or override its options."""
    import lightning as L

    from lightning_distgrad import DistAutogradStrategy

    options = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    options.update(kwargs)
    return L.Trainer(strategy=strategy or DistAutogradStrategy(num_servers=1), **options)


# ---------------------------------------------------------------------------
# Waiting and collectives


def wait_until(
    predicate: Callable[[], bool], timeout: float = SETTLE_TIMEOUT_S, interval: float = 0.005
) -> bool:
    """Poll ``predicate`` until it is true or ``scaled(timeout)`` s pass (see ``_timing``);
    returns its last value."""
    deadline = time.monotonic() + scaled(timeout)
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return bool(predicate())
        time.sleep(interval)


def exchange(world, obj):
    """Allgather ``obj`` over the test communicator (after a sleeping barrier)."""
    world.barrier()
    return world.comm.allgather(obj)


def seeded(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """``module`` with parameters drawn from ``seed`` (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return module


def mlp() -> torch.nn.Module:
    """A small seeded MLP, 4 -> 8 -> 3."""
    nn = torch.nn
    return seeded(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)))


@contextlib.contextmanager
def gloo_process_group(world) -> Iterator[None]:
    """torch.distributed's default process group (gloo) over the session's ranks, for DDP;
    a collective. Its rendezvous is a TCPStore on loopback whose port rank 0 broadcasts."""
    import torch.distributed as dist

    size = world.size
    if world.rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
        exchange(world, store.port)
    else:
        port = exchange(world, None)[0]
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False)
    dist.init_process_group("gloo", store=store, rank=world.rank, world_size=size)
    try:
        yield
    finally:
        world.barrier()
        dist.destroy_process_group()


def debug_info() -> dict[str, int]:
    return dist_autograd._get_debug_info()


def has_context(context_id: int) -> bool:
    try:
        dist_autograd._retrieve_context(context_id)
    except RuntimeError:
        return False
    return True


def assert_no_backward_pass_anywhere(world, timeout: float = 10.0) -> None:
    """After a barrier, no rank may show a running backward pass (bounded wait).

    The verdict is gathered, so every rank passes or fails together.
    """
    world.barrier()
    wait_until(lambda: debug_info()["num_current_backward_passes"] == 0, timeout)
    counts = exchange(world, debug_info()["num_current_backward_passes"])
    assert counts == [0] * world.size, (
        f"backward passes still running, per rank: {counts} (rank {world.rank} asks)"
    )


def assert_contexts_released(
    world, context_ids: Sequence[int], timeout: float = SETTLE_TIMEOUT_S
) -> None:
    """Every rank waits (bounded) until it holds none of ``context_ids``; a collective."""
    world.barrier()
    ids = list(context_ids)
    ok = wait_until(lambda: not any(has_context(i) for i in ids), timeout)
    left = [hex(i) for i in ids if has_context(i)]
    world.barrier()
    assert ok, (
        f"rank {world.rank} still holds contexts {left} {scaled(timeout):g} s after their release"
    )


def wait_for_no_contexts(world, timeout: float = SETTLE_TIMEOUT_S) -> dict[str, int]:
    """Every rank waits (bounded) until it holds no context at all; a collective.

    Returns this rank's debug info as taken before the closing barrier: after
    it, a faster rank may already have sent this one a request in a context.
    """
    world.barrier()
    ok = wait_until(lambda: debug_info()["num_autograd_contexts"] == 0, timeout)
    info = debug_info()
    world.barrier()
    assert ok, (
        f"rank {world.rank}: contexts left {scaled(timeout):g} s after the last release: {info}"
    )
    return info


_gates: dict = {}
_gates_lock = threading.Lock()


def _gate(key) -> threading.Event:
    with _gates_lock:
        return _gates.setdefault(key, threading.Event())


def wait_at_gate(key, value=None):
    """Block until :func:`open_gate` ``(key)`` ran in this process (an RPC may run either);
    then return ``value``. Fails after SETTLE_TIMEOUT_S."""
    assert _gate(key).wait(scaled(SETTLE_TIMEOUT_S)), f"gate {key!r} was never opened"
    return value


def open_gate(key) -> None:
    _gate(key).set()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------------
# Running a function locally or on another worker


class ExecMode(enum.Enum):
    LOCAL = "local"
    RPC_SYNC = "rpc_sync"
    RPC_ASYNC = "rpc_async"
    REMOTE = "remote"


REMOTE_MODES = [ExecMode.RPC_SYNC, ExecMode.RPC_ASYNC, ExecMode.REMOTE]


def exec_func(mode: ExecMode, dst, fn: Callable, *args):
    if mode is ExecMode.LOCAL:
        return fn(*args)
    if mode is ExecMode.RPC_SYNC:
        return rpc.rpc_sync(dst, fn, args)
    if mode is ExecMode.RPC_ASYNC:
        return rpc.rpc_async(dst, fn, args).wait()
    if mode is ExecMode.REMOTE:
        return rpc.remote(dst, fn, args).to_here()
    raise ValueError(mode)


class Rotation:
    """The other workers in turn (torch's ``_next_rank``), starting after this rank."""

    def __init__(self, world, include_self: bool = False):
        self._world = world
        self._distances = list(range(1, world.size)) + ([0] if include_self else [])
        self._i = 0

    def next(self) -> str:
        d = self._distances[self._i % len(self._distances)]
        self._i += 1
        return self._world.peer(d)


def local_grads(forward: Callable, *leaves: torch.Tensor) -> list[torch.Tensor | None]:
    """Run ``forward(LOCAL exec, *clones)`` with plain autograd; the clones' ``.grad``."""
    clones = [t.detach().clone().requires_grad_(t.requires_grad) for t in leaves]
    roots = forward(lambda fn, *args: fn(*args), *clones)
    torch.autograd.backward(list(roots))
    return [c.grad for c in clones]


def assert_grads_match(
    grads: dict, leaves: Sequence[torch.Tensor], expected: Sequence[torch.Tensor | None]
) -> None:
    """torch's ``_verify_backwards``: the leaves with a local grad, and nothing else."""
    with_grad = 0
    for i, (leaf, exp) in enumerate(zip(leaves, expected, strict=True)):
        if exp is None:
            assert leaf not in grads, f"leaf {i} has no local gradient but got one in the context"
            continue
        with_grad += 1
        assert leaf in grads, f"leaf {i} is missing from get_gradients()"
        torch.testing.assert_close(grads[leaf], exp, msg=lambda m, i=i: f"leaf {i}: {m}")
    assert len(grads) == with_grad, (
        f"get_gradients() has extra entries: {len(grads)} != {with_grad}"
    )


def check_against_local(
    forward: Callable, mode: ExecMode, dst, *leaves: torch.Tensor, retain_graph: bool = False
) -> dict:
    """``forward`` via ``mode`` inside a context, backward, compare with local autograd."""
    expected = local_grads(forward, *leaves)
    with dist_autograd.context() as context_id:
        roots = forward(lambda fn, *args: exec_func(mode, dst, fn, *args), *leaves)
        dist_autograd.backward(context_id, list(roots), retain_graph=retain_graph)
        grads = dist_autograd.get_gradients(context_id)
        assert_grads_match(grads, leaves, expected)
    for leaf in leaves:
        assert leaf.grad is None, ".grad of a leaf was touched by the distributed backward"
    return grads


# ---------------------------------------------------------------------------
# Remote functions


def my_py_add(t1, t2):
    return torch.add(t1, t2)


def my_scalar_add(a, b):
    return a + b


def my_py_nested_call(t1, t2, path: list[str]):
    """Forward ``(t1, t2)`` along ``path``; the last worker runs ``my_py_add``."""
    if len(path) > 1:
        return rpc.rpc_sync(path[0], my_py_nested_call, (t1, t2, path[1:]))
    return rpc.rpc_sync(path[0], my_py_add, (t1, t2))


def my_rref_add(rref_t1, t2):
    return torch.add(rref_t1.local_value(), t2)


def my_nested_rref_add(dst, rref_t1, t2):
    return rpc.rpc_sync(dst, my_rref_add, (rref_t1, t2))


def torch_ones(shape, requires_grad=False):
    return torch.ones(shape, requires_grad=requires_grad)


def owner_grad(context_id: int, rref) -> torch.Tensor | None:
    """On the RRef's owner: the gradient of its value in ``context_id`` (None if absent)."""
    return dist_autograd.get_gradients(context_id).get(rref.local_value())


# ---------------------------------------------------------------------------
# Autograd functions for error and timing tests; flags are per key (a context
# id), so ranks running the same test at once do not disturb each other.

_flags: dict = {}
_flags_lock = threading.Lock()


def set_flag(key, value) -> None:
    with _flags_lock:
        if value is None:
            _flags.pop(key, None)
        else:
            _flags[key] = value


def get_flag(key, default=None):
    with _flags_lock:
        return _flags.get(key, default)


class SimulateBackwardError(torch.autograd.Function):
    """Identity whose backward raises while the flag ``("fail", key)`` is set."""

    @staticmethod
    def forward(ctx, x, key):
        ctx.key = key
        return x.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        if get_flag(("fail", ctx.key), False):
            raise Exception("Simulate error on backward pass")
        return grad, None


class SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps ``flag(("sleep", key))`` seconds, then waits while the
    flag ``("hold", key)`` is set (at most SETTLE_TIMEOUT_S); the flag ``("running", key)``
    is set while it runs."""

    @staticmethod
    def forward(ctx, x, key):
        ctx.key = key
        return x.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        set_flag(("running", ctx.key), True)
        try:
            time.sleep(get_flag(("sleep", ctx.key), 0.0))
            wait_until(lambda: not get_flag(("hold", ctx.key), False))
        finally:
            set_flag(("running", ctx.key), None)
        return grad, None


def current_context_id() -> int:
    return dist_autograd._current_context()._context_id()


def udf_with_backward_error(t1, t2):
    """torch's ``_python_udf_with_backward_error``, keyed by the context it runs in."""
    t3 = t1 + t2
    t4 = SimulateBackwardError.apply(t3, current_context_id())
    return t3 + t4


def nested_udf_with_backward_error(t1, t2, dst):
    """A -> B -> C: the error is raised in C's part of the graph."""
    t3 = t1 * t2
    t4 = rpc.rpc_sync(dst, udf_with_backward_error, (t3, t2))
    return t4 * t1


def udf_with_slow_backward(t1, t2):
    return SlowBackward.apply(t1 * t2, current_context_id())


def sampled_batch(dataset, index: int, trainers: int, batch_size: int, epoch: int = 0):
    """What all trainers see together at batch ``index`` of ``epoch`` (``batch_size`` each).

    Lightning gives each trainer a shuffling ``DistributedSampler`` (seed ``PL_GLOBAL_SEED``,
    ``set_epoch`` every epoch); the reference takes the same indices.
    """
    from torch.utils.data import DistributedSampler

    rows = []
    for t in range(trainers):
        sampler = DistributedSampler(
            dataset,
            num_replicas=trainers,
            rank=t,
            shuffle=True,
            seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),
        )
        sampler.set_epoch(epoch)
        rows += list(sampler)[index * batch_size : (index + 1) * batch_size]
    return tuple(tensor[rows] for tensor in dataset.tensors)
