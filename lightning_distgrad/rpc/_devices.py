"""Device maps: where CUDA tensors land on the receiving worker.

As in ``torch.distributed.rpc``, a CUDA tensor may only be sent to a worker
for which this worker has a device map; responses use the inverse of the
caller's map. Tensors are staged through host memory (the agent does not
assume a CUDA-aware MPI) and moved to the mapped device on arrival.
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
