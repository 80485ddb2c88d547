"""The Lightning cluster environment of the ``distgrad`` strategy: every fact comes from MPI.

Lightning picks a cluster environment by probing environment variables (TorchElastic, then
Slurm, then LSF, then MPI). Under ``mpiexec`` inside a Slurm allocation that probe picks
``SLURMEnvironment`` and every rank reads ``SLURM_PROCID=0``. :class:`MPIClusterEnvironment`
asks the communicator instead, and :meth:`MPIClusterEnvironment.check_slurm_consistency` turns
a launch that Slurm and MPI see differently into an error that names the fix.
"""

from __future__ import annotations

import logging
import os
import socket
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from typing_extensions import override

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["MPIClusterEnvironment"]

log = logging.getLogger(__name__)

_SRUN_MPI_HINT = "`srun --mpi=pmix` (or `--mpi=pmi2`; `srun --mpi=list` shows the choices)"


class MPIClusterEnvironment(ClusterEnvironment):
    r"""A cluster environment whose ranks, nodes and sizes all come from an MPI communicator.

    Processes are started by ``mpiexec`` or ``srun``, never by Lightning. Nothing is read from
    environment variables, so Lightning's Slurm/MPI auto-detection cannot give wrong ranks. A
    *node* is a group of ranks that share memory (``MPI_COMM_TYPE_SHARED``); nodes are numbered
    by the lowest global rank on each, so node 0 always holds rank 0.

    Construction does not communicate. The first call to :meth:`local_rank`, :meth:`node_rank`,
    :attr:`num_nodes`, :attr:`local_world_size`, :meth:`validate_settings`, :attr:`main_address`
    or :attr:`main_port` runs a collective on ``comm``, so make those first calls on every rank,
    in the same order. Results are cached.

    Args:
        comm (MPI.Comm, optional): the communicator that spans the training processes.
            Default: ``MPI.COMM_WORLD``. The environment never frees it.

    Example::

        Run with `mpiexec -n 2 python train.py`:

        >>> # xdoctest: +SKIP
        >>> # On every rank:
        >>> env = MPIClusterEnvironment()
        >>> env.check_slurm_consistency()
        >>> env.global_rank(), env.local_rank(), env.node_rank(), env.world_size()
        (1, 1, 0, 2)  # on rank 1
    """

    def __init__(self, comm: MPI.Comm | None = None) -> None:
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
        self._comm = comm
        self._rank: int = comm.Get_rank()
        self._size: int = comm.Get_size()
        self._layout: _Layout | None = None
        self._main_address: str | None = None
        self._main_port: int | None = None

    # --- ClusterEnvironment ----------------------------------------------------------------------

    @property
    @override
    def creates_processes_externally(self) -> bool:
        """Always ``True``: ``mpiexec`` or ``srun`` starts the processes."""
        return True

    @property
    @override
    def main_address(self) -> str:
        """The hostname of rank 0, broadcast once (a collective on first use), then cached."""
        if self._main_address is None:
            self._main_address = self._comm.bcast(socket.gethostname(), root=0)
        return self._main_address

    @property
    @override
    def main_port(self) -> int:
        """A free port on rank 0's host, broadcast once (a collective on first use), then cached."""
        if self._main_port is None:
            port = find_free_network_port() if self._rank == 0 else None
            self._main_port = self._comm.bcast(port, root=0)
        return self._main_port

    @staticmethod
    @override
    def detect() -> bool:
        """Whether mpi4py imports and the MPI world has more than one rank. Never raises.

        Returns:
            bool: ``False`` without mpi4py, without a working MPI library, or in a world of one.

        Example::

            >>> # xdoctest: +SKIP
            >>> MPIClusterEnvironment.detect()  # under plain `python`, not mpiexec
            False
        """
        try:
            from mpi4py import MPI

            return MPI.COMM_WORLD.Get_size() > 1
        except Exception:  # mpi4py missing, built without MPI, or MPI failed to initialise
            return False

    @override
    def world_size(self) -> int:
        """The number of ranks in the communicator."""
        return self._size

    @override
    def set_world_size(self, size: int) -> None:
        log.debug(
            f"{self.__class__.__name__}.set_world_size was called, but setting world size is not"
            " allowed. Ignored."
        )

    @override
    def global_rank(self) -> int:
        """This process's rank in the communicator."""
        return self._rank

    @override
    def set_global_rank(self, rank: int) -> None:
        log.debug(
            f"{self.__class__.__name__}.set_global_rank was called, but setting global rank is not"
            " allowed. Ignored."
        )

    @override
    def local_rank(self) -> int:
        """This process's rank among the ranks on its node, ordered by global rank."""
        return self._get_layout().local_rank

    @override
    def node_rank(self) -> int:
        """The index of this node among nodes ordered by the lowest global rank on each."""
        return self._get_layout().node_rank

    @override
    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Check the Trainer's ``devices`` and ``num_nodes`` against the ranks MPI started.

        Every rank sees the whole layout, so every rank raises the same error.

        Args:
            num_devices (int): devices per node, from ``Trainer(devices=...)``.
            num_nodes (int): ``Trainer(num_nodes=...)``.

        Raises:
            ValueError: if some node runs a number of ranks other than ``num_devices``, or the
                ranks run on a number of nodes other than ``num_nodes``.

        Example::

            Run with `mpiexec -n 2 python train.py`:

            >>> # xdoctest: +SKIP
            >>> MPIClusterEnvironment().validate_settings(num_devices=4, num_nodes=1)
            ValueError: You set `devices=4`, but mpiexec started 2 ranks on this node. HINT: ...
        """
        counts = self._get_layout().ranks_per_node
        if any(count != num_devices for count in counts):
            raise ValueError(_devices_mismatch(num_devices, counts))
        if len(counts) != num_nodes:
            raise ValueError(
                f"You set `num_nodes={num_nodes}`, but mpiexec started ranks on"
                f" {_plural(len(counts), 'node')}. HINT: set `num_nodes={len(counts)}` or launch"
                f" across {num_nodes} nodes (`mpiexec -n {num_nodes * counts[0]} -ppn"
                f" {counts[0]}` with a host list, or `srun --nodes={num_nodes}`)."
            )

    @override
    def teardown(self) -> None:
        """Keep everything cached: the strategy tears down after each stage, then reuses this.

        The communicator belongs to the caller and is not freed.
        """
        log.debug(f"{self.__class__.__name__}: teardown keeps the cached layout and address.")

    # --- Extras for the strategy -----------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        """The number of nodes (groups of ranks that share memory)."""
        return len(self._get_layout().ranks_per_node)

    @property
    def local_world_size(self) -> int:
        """The number of ranks on this node."""
        return self._get_layout().local_world_size

    def world_comm(self) -> MPI.Comm:
        """The communicator this environment was built from (``MPI.COMM_WORLD`` by default).

        Returns:
            MPI.Comm: the caller's communicator itself, not a copy. ``Dup`` it for own traffic.

        Example::

            >>> # xdoctest: +SKIP
            >>> collective_comm = MPIClusterEnvironment().world_comm().Dup()
        """
        return self._comm

    def check_slurm_consistency(self, environ: Mapping[str, str] | None = None) -> None:
        """Raise if Slurm's task variables describe a different launch than MPI does.

        A collective: call it on every rank. Every rank gathers every rank's Slurm variables, so
        all ranks raise the same error or none does. The check passes outside Slurm (neither
        ``SLURM_NTASKS`` nor ``SLURM_NPROCS`` set), and when several MPI ranks share one
        ``SLURM_PROCID``: then ``mpiexec`` ran inside an allocation, the variables describe the
        batch step or the launcher's daemons, and the MPI ranks are right as they are. Otherwise
        ``srun`` started the ranks as tasks, and ``SLURM_NTASKS``, ``SLURM_PROCID``,
        ``SLURM_STEP_NUM_NODES`` (or ``SLURM_NNODES``) and ``SLURM_LOCALID`` must match the world
        size, global rank, number of nodes and local rank. Build the environment on
        ``COMM_WORLD`` (or a ``Dup`` of it): a sub-communicator legitimately disagrees with Slurm.

        Args:
            environ (Mapping[str, str], optional): this rank's environment. Default: ``os.environ``.

        Raises:
            RuntimeError: what Slurm says, what MPI says, the likely cause, and ``HINT:`` the fix.

        Example::

            Under `srun -n 4 python train.py` with no MPI plugin, every rank is a world of one:

            >>> # xdoctest: +SKIP
            >>> MPIClusterEnvironment().check_slurm_consistency()
            RuntimeError: srun started 4 tasks but each sees an MPI world of size 1 ... HINT: ...
        """
        view = _SlurmView.read(os.environ if environ is None else environ)
        if self._size == 1:
            if view.ntasks is not None and view.ntasks > 1:
                raise RuntimeError(_singleton_world(view))
            log.debug(f"{self.__class__.__name__}: a world of one; nothing to check.")
            return
        layout = self._get_layout()  # a collective: every rank, before rank 0 decides alone
        # Rank 0 reads every rank's variables and tells the others what it found: the bytes
        # a rank receives do not grow with the job (rank 0's do, once).
        views = self._comm.gather(view, root=0)
        verdict = _slurm_verdict(views, self._size, layout) if self._rank == 0 else None
        message, wrong = self._comm.bcast(verdict, root=0)
        if wrong:
            raise RuntimeError(message)
        log.debug(f"{self.__class__.__name__}: {message}")

    # --- Layout ----------------------------------------------------------------------------------

    def _get_layout(self) -> _Layout:
        if self._layout is None:
            self._layout = self._init_layout()
        return self._layout

    def _init_layout(self) -> _Layout:
        from mpi4py import MPI

        node_comm = self._comm.Split_type(MPI.COMM_TYPE_SHARED, key=self._rank)
        try:
            local_rank, local_world_size = node_comm.Get_rank(), node_comm.Get_size()
            leader = node_comm.bcast(self._rank, root=0)  # the lowest global rank on this node
        finally:
            node_comm.Free()
        leaders: list[int] = self._comm.allgather(leader)
        layout = _Layout.build(leaders, self._rank, local_rank, local_world_size)
        log.debug(
            f"{self.__class__.__name__}: rank {self._rank} of {self._size} is local rank"
            f" {local_rank} of {local_world_size} on node {layout.node_rank} of"
            f" {len(layout.ranks_per_node)}."
        )
        return layout


# --- Helpers -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """Where every rank runs, from the lowest global rank of each rank's node (its *leader*)."""

    leaders: tuple[int, ...]
    node_rank: int
    local_rank: int
    local_world_size: int
    ranks_per_node: tuple[int, ...]

    @classmethod
    def build(
        cls, leaders: Sequence[int], rank: int, local_rank: int, local_world_size: int
    ) -> _Layout:
        per_node = Counter(leaders)  # one pass: no cost per pair of ranks or nodes
        nodes = sorted(per_node)
        return cls(
            leaders=tuple(leaders),
            node_rank=nodes.index(leaders[rank]),
            local_rank=local_rank,
            local_world_size=local_world_size,
            ranks_per_node=tuple(per_node[leader] for leader in nodes),
        )

    @staticmethod
    def local_ranks(leaders: Sequence[int]) -> list[int]:
        """Every rank's local rank, in one pass: the node split is keyed by global rank, so a
        rank's local rank counts the lower ranks of its node."""
        seen: Counter[int] = Counter()
        ranks = []
        for leader in leaders:
            ranks.append(seen[leader])
            seen[leader] += 1
        return ranks


