"""``DistributedOptimizer``: one local ``torch.optim`` optimizer per parameter owner.

The caller groups the parameter RRefs by owner and asks each owner (over RPC)
to build a local optimizer over its own parameters; ``step(context_id)`` then
asks every owner, concurrently, to apply the gradients that distributed
autograd accumulated there in that context. All local optimizers of a process
share one lock, so steps on a worker never interleave.
"""

from __future__ import annotations

import collections
import copy
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .. import autograd as dist_autograd
from ..rpc._internal import call_all
from ..rpc.rref import RRef

__all__ = ["DistributedOptimizer"]


# ---------------------------------------------------------------------------
# Owner side


class _LocalOptimizer:
    """The optimizer over one owner's parameters; lives on that owner behind an RRef."""

    # One lock for every local optimizer of the process. As in torch, several
    # optimizers on one worker are assumed to share parameters (each trainer's
    # DistributedOptimizer builds its own on a parameter server), so their steps,
    # state reads and state loads are serialised.
    global_lock = threading.Lock()

    def __init__(
        self,
        optim_cls: type[torch.optim.Optimizer],
        local_params_rref: list[RRef],
        *args: Any,
        **kwargs: Any,
    ):
        self._local_params = [rref.local_value() for rref in local_params_rref]
        self.optim = optim_cls(self._local_params, *args, **kwargs)

    def step(self, context_id: int) -> None:
        self.step_with(dist_autograd._gradients_here(context_id))

    def step_with(self, grads: Mapping[torch.Tensor, torch.Tensor]) -> None:
        """One step with ``grads`` (``{parameter: gradient}``) as the parameters' ``.grad``."""
        with _LocalOptimizer.global_lock:
            # A parameter without a gradient in this context gets ``grad=None``,
            # which every torch.optim optimizer skips: it is left unchanged.
            for param in self._local_params:
                param.grad = grads.get(param)
            try:
                self.optim.step()
            finally:
                # Gradients live in the context: never leave them on ``.grad``.
                for param in self._local_params:
                    param.grad = None

    def state_dict(self) -> dict[str, Any]:
        with _LocalOptimizer.global_lock:
            # A deep copy: the reply's tensors are sent after the lock is released.
            return copy.deepcopy(self.optim.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        with _LocalOptimizer.global_lock:
            self.optim.load_state_dict(state_dict)


# RPC handlers.


def _new_local_optimizer(
    optim_cls: type[torch.optim.Optimizer], local_params_rref: list[RRef], *args: Any, **kwargs: Any
) -> tuple[RRef | None, list[tuple[int, str]]]:
    """(the local optimizer, []), or (None, [(position, type name)]) if some RRef holds no
    tensor: the caller raises for those, and no optimizer is built on bad parameters."""
    not_tensors = [
        (i, type(value).__name__)
        for i, rref in enumerate(local_params_rref)
        if not isinstance(value := rref.local_value(), torch.Tensor)
    ]
    if not_tensors:
        return None, not_tensors
    return RRef(_LocalOptimizer(optim_cls, local_params_rref, *args, **kwargs)), []


def _local_optimizer_step(local_optim_rref: RRef, context_id: int) -> None:
    local_optim_rref.local_value().step(context_id)


def _local_optimizer_state_dict(local_optim_rref: RRef) -> dict[str, Any]:
    return local_optim_rref.local_value().state_dict()


def _local_optimizer_load_state_dict(local_optim_rref: RRef, state_dict: dict) -> None:
    local_optim_rref.local_value().load_state_dict(state_dict)


# ---------------------------------------------------------------------------
# Caller side


def _check_optimizer_class(optimizer_class: Any) -> None:
    if not (
        isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
    ):
        raise TypeError(
            "DistributedOptimizer: optimizer_class must be a subclass of torch.optim.Optimizer "
            f"(for example torch.optim.SGD), got {optimizer_class!r}"
        )


def _raise_if_not_tensors(
    per_owner: dict[Any, list[int]], not_tensors: list[tuple[Any, list[tuple[int, str]]]]
) -> None:
    """Raise a ``TypeError`` naming the first ``params_rref`` entry whose value is no tensor.

    ``per_owner[owner]`` holds the ``params_rref`` positions of ``owner``'s RRefs;
    ``not_tensors`` the (owner, [(position among them, type name)]) that owners reported.
    """
    bad = sorted(
        (per_owner[owner][i], owner.name, held) for owner, found in not_tensors for i, held in found
    )
    if not bad:
        return
    index, owner, held = bad[0]
    article = "an" if held[:1].lower() in "aeiou" else "a"
    more = f" ({len(bad) - 1} more entries hold no tensor either)" if len(bad) > 1 else ""
    raise TypeError(
        f"DistributedOptimizer: params_rref[{index}] (owned by {owner}) holds {article} {held}, "
        "not a tensor; pass RRefs to parameters, e.g. RemoteModule.remote_parameters()" + more
    )


def _group_by_owner(params_rref: Iterable[RRef]) -> dict[Any, list[tuple[int, RRef]]]:
    """``{owner: [(position in params_rref, rref)]}``, owners in order of first appearance."""
    if isinstance(params_rref, (torch.Tensor, RRef)) or not isinstance(params_rref, Iterable):
        raise TypeError(
            "DistributedOptimizer: params_rref must be a list of RRefs to parameters, got "
            f"{type(params_rref).__name__}"
        )
    per_owner: dict[Any, list[tuple[int, RRef]]] = collections.defaultdict(list)
    for i, rref in enumerate(params_rref):
        if not isinstance(rref, RRef):
            raise TypeError(
                f"DistributedOptimizer: params_rref[{i}] is a {type(rref).__name__}, not an "
                "RRef. Wrap a local parameter with lightning_distgrad.rpc.RRef(param), and "
                "get the parameters of a RemoteModule with remote_module.remote_parameters()."
            )
        per_owner[rref.owner()].append((i, rref))
    if not per_owner:
        raise ValueError("DistributedOptimizer got an empty params_rref list")
    return per_owner


class DistributedOptimizer:
    r"""Optimise parameters scattered over workers with one ``torch.optim`` optimizer per owner.

    The constructor groups ``params_rref`` by owner and builds, on every owner,
    ``optimizer_class(owner_params, *args, **kwargs)``; it waits for all owners
    and raises on the caller if any constructor failed.

    :meth:`step` applies the gradients that distributed autograd accumulated in
    a context: there is no ``zero_grad``, each context holds its own gradients,
    and ``.grad`` is only set for the duration of the local step. A parameter
    with no gradient in the context is left unchanged.

    Concurrent calls to :meth:`step`, from one caller or several (every trainer
    may own a ``DistributedOptimizer`` over the same parameter server), are
    serialised on each worker: all local optimizers of a process share one
    lock. There is no ordering across workers, and no guarantee that one
    caller's forward, backward and step run without another caller's step in
    between.

    Args:
        optimizer_class (type): a ``torch.optim.Optimizer`` subclass, such as
            ``torch.optim.SGD`` or ``torch.optim.Adam``.
        params_rref (list[RRef]): RRefs to the parameters to optimise; local
            parameters wrapped with ``RRef(param)``, remote ones from
            :meth:`~lightning_distgrad.nn.RemoteModule.remote_parameters` or
            ``rpc.remote``.
        *args: positional arguments of ``optimizer_class`` after the parameters.
        **kwargs: keyword arguments of ``optimizer_class`` (``lr=0.05``, ...).

    Raises:
        TypeError: ``optimizer_class`` is not an optimizer class, or an entry of
            ``params_rref`` is not an RRef, or is an RRef to something other than a tensor.
        ValueError: ``params_rref`` is empty.
        Exception: whatever an owner's optimizer constructor raised, with its type.

    Example::
        Run with ``mpiexec -n 2 python -m mpi4py example.py``:

        >>> # xdoctest: +SKIP
        >>> import torch
        >>> import lightning_distgrad.autograd as dist_autograd
        >>> import lightning_distgrad.rpc as rpc
        >>> from lightning_distgrad.optim import DistributedOptimizer
        >>> # On rank 0:
        >>> rpc.init_rpc()
        >>> w = rpc.remote("worker1", torch.ones, args=(2,), kwargs={"requires_grad": True})
        >>> b = torch.zeros(2, requires_grad=True)
        >>> opt = DistributedOptimizer(torch.optim.SGD, [w, rpc.RRef(b)], lr=0.5)
        >>> with dist_autograd.context() as context_id:
        ...     loss = (w.to_here() * 3 + b).sum()
        ...     dist_autograd.backward(context_id, [loss])
        ...     opt.step(context_id)
        >>> w.to_here(), b
        (tensor([-0.5000, -0.5000]), tensor([-0.5000, -0.5000], requires_grad=True))
        >>> rpc.shutdown()
        >>> # On rank 1:
        >>> rpc.init_rpc()
        >>> rpc.shutdown()
    """

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        params_rref: list[RRef],
        *args: Any,
        **kwargs: Any,
    ):
        _check_optimizer_class(optimizer_class)
        per_owner = _group_by_owner(params_rref)
        self.optimizer_class = optimizer_class
        # The owners check that their RRefs hold tensors in the same call that builds
        # their optimizers: one round trip per owner.
        built = call_all(
            [
                (
                    owner,
                    _new_local_optimizer,
                    (optimizer_class, [rref for _, rref in entries], *args),
                    kwargs,
                )
                for owner, entries in per_owner.items()
            ]
        )
        _raise_if_not_tensors(
            {owner: [i for i, _ in entries] for owner, entries in per_owner.items()},
            [(owner, found) for owner, (_, found) in zip(per_owner, built, strict=True)],
        )
        self.remote_optimizers: list[RRef] = [optim for optim, _ in built]

    def step(self, context_id: int) -> None:
        r"""Run one optimizer step on every owner with the gradients of ``context_id``.

        The context is checked here first. All owners step concurrently; this
        returns when every owner is done and raises the first error any of
        them raised (the other owners have completed their steps by then).

        Args:
            context_id (int): the distributed autograd context whose gradients to apply.

        Raises:
            RuntimeError: ``Could not find autograd context with id: {context_id}``.
            Exception: whatever an owner's ``optimizer.step()`` raised, with its type.

        Example::
            >>> # xdoctest: +SKIP
            >>> with dist_autograd.context() as context_id:
            ...     loss = model(batch).sum()
            ...     dist_autograd.backward(context_id, [loss])
            ...     opt.step(context_id)
        """
        dist_autograd._is_valid_context(context_id)
        call_all(
            [
                (optim.owner(), _local_optimizer_step, (optim, context_id))
                for optim in self.remote_optimizers
            ]
        )

    def state_dict(self) -> dict[str, dict[str, Any]]:
        r"""The state dicts of the local optimizers, keyed by owner name.

        Each value is ``optimizer.state_dict()`` of the local optimizer on that
        worker (a copy): parameters are numbered in the order their RRefs had
        in ``params_rref``. Save it with ``torch.save`` and restore it with
        :meth:`load_state_dict` on a ``DistributedOptimizer`` built with the
        same ``params_rref`` order and the same owners.

        Example::
            >>> # xdoctest: +SKIP
            >>> sd = opt.state_dict()
            >>> sorted(sd)
            ['worker0', 'worker1']
            >>> opt.load_state_dict(sd)
        """
        owners = [optim.owner() for optim in self.remote_optimizers]
        states = call_all(
            [
                (owner, _local_optimizer_state_dict, (optim,))
                for owner, optim in zip(owners, self.remote_optimizers, strict=True)
            ]
        )
        return {owner.name: state for owner, state in zip(owners, states, strict=True)}

    def load_state_dict(self, state_dict: dict[str, dict[str, Any]]) -> None:
        r"""Load state dicts produced by :meth:`state_dict` into the local optimizers.

        Args:
            state_dict (dict): ``{owner_name: local_optimizer_state_dict}`` with
                exactly one entry per owner of this optimizer's parameters.

        Raises:
            ValueError: the owners in ``state_dict`` differ from this optimizer's.
            Exception: whatever an owner's ``optimizer.load_state_dict`` raised.

        Example::
            >>> # xdoctest: +SKIP
            >>> opt.load_state_dict(torch.load("optim.pt"))
        """
        owners = [optim.owner() for optim in self.remote_optimizers]
        expected = {owner.name for owner in owners}
        given = set(state_dict)
        if given != expected:
            raise ValueError(
                "DistributedOptimizer.load_state_dict: the state dict has entries for workers "
                f"{sorted(given)}, but this optimizer's parameters live on {sorted(expected)}. "
                f"Missing: {sorted(expected - given)}; unexpected: {sorted(given - expected)}."
            )
        call_all(
            [
                (owner, _local_optimizer_load_state_dict, (optim, state_dict[owner.name]))
                for owner, optim in zip(owners, self.remote_optimizers, strict=True)
            ]
        )

    def __repr__(self) -> str:
        owners = ", ".join(optim.owner().name for optim in self.remote_optimizers)
        return f"DistributedOptimizer({self.optimizer_class.__name__}, owners=[{owners}])"
