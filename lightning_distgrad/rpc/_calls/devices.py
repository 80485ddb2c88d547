"""Device maps: where CUDA tensors land on the receiving worker.

As in ``torch.distributed.rpc``, a CUDA tensor may only be sent to a worker
for which this worker has a device map; responses use the inverse of the
caller's map, and gradients in a distributed backward pass the inverse of the map
that sent their tensors (see ``_transport.cuda`` for how CUDA tensors travel).
"""

from __future__ import annotations

import torch

DeviceMap = dict[torch.device, torch.device]


def invert(device_map: DeviceMap) -> DeviceMap:
    return {v: k for k, v in device_map.items()}


def target_devices(
    tensors: list[torch.Tensor], device_map: DeviceMap | None, me: str, dst: str
) -> list[str] | None:
    """The receiver-side device of each tensor; None when all are CPU tensors."""
    if all(t.is_cpu for t in tensors):
        return None
    devices = []
    for t in tensors:
        if t.is_cpu:
            devices.append("cpu")
            continue
        mapped = (device_map or {}).get(t.device)
        if mapped is None:
            raise RuntimeError(
                f"Cannot send a tensor on {t.device} from {me} to {dst}: no device map entry "
                f"for it. RPC only sends CPU tensors by default; move the tensor to CPU, or call "
                f"`options.set_device_map({dst!r}, {{{t.device.index}: <device on {dst}>}})` on "
                "the MPIRpcBackendOptions passed to init_rpc."
            )
        devices.append(str(mapped))
    return devices


def gradient_devices(
    tensors: list[torch.Tensor], back_map: DeviceMap, own_map: DeviceMap
) -> list[str] | None:
    """Each gradient's device on the worker that sent the tensors they belong to: where
    ``back_map`` (the inverse of that worker's map to this one) puts it, else ``own_map``
    (this worker's map to it), else the CPU, through host memory (that worker then moves it
    to its tensor's device). None when all are CPU tensors."""
    if all(t.is_cpu for t in tensors):
        return None
    devices = []
    for t in tensors:
        mapped = None if t.is_cpu else back_map.get(t.device, own_map.get(t.device))
        devices.append("cpu" if mapped is None else str(mapped))
    return devices