class _SlurmView(NamedTuple):
    """One rank's Slurm task variables, with the names they were read from."""

    ntasks: int | None
    ntasks_name: str
    procid: int | None
    localid: int | None
    nnodes: int | None
    nnodes_name: str

    @classmethod
    def read(cls, environ: Mapping[str, str]) -> _SlurmView:
        ntasks_name, ntasks = _env_int(environ, "SLURM_NTASKS", "SLURM_NPROCS")
        nnodes_name, nnodes = _env_int(environ, "SLURM_STEP_NUM_NODES", "SLURM_NNODES")
        _, procid = _env_int(environ, "SLURM_PROCID")
        _, localid = _env_int(environ, "SLURM_LOCALID")
        return cls(ntasks, ntasks_name, procid, localid, nnodes, nnodes_name)


def _env_int(environ: Mapping[str, str], *names: str) -> tuple[str, int | None]:
    for name in names:
        try:
            return name, int(environ[name])
        except (KeyError, ValueError):
            continue
    return names[0], None


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _devices_mismatch(num_devices: int, counts: Sequence[int]) -> str:
    prefix = f"You set `devices={num_devices}`, but mpiexec started"
    srun = f"(or `srun --ntasks-per-node={num_devices}`)"
    if len(counts) == 1:
        return (
            f"{prefix} {_plural(counts[0], 'rank')} on this node. HINT: set"
            f" `devices={counts[0]}` or launch with `mpiexec -n {num_devices} ...` {srun}."
        )
    launch = f"`mpiexec -n {num_devices * len(counts)} -ppn {num_devices} ...` {srun}"
    if len(set(counts)) == 1:
        return (
            f"{prefix} {_plural(counts[0], 'rank')} on each of the {len(counts)} nodes. HINT:"
            f" set `devices={counts[0]}` or launch with {launch}."
        )
    per_node = ", ".join(f"node {node}: {count}" for node, count in enumerate(counts))
    return (
        f"{prefix} an uneven number of ranks per node ({per_node}). HINT: start the same number"
        f" of ranks on every node: {launch}."
    )


