"""Where a :class:`~lightning_distgrad.nn.RemoteModule` lives: its ``remote_device`` string
(``"worker1/cpu"``, ``"rank:1/cuda:0"``, ``"cuda:0"``), parsed and resolved to a worker."""

from __future__ import annotations

import torch

from ..rpc import _internal

_PARSE_ERROR = (
    "Could not parse remote_device: {}. The valid format is '<workername>/<device>' "
    "or 'rank:<rank>/<device>' or '<device>'"
)


def parse_remote_device(remote_device: str) -> tuple[str | int | None, str]:
    """``(worker name or rank or None, device)`` from ``remote_device``; ValueError if malformed."""
    if not isinstance(remote_device, str):
        raise ValueError(_PARSE_ERROR.format(remote_device))
    fields = remote_device.split("/")
    if len(fields) == 2:
        worker, device = fields
    elif len(fields) == 1 and _is_device(fields[0]):
        worker, device = None, fields[0]
    elif len(fields) == 1:
        worker, device = fields[0], "cpu"
    else:
        raise ValueError(_PARSE_ERROR.format(remote_device))
    if worker is not None and not worker:
        raise ValueError(_PARSE_ERROR.format(remote_device))
    if not _is_device(device):
        raise ValueError(_PARSE_ERROR.format(remote_device))
    on: str | int | None = worker
    if worker is not None and ":" in worker:
        kind, _, rank = worker.partition(":")
        if kind != "rank" or not rank.isdigit():
            raise ValueError(_PARSE_ERROR.format(remote_device))
        on = int(rank)
    return on, str(torch.device(device))


def _is_device(text: str) -> bool:
    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        return False
    return True


def resolve_worker(on: str | int | None, remote_device: str) -> tuple[str | int, str]:
    """``(on, worker name)``; a bare device means this worker. ValueError if unknown."""
    agent = _internal.require_agent()
    if on is None:
        return agent.info.name, agent.info.name
    try:
        info = _internal.resolve(agent, on)
    except RuntimeError as e:
        known = ", ".join(f"{w.name} (rank {w.id})" for w in agent.infos)
        raise ValueError(
            f"RemoteModule: remote_device {remote_device!r} names a worker that is not in this "
            f"RPC job. Known workers: {known}."
        ) from e
    return on, info.name


def has_device_map(worker_name: str) -> bool:
    """Whether this worker maps devices for tensors it sends to ``worker_name``."""
    agent = _internal.require_agent()
    maps = getattr(agent, "device_maps", None)
    if isinstance(maps, dict):  # {worker name: map}
        return bool(maps.get(worker_name))
    if isinstance(maps, list):  # maps[src][dst]
        return bool(maps[agent.info.id][agent.by_name[worker_name].id])
    return False
