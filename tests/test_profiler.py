"""Profiling: torch profiler events of RPCs and of the distributed backward, and the
merged timeline of every rank."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from _job_runner import LAUNCHER, mpi_job

import lightning_distgrad.autograd as dist_autograd
from lightning_distgrad import profiler, rpc

REPO = Path(__file__).resolve().parents[1]


def double(x):
    return x * 2


@pytest.mark.mpi(min_size=2)
def test_rpcs_are_recorded_under_torchs_rpc_profiling_names(rpc_world):
    me, peer = rpc_world.name, rpc_world.peer()
    x = torch.ones(2)
    with torch.profiler.profile() as prof:
        rpc.rpc_sync(peer, torch.add, (x, 1))
        rpc.rpc_async(peer, double, (x,)).wait()
        rref = rpc.remote(peer, torch.mul, (x, 3))
        assert torch.equal(rref.to_here(), x * 3)
    keys = {e.key for e in prof.key_averages()}
    expected = {
        f"rpc_sync#aten::add({me} -> {peer})",
        f"rpc_async#double({me} -> {peer})",
        f"rpc_remote#aten::mul({me} -> {peer})",
        f"rpc_sync#_rref_fetch({me} -> {peer})",
    }
    assert expected <= keys, sorted(k for k in keys if k.startswith("rpc_"))
    # Nothing recorded once the profiler has stopped.
    rpc.rpc_sync(peer, torch.add, (x, 1))
    assert {e.key for e in prof.key_averages()} == keys


@pytest.mark.mpi(min_size=2)
def test_the_distributed_backward_is_recorded(rpc_world):
    t1 = torch.rand(3, 3, requires_grad=True)
    with torch.profiler.profile() as prof, dist_autograd.context() as context_id:
        loss = rpc.rpc_sync(rpc_world.peer(), torch.add, (t1, 1)).sum()
        dist_autograd.backward(context_id, [loss])
    keys = {e.key for e in prof.key_averages()}
    assert "torch::distributed::autograd::backward" in keys, sorted(keys)


@pytest.mark.mpi(min_size=2)
def test_the_merged_timeline_has_a_lane_per_worker_and_an_arrow_per_message(
    rpc_world, tmp_path_factory
):
    world = rpc_world
    folder = world.comm.bcast(str(tmp_path_factory.mktemp("timeline")) if world.rank == 0 else None)
    path = f"{folder}/trace.json"
    with profiler.profile(path, comm=world.comm), dist_autograd.context() as context_id:
        t = torch.rand(2, 2, requires_grad=True)
        out = rpc.rpc_sync(world.peer(), torch.mul, (t, 2))
        rpc.rpc_sync(world.peer(), double, (torch.ones(300, 300),))
        dist_autograd.backward(context_id, [out.sum()])
        world.barrier()
    if world.rank != 0:
        return
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    for e in events:  # Chrome trace format: what each phase needs
        assert e["ph"] in {"X", "M", "s", "f", "i", "B", "E"}, e
        assert isinstance(e["pid"], int) and 0 <= e["pid"] < world.size, e
        if e["ph"] == "X":
            assert isinstance(e["name"], str) and e["dur"] >= 0 and e["ts"] >= 0, e
    lanes = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert lanes == dict(enumerate(world.names))
    assert len(trace["otherData"]["clock_error_us"]) == world.size
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert f"rpc_sync#aten::mul(worker0 -> {world.peer()})" in names
    assert f"rpc_serve#double({world.peer(-1)} -> worker0)" in names, sorted(names)
    flows: dict[int, dict] = {}
    for e in events:
        if e["ph"] in "sf" and e["cat"] == "rpc_message":
            assert e["ph"] not in flows.setdefault(e["id"], {}), e  # one start, one end
            flows[e["id"]][e["ph"]] = e
    assert flows and all(set(pair) == {"s", "f"} for pair in flows.values())
    kinds = set()
    for pair in flows.values():
        start, end = pair["s"], pair["f"]
        assert end["ts"] >= start["ts"]
        receipt = next(
            e
            for e in events
            if e["ph"] == "X"
            and e["cat"] == "rpc_message"
            and e["pid"] == end["pid"]
            and e["ts"] == end["ts"]
        )
        assert (receipt["args"]["from"], receipt["args"]["to"]) == (start["pid"], end["pid"])
        kinds.add(start["name"])
    assert {"QUICK_REQUEST", "REQUEST", "RESPONSE", "GRADIENTS"} <= kinds, kinds
    png = f"{folder}/timeline.png"
    profiler.plot_timeline(path, png)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(LAUNCHER is None, reason="no MPI launcher found")
def test_the_profiled_lightning_pipeline_writes_a_timeline_of_both_ranks(tmp_path):
    """``examples/profile_pipeline.py`` as its users run it: a trace with the trainer's and
    the server's lanes, and its picture."""
    result = mpi_job(
        2,
        [
            sys.executable,
            "-m",
            "mpi4py",
            str(REPO / "examples" / "profile_pipeline.py"),
            "--out",
            str(tmp_path),
        ],
        330,
        REPO,
    )
    assert result.code == 0, result.describe()
    with open(tmp_path / "pipeline_trace.json") as f:
        trace = json.load(f)
    spans = {(e["pid"], e["name"].split("#")[0]) for e in trace["traceEvents"] if e["ph"] == "X"}
    assert (0, "rpc_sync") in spans or (0, "rpc_async") in spans, sorted(spans)[:20]
    assert (1, "rpc_serve") in spans, sorted(spans)[:20]
    with open(tmp_path / "pipeline_timeline.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