def _singleton_world(view: _SlurmView) -> str:
    procid = "" if view.procid is None else f", SLURM_PROCID={view.procid}"
    return (
        f"srun started {view.ntasks} tasks but each sees an MPI world of size 1 (Slurm:"
        f" {view.ntasks_name}={view.ntasks}{procid}; MPI: rank 0 of 1). Likely cause: srun ran"
        " without an MPI plugin that matches this MPI library, so every task initialised MPI on"
        " its own; or the script ran as `python train.py` directly in the sbatch/salloc shell,"
        f" so nothing started the other tasks. HINT: launch with {_SRUN_MPI_HINT} or with"
        f" `mpiexec -n {view.ntasks} python train.py`. To run a single process on purpose, use"
        " `srun --ntasks=1`."
    )


def _slurm_verdict(views: Sequence[_SlurmView], size: int, layout: _Layout) -> tuple[str, bool]:
    """What every rank's Slurm variables (``views``) say of the launch: ``(error, True)`` if
    they contradict MPI, else ``(what was found, False)``."""
    if all(v.ntasks is None for v in views):
        return "no Slurm task variables; nothing to check.", False
    procids = [v.procid for v in views]
    if None in procids or len(set(procids)) < size:
        return (
            "several MPI ranks share SLURM_PROCID (mpiexec inside an allocation), so Slurm's"
            " task variables do not describe them. Using MPI.",
            False,
        )
    error = _srun_mismatch(views, size, layout)
    return (error, True) if error is not None else (f"Slurm and MPI agree on {size} ranks.", False)


