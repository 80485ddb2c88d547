"""Job script: what each rank sees of its node, printed as one JSON line per rank.

Run on every rank of a job whose ranks are spread over nodes (``tests/test_two_nodes.py``
runs it on two emulated nodes); the test asserts on the lines. It covers the node-local
mechanisms: the shared-memory node communicator, the RPC doorbell and its nap board,
big tensors written straight into the memory of the node's ranks, the cluster
environment's layout, and the local rank -> GPU index mapping. Collectives
are unconditional: every rank makes the same calls in the same order.
"""

from __future__ import annotations

import json
import os
import select
import socket
from typing import Any
from unittest import mock

import torch
from mpi4py import MPI

from lightning_distgrad import rpc
from lightning_distgrad.lightning import MPIClusterEnvironment
from lightning_distgrad.lightning.strategy import DistAutogradStrategy
from lightning_distgrad.rpc._calls import dispatch
from lightning_distgrad.rpc._transport.doorbell import BOARD_DIR, Doorbell, node_doorbell

#: Prefix of the one line each rank prints; the test picks the lines by it.
MARK = "NODE_FACTS "
#: How long a ring may take to arrive between processes on one node.
RING_WAIT_S = 0.5
#: Big enough to be written into a peer's memory on the same node (see
#: ``rpc._transport.direct_writes``).
BIG_TENSOR_BYTES = 4 << 20


def board_files() -> list[str]:
    """This node's nap boards left in ``BOARD_DIR`` (there must be none)."""
    return sorted(f for f in os.listdir(BOARD_DIR) if f.startswith("lightning_distgrad"))


def rings_received(bell: Doorbell) -> int:
    """Drain the bell's socket and count the rings in it (waits briefly for the first)."""
    count = 0
    timeout = RING_WAIT_S
    while select.select([bell._sock], [], [], timeout)[0]:
        try:
            while True:
                bell._sock.recv(16)
                count += 1
        except BlockingIOError:
            timeout = 0.05  # drained: wait a little for late ones
    return count


def ring_everyone(world: MPI.Comm, bell: Doorbell, armed: bool) -> int:
    """Every rank arms (or not), then rings every other rank; the rings this one got."""
    if armed:
        bell.arm()
    world.Barrier()  # every byte on the board is set (or clear) before anyone rings
    for peer in range(world.Get_size()):
        if peer != world.Get_rank():
            bell.ring(peer)
    world.Barrier()  # every ring was sent
    got = rings_received(bell)
    if armed:
        bell.disarm()
    world.Barrier()
    return got


def doorbell_facts(world: MPI.Comm) -> dict[str, Any]:
    """The doorbell's peers, its board, and which rings arrive, armed and not."""
    bell, oversubscribed = node_doorbell(world, world.Get_rank())
    assert isinstance(bell, Doorbell), f"no doorbell on this node: {type(bell).__name__}"
    facts = {
        "bell_peers": sorted(bell._peers),
        "board_path": bell._board_path,
        "has_board": bell.has_board(),
        "boards_after_setup": board_files(),
        "rings_armed": ring_everyone(world, bell, armed=True),
        "rings_disarmed": ring_everyone(world, bell, armed=False),
    }
    bell.close()
    world.Barrier()
    facts["boards_after_close"] = board_files()
    return facts


def environment_facts() -> dict[str, Any]:
    """The cluster environment's view of this rank (collectives on first use)."""
    env = MPIClusterEnvironment()
    env.validate_settings(num_devices=env.local_world_size, num_nodes=env.num_nodes)
    return {
        "local_rank": env.local_rank(),
        "node_rank": env.node_rank(),
        "world_size": env.world_size(),
        "local_world_size": env.local_world_size,
        "num_nodes": env.num_nodes,
        "main_address": env.main_address,
    }


def gpu_index(server_ranks: list[int]) -> str:
    """The device this rank's strategy would train on with two GPUs visible per node.

    No CUDA here: only the count of visible devices is faked, the index comes from the
    strategy's own local-rank arithmetic (``root_device``).
    """
    devices = [torch.device("cuda", i) for i in range(2)]
    strategy = DistAutogradStrategy(server_ranks=server_ranks or None, parallel_devices=devices)
    strategy.set_world_ranks()  # a collective: learns the node layout
    with mock.patch.object(torch.cuda, "device_count", return_value=2):
        return str(strategy.root_device)


def echo(t: torch.Tensor) -> torch.Tensor:
    return t


def rpc_facts(world: MPI.Comm) -> dict[str, Any]:
    """Every rank calls every rank once; the agent's own doorbell knows only its node, and
    it writes big tensors straight into the memory of its node's ranks only."""
    rpc.init_rpc()
    names = [rpc.rpc_sync(peer, socket.gethostname) for peer in range(world.Get_size())]
    big = torch.arange(BIG_TENSOR_BYTES // 4, dtype=torch.float32) * (world.Get_rank() + 1)
    echoed = [torch.equal(rpc.rpc_sync(p, echo, (big,)), big) for p in range(world.Get_size())]
    bell = dispatch.require_agent().transport._bell
    peers = rpc.api._get_debug_info()["peers"]
    facts = {
        "peer_hosts": names,
        "big_tensors_echoed": echoed,
        "writes_directly": sorted(
            rpc.get_worker_info(n).id for n, c in peers.items() if c["writes_directly"]
        ),
        "agent_bell_peers": sorted(getattr(bell, "_peers", {})),
        "agent_has_board": bell.has_board(),
        "boards_with_rpc": board_files(),
    }
    rpc.shutdown()
    facts["boards_after_rpc"] = board_files()
    return facts


def visible_markers(world: MPI.Comm, node: MPI.Comm) -> list[str]:
    """Each node's first rank leaves a marker in ``BOARD_DIR``; the markers this rank sees.

    Nodes that do not share ``BOARD_DIR`` see only their own.
    """
    marker = os.path.join(BOARD_DIR, f"node-marker-{world.Get_rank()}")
    if node.Get_rank() == 0:
        open(marker, "w").close()
    world.Barrier()  # every marker exists
    seen = sorted(f for f in os.listdir(BOARD_DIR) if f.startswith("node-marker-"))
    world.Barrier()  # everyone looked
    if node.Get_rank() == 0:
        os.unlink(marker)
    return seen


def main() -> None:
    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    facts: dict[str, Any] = {
        "rank": world.Get_rank(),
        "host": socket.gethostname(),
        "node_size": node.Get_size(),
        "node_ranks": node.allgather(world.Get_rank()),
        "markers_seen": visible_markers(world, node),
    }
    node.Free()
    facts.update(doorbell_facts(world))
    facts.update(environment_facts())
    facts["gpu"] = gpu_index([])
    facts["gpu_with_server_0"] = gpu_index([0])
    facts.update(rpc_facts(world))
    print(MARK + json.dumps(facts), flush=True)


if __name__ == "__main__":
    main()
