"""One rank of a job of the torch RPC suite: runs the listed tests in order, as ``self.rank``.

Started by ``run_suite.py`` as ``mpiexec -n N python -m mpi4py _worker.py --tests FILE
--records PREFIX --hang-timeout S`` from the directory whose ``lightning_distgrad`` is
under test. Each test runs as torch's ``MultiProcessTestCase`` runs it in a spawned
process (seeded RNG, the test method called directly, ``unittest.SkipTest`` and the
skip exit codes of ``common_distributed.TEST_SKIPS`` taken as skips); ranks start each
test together. Rank r appends one JSON line to ``PREFIX.rank<r>.jsonl`` when a test
starts and one when it ends (outcome, traceback, seconds), so that the driver can tell
which test hung or was running when a rank died.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
import traceback
import unittest
from pathlib import Path

# The package under test is the one in the current directory, not the script's.
sys.path.insert(0, os.getcwd())
sys.path.insert(1, str(Path(__file__).resolve().parent))

import _suite  # noqa: E402
from mpi4py import MPI  # noqa: E402

#: torch.distributed.rpc.constants.DEFAULT_RPC_TIMEOUT_SEC
DEFAULT_RPC_TIMEOUT_S = 60.0

# ``init_process_group`` returns on every rank only once every rank has set its default
# group, as it did by default when torch's DDP-under-RPC tests were written: their master,
# its own init done, has each trainer call ``dist.new_group`` over RPC, which needs that
# trainer's default group set.
os.environ["TORCH_DIST_INIT_BARRIER"] = "1"


def _polite_barrier(comm: MPI.Comm) -> None:
    # MPICH spins in blocking calls; with more ranks than cores that starves the others.
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


def _skip_reasons() -> dict[int, str]:
    from torch.testing._internal.common_distributed import TEST_SKIPS

    return {skip.exit_code: skip.message for skip in TEST_SKIPS.values()}


def _run_one(case: unittest.TestCase, method: str, skips: dict[int, str]) -> tuple[str, str]:
    """(outcome, detail) of one test method on this rank: pass, fail or skip."""
    from torch.testing._internal.common_utils import SEED, set_rng_seed

    set_rng_seed(SEED)  # as torch's test runner seeds each test (torch 2.5 has no default)
    try:
        getattr(case, method)()
    except unittest.SkipTest as e:
        return "skip", str(e)
    except SystemExit as e:  # skip decorators of common_distributed exit the process
        if e.code in skips:
            return "skip", skips[e.code]
        if e.code in (0, None):  # a test that ends its process on purpose, successfully
            return "pass", "the test called sys.exit(0)"
        return "fail", f"SystemExit({e.code!r})\n{traceback.format_exc()}"
    except Exception:
        return "fail", traceback.format_exc()
    return "pass", ""


def _settle() -> str:
    """Stop what a failed test left running, as the end of its process would; what was done."""
    import torch.distributed as dist

    import lightning_distgrad.rpc as rpc

    notes = []
    try:
        rpc.get_worker_info()
        running = True
    except RuntimeError:
        running = False
    if running:
        notes.append("RPC was still running after the test: shut it down (graceful)")
        try:
            # A test may have left a tiny timeout set, which would fail the shutdown.
            rpc._set_rpc_timeout(DEFAULT_RPC_TIMEOUT_S)
            rpc.shutdown(graceful=True)
        except Exception as e:  # noqa: BLE001  (reported, then the next test runs)
            notes.append(f"shutdown raised {type(e).__name__}: {e}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return "; ".join(notes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", required=True, help="JSON file: list of Class.test_name")
    parser.add_argument("--records", required=True, help="prefix of the per-rank records")
    parser.add_argument("--hang-timeout", type=float, required=True)
    opts = parser.parse_args()

    comm = MPI.COMM_WORLD.Dup()  # the harness's own collectives never meet the tests'
    rank = comm.Get_rank()
    suite = _suite.load()
    fresh = _suite.FreshModules()
    import torch.testing._internal.dist_utils as dist_utils

    import lightning_distgrad.rpc

    assert dist_utils.rpc is lightning_distgrad.rpc, "dist_init would start torch's agent"
    skips = _skip_reasons()
    tests = json.loads(Path(opts.tests).read_text())
    records = open(f"{opts.records}.rank{rank}.jsonl", "a", buffering=1)  # noqa: SIM115

    def record(**fields) -> None:
        records.write(json.dumps(fields) + "\n")
        records.flush()
        os.fsync(records.fileno())

    if rank == 0:
        print(f"torch_suite: lightning_distgrad from {_suite.package_under_test()}", flush=True)
    for index, test_id in enumerate(tests):
        class_name, method = test_id.split(".", 1)
        suite_class = suite[class_name]
        # As MultiProcessTestCase.setUp: a new empty file for FileStore rendezvous, one per
        # test, so that a FileStore freed late (it updates its file, and deletes it with its
        # last user) touches only its own test's file.
        store_file = f"{opts.records}.test{index}.store"
        if rank == 0:
            Path(store_file).touch()
        _polite_barrier(comm)
        for stream in (sys.stdout, sys.stderr):
            print(f"=== torch_suite: {test_id} starts", file=stream, flush=True)
        record(test=test_id, event="start", t=time.time())
        # Every thread's stack lands in this rank's log before the driver ends a hung job.
        faulthandler.dump_traceback_later(max(1.0, opts.hang_timeout - 5), exit=False)
        fresh.restore()
        case = suite_class.cls(method)
        case.rank = rank
        case.file_name = store_file
        start = time.monotonic()
        outcome, detail = _run_one(case, method, skips)
        seconds = time.monotonic() - start
        # Before settling: a failed rank's peers may wait for it in the test's collectives,
        # and the driver ends such a job once it knows the test failed.
        record(test=test_id, event="result", outcome=outcome, detail=detail)
        settled = _settle()
        faulthandler.cancel_dump_traceback_later()
        record(
            test=test_id,
            event="end",
            outcome=outcome,
            detail=detail,
            settled=settled,
            seconds=round(seconds, 3),
        )
        ended = f"=== torch_suite: {test_id} {outcome} ({seconds:.1f} s)"
        for stream in (sys.stdout, sys.stderr):
            print(ended, file=stream, flush=True)
        _polite_barrier(comm)
    records.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