def _srun_mismatch(views: Sequence[_SlurmView], size: int, layout: _Layout) -> str | None:
    """The error for ranks that srun started as tasks (distinct SLURM_PROCIDs), or ``None``."""
    ntasks = sorted({v.ntasks for v in views}, key=lambda n: -1 if n is None else n)
    if ntasks != [size]:
        said = "/".join(str(n) for n in ntasks)
        return (
            f"srun started {said} tasks ({views[0].ntasks_name}={said}) but the MPI world has"
            f" {size} ranks. Likely cause: the tasks joined separate MPI worlds because srun's"
            " MPI plugin does not match this MPI library, or each task ran its own `mpiexec`."
            f" HINT: launch once, either with {_SRUN_MPI_HINT} and no mpiexec inside, or with a"
            f" single `mpiexec -n {size}`."
        )
    wrong = [r for r, v in enumerate(views) if v.procid != r]
    if wrong:
        said = ", ".join(f"MPI rank {r} has SLURM_PROCID={views[r].procid}" for r in wrong[:4])
        return (
            f"Slurm and MPI number the tasks differently on {len(wrong)} of {size} ranks"
            f" ({said}). Likely cause: the environment was built on a communicator other than"
            " COMM_WORLD, or MPI did not take its ranks from srun's PMI. HINT: build"
            " MPIClusterEnvironment on `MPI.COMM_WORLD` (the default) and launch with"
            f" {_SRUN_MPI_HINT}."
        )
    num_nodes = len(layout.ranks_per_node)
    nnodes = {v.nnodes for v in views if v.nnodes is not None}
    if nnodes and nnodes != {num_nodes}:
        said = "/".join(str(n) for n in sorted(nnodes))
        return (
            f"Slurm placed the tasks on {said} nodes ({views[0].nnodes_name}={said}) but MPI"
            f" groups the ranks into {_plural(num_nodes, 'node')} of ranks that share memory."
            f" Likely cause: {_node_split_cause(num_nodes > max(nnodes))} HINT:"
            f" {_NODE_SPLIT_FIX}"
        )
    local_ranks = _Layout.local_ranks(layout.leaders)
    wrong = [r for r, v in enumerate(views) if v.localid not in (None, local_ranks[r])]
    if wrong:
        said = ", ".join(
            f"MPI rank {r} is local rank {local_ranks[r]} but has SLURM_LOCALID={views[r].localid}"
            for r in wrong[:4]
        )
        return (
            f"Slurm and MPI disagree on local ranks on {len(wrong)} of {size} ranks ({said})."
            f" Likely cause: {_node_split_cause(True)} HINT: {_NODE_SPLIT_FIX}"
        )
    return None


def _node_split_cause(more_nodes_in_mpi: bool) -> str:
    if more_nodes_in_mpi:
        return (
            "tasks on one host run in separate containers or IPC namespaces, so MPI's"
            " shared-memory split (MPI_COMM_TYPE_SHARED) puts them on different nodes."
        )
    return "the Slurm variable counts the whole allocation rather than this job step."


_NODE_SPLIT_FIX = (
    "run all tasks of a host in one container that shares the IPC namespace and /dev/shm, or"
    " launch one task per node; check `srun --nodes` against the allocation."
)
