"""Imported by Python at the start of every process that has this folder on ``PYTHONPATH``:
under ``LIGHTNING_DISTGRAD_TEST_WITHOUT_TORCH_RPC=1`` torch's RPC is unavailable in the
process (see ``torch_rpc_off``). The ``sitecustomize`` this one hides runs after it."""

import torch_rpc_off

if torch_rpc_off.requested():
    torch_rpc_off.install()
torch_rpc_off.run_shadowed_sitecustomize()
