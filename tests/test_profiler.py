"""Profiling: torch profiler events of RPCs (the callee's events included) and of the
distributed backward, the merged timeline of every rank, and both under Lightning."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from _dist_utils import make_trainer
from _job_runner import LAUNCHER, mpi_job

import lightning_distgrad.autograd as dist_autograd
from lightning_distgrad import profiler, rpc
from lightning_distgrad.autograd import _engine, _shipping
from lightning_distgrad.rpc._calls import remote_events as remote_events_module
from lightning_distgrad.rpc._calls import spans
from lightning_distgrad.rpc._transport import message_log

REPO = Path(__file__).resolve().parents[1]
REMOTE_OP = "#remote_op: "  # torch's separator (torch.testing's RPC profiling tests)

#: The spans of a pass's local work and gradient messages.
_PASS_SPANS = (_shipping.LOCAL_WORK_SPAN, _shipping.SEND_SPAN, _shipping.RECEIVE_SPAN)


def double(x):
    return x * 2


def ops_in_a_block(x):
    """A few operators, some in a ``record_function`` block (torch's test UDF, in short)."""
    y = torch.ones(3) + x
    with torch.autograd.profiler.record_function("##forward##"):
        return torch.sigmoid(torch.relu(y) * 2)


def add_on(worker, x):
    """A nested call: ``x + 1`` computed on ``worker``."""
    return rpc.rpc_sync(worker, torch.add, (x, 1))


@rpc.functions.async_execution
def add_on_later(worker, x):
    """The nested call of an async function, answered when it completes."""
    return rpc.rpc_async(worker, torch.add, (x, 1))


def remote_events(prof) -> dict[str, list]:
    """The profile's remote events by name."""
    found: dict[str, list] = {}
    for event in prof.events():
        if event.is_remote:
            found.setdefault(event.name, []).append(event)
    return found


@pytest.mark.mpi(min_size=2)
def test_rpcs_are_recorded_under_torchs_rpc_profiling_names(rpc_world):
    me, peer = rpc_world.name, rpc_world.peer()
    x = torch.ones(2)
    with profiler.record_rpcs(), torch.profiler.profile() as prof:
        rpc.rpc_sync(peer, torch.add, (x, 1))
        rpc.rpc_async(peer, double, (x,)).wait()
        rref = rpc.remote(peer, torch.mul, (x, 3))
        assert torch.equal(rref.to_here(), x * 3)
    keys = {e.key for e in prof.key_averages()}
    expected = {
        f"rpc_sync#aten::add({me} -> {peer})",
        f"rpc_async#double({me} -> {peer})",
        f"rpc_remote#aten::mul({me} -> {peer})",
        f"to_here#({me})->({peer})",
        f"rpc_sync#_rref_fetch({me} -> {peer})",
    }
    assert expected <= keys, sorted(k for k in keys if k.startswith("rpc_"))
    # Nothing recorded once the profiler has stopped.
    rpc.rpc_sync(peer, torch.add, (x, 1))
    assert {e.key for e in prof.key_averages()} == keys


@pytest.mark.mpi(min_size=2)
def test_the_callees_events_come_back_as_torchs_remote_events(rpc_world):
    me, peer, peer_rank = rpc_world.name, rpc_world.peer(), rpc_world.peer_rank()
    x = torch.ones(3)
    with profiler.record_rpcs(), torch.profiler.profile() as prof:
        assert torch.equal(rpc.rpc_sync(peer, torch.add, (x, 1)), x + 1)
        rpc.rpc_async(peer, ops_in_a_block, (x,)).wait()
    found = remote_events(prof)
    add_key = f"rpc_sync#aten::add({me} -> {peer})"
    udf_key = f"rpc_async#ops_in_a_block({me} -> {peer})"
    assert f"{add_key}{REMOTE_OP}aten::add" in found, sorted(found)
    assert all(e.node_id == peer_rank for events in found.values() for e in events)
    # What the callee ran is what a local run of the function records.
    with torch.profiler.profile() as local:
        ops_in_a_block(x)
    local_names = {e.name for e in local.events()}
    remote_names = {n[len(udf_key + REMOTE_OP) :] for n in found if n.startswith(udf_key)}
    expected = {
        "aten::ones",
        "aten::add",
        "##forward##",
        "aten::relu",
        "aten::mul",
        "aten::sigmoid",
    }
    assert expected <= local_names & remote_names, sorted(remote_names)
    # What comes back is what the function ran, as in torch: no span of the library's
    # own around it (torch's tests take the first remote event naming the operator).
    assert not [name for name in found if "rpc_serve#" in name], sorted(found)
    # key_averages lists remote time as torch's RPC profiling does.
    averages = {e.key: e for e in prof.key_averages()}
    assert averages[f"{add_key}{REMOTE_OP}aten::add"].node_id == peer_rank
    assert not remote_events_module._expected  # every call's events arrived


@pytest.mark.mpi(min_size=2)
def test_nested_calls_come_back_nested_with_the_node_that_ran_them(rpc_world):
    me, peer = rpc_world.name, rpc_world.peer()
    third, third_rank = rpc_world.peer(2), rpc_world.peer_rank(2)
    x = torch.ones(2)
    with profiler.record_rpcs(), torch.profiler.profile() as prof:
        assert torch.equal(rpc.rpc_sync(peer, add_on, (third, x)), x + 1)
        assert torch.equal(rpc.rpc_async(peer, add_on_later, (third, x)).wait(), x + 1)
        rref = rpc.remote(peer, torch.mul, (x, 3))
        assert torch.equal(rref.to_here(), x * 3)
    found = remote_events(prof)
    for mode, func in (("sync", "add_on"), ("async", "add_on_later")):
        outer = f"rpc_{mode}#{func}({me} -> {peer}){REMOTE_OP}"
        nested = f"{outer}rpc_{mode}#aten::add({peer} -> {third})"
        assert [e.node_id for e in found.get(nested, [])] == [rpc_world.peer_rank()], sorted(found)
        assert [e.node_id for e in found[f"{nested}{REMOTE_OP}aten::add"]] == [third_rank]
    assert f"rpc_remote#aten::mul({me} -> {peer}){REMOTE_OP}aten::mul" in found


@pytest.mark.mpi(min_size=2)
def test_torch_profiler_records_no_rpc_outside_record_rpcs_as_in_torch(rpc_world):
    """PyTorch's RPC profiling records under its legacy profiler only: torch.profiler's
    profiles list no RPC event of its agent (torch's test_profiler_with_async_rpc_udf)."""
    peer, x = rpc_world.peer(), torch.ones(2)
    with torch.profiler.profile() as prof:
        rpc.rpc_sync(peer, torch.add, (x, 1))
        rpc.rpc_async(peer, double, (x,)).wait()
        rpc.remote(peer, torch.mul, (x, 3)).to_here()
        torch.ones(1)
    assert not [e.name for e in prof.events() if e.name.startswith("rpc_") or e.is_remote]
    assert "aten::ones" in {e.name for e in prof.events()}  # it did record this thread
    with torch.autograd.profiler_legacy.profile() as legacy:
        rpc.rpc_sync(peer, torch.add, (x, 1))
    assert [e.node_id for e in legacy.function_events if e.name.startswith("rpc_sync#")]
    with profiler.record_rpcs():
        with profiler.record_rpcs():
            pass
        with torch.profiler.profile() as prof:  # the outer scope still open
            rpc.rpc_sync(peer, torch.add, (x, 1))
    assert [e.name for e in prof.events() if e.name.startswith("rpc_sync#")]
    assert not spans.recording_rpcs()


@pytest.mark.mpi(min_size=2)
def test_only_calls_made_under_a_profiler_ask_their_callee_to_record(rpc_world):
    log = message_log.MessageLog()  # notes the kind of every frame this rank sends

    def requests_sent() -> set[str]:
        kinds = {e[2] for e in log.entries if e[0] == "send" and e[2].endswith("REQUEST")}
        del log.entries[:]
        return kinds

    message_log.set_log(log)
    try:
        rpc.rpc_sync(rpc_world.peer(), torch.add, (torch.ones(2), 1))
        rpc.rpc_sync(rpc_world.peer(), double, (torch.ones(2),))
        unprofiled = requests_sent()
        with torch.profiler.profile():
            rpc.rpc_sync(rpc_world.peer(), torch.add, (torch.ones(2), 1))
        profiled = requests_sent()
    finally:
        message_log.set_log(None)
    assert unprofiled == {"QUICK_REQUEST", "REQUEST"}
    assert profiled == {"PROFILED_REQUEST"}


@pytest.mark.mpi(min_size=2)
def test_the_message_log_counts_a_frames_bytes_alike_on_both_sides(rpc_world):
    log = message_log.MessageLog()
    message_log.set_log(log)
    rpc_world.barrier()  # every rank logs before any sends
    try:
        for size in (3, 100_000):  # a tensor inline in its frame, one whose bytes follow it
            rpc.rpc_sync(rpc_world.peer(), torch.add, (torch.ones(size), 1))
        rpc_world.barrier()
    finally:
        message_log.set_log(None)
    sends = {(rpc_world.rank, e[3], e[4]): e[5] for e in log.entries if e[0] == "send"}
    receipts = {(e[3], rpc_world.rank, e[4]): e[5] for e in log.entries if e[0] == "recv"}
    sent = {k: v for part in rpc_world.comm.allgather(sends) for k, v in part.items()}
    received = {k: v for part in rpc_world.comm.allgather(receipts) for k, v in part.items()}
    both = sent.keys() & received.keys()  # frames of other threads may miss one end
    assert len(both) >= 4 * rpc_world.size
    assert {k: sent[k] for k in both} == {k: received[k] for k in both}


def test_remote_events_are_placed_inside_the_call_and_malformed_ones_dropped():
    class Sink:
        def __init__(self):
            self.calls = []

        def add(self, *args):
            self.calls.append(args)

    sink, key = Sink(), "rpc_sync#f(worker0 -> worker5)"
    good = (("aten::add", 0.0, 40.0, 7, 5, [[2], [2]], 16),)
    bad_time = (("aten::add", "soon", 40.0, 7, 5, [], 0),)
    bad_memory = (("aten::add", 0.0, 40.0, 7, 5, [], "16"),)
    calls = ((1, good), (2, bad_time), (3, list(good)), (4, bad_memory))
    for call_id, events in calls:
        remote_events_module._expected[(5, call_id)] = (sink, key, 1_000)
        remote_events_module._on_remote_events(
            5, remote_events_module.RemoteEvents(call_id, 40.0, events), []
        )
    assert [(args[0], args[1], args[4]) for args in sink.calls] == [(key, 1_000, good)]
    assert not [where for where in remote_events_module._expected if where[0] == 5]
    # A call seen from 1 us to 101 us whose callee took 40 us: the callee's run is
    # placed in the middle, the request and the response taking 30 us each.
    placed = list(remote_events_module._placed(good, key, 1_000, 101_000, 40.0, 0))
    assert placed == [(f"{key}{REMOTE_OP}aten::add", 31.0, 71.0, 7, 5, [[2], [2]], 16)]


def backward_events(prof) -> tuple[list, list]:
    """The profile's distributed backward events and the spans within them."""
    events = prof.events()
    passes = [e for e in events if e.name == _engine.BACKWARD_SPAN]
    inner = [
        e
        for e in events
        if e.name == _shipping.LOCAL_WORK_SPAN
        or e.name.startswith((_shipping.SEND_SPAN, _shipping.RECEIVE_SPAN))
    ]
    return passes, inner


@pytest.mark.mpi(min_size=2)
def test_the_distributed_backward_is_recorded_with_its_work_and_messages(rpc_world):
    me, peer = rpc_world.name, rpc_world.peer()
    t1 = torch.rand(3, 3, requires_grad=True)
    with torch.profiler.profile() as prof, dist_autograd.context() as context_id:
        loss = rpc.rpc_sync(peer, torch.add, (t1, 1)).sum()
        dist_autograd.backward(context_id, [loss])
    passes, inner = backward_events(prof)
    assert len(passes) == 1, [e.name for e in prof.events() if "autograd" in e.name]
    names = [e.name for e in inner]
    assert names.count(_shipping.LOCAL_WORK_SPAN) >= 2, names  # the roots, then the gradients
    assert f"{_shipping.SEND_SPAN}({me} -> {peer})" in names
    assert f"{_shipping.RECEIVE_SPAN}({peer} -> {me})" in names
    for event in inner:  # each one runs on the pass's thread, inside the pass
        parent = event.cpu_parent
        while parent is not None and parent is not passes[0]:
            parent = parent.cpu_parent
        assert parent is passes[0], event.name


def assert_backward_spans_nest(events: list[dict], pid: int) -> list[dict]:
    """Check that worker ``pid``'s local work and gradient messages on the thread of a
    backward pass lie inside that pass (there are some); returns its send spans."""
    spans = [e for e in events if e["ph"] == "X" and e["pid"] == pid]
    passes = [e for e in spans if e["name"] == _engine.BACKWARD_SPAN]
    assert passes, sorted({e["name"] for e in spans})
    threads = {e["tid"] for e in passes}
    inner = [
        e
        for e in spans
        if e["tid"] in threads
        and e["cat"] == "user_annotation"
        and e["name"].startswith(_PASS_SPANS)
    ]
    assert inner
    rounding = 0.002  # times in the trace are rounded to the ns
    for e in inner:
        assert any(
            p["tid"] == e["tid"]
            and p["ts"] - rounding <= e["ts"]
            and e["ts"] + e["dur"] <= p["ts"] + p["dur"] + rounding
            for p in passes
        ), e
    return [e for e in inner if e["name"].startswith(_shipping.SEND_SPAN)]


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
    sends = assert_backward_spans_nest(events, 0)
    assert {e["name"] for e in sends} == {f"{_shipping.SEND_SPAN}(worker0 -> {world.peer()})"}
    assert all(e["args"] == {"bytes": 2 * 2 * 4, "gradients": 1} for e in sends), sends
    png = f"{folder}/timeline.png"
    profiler.plot_timeline(path, png)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(LAUNCHER is None, reason="no MPI launcher found")
def test_the_profiled_lightning_pipeline_writes_a_timeline_of_both_ranks(tmp_path):
    """``examples/profile_pipeline.py`` as its users run it: a trace with the trainer's and
    the server's lanes, and its picture; and an output free of torch's and Kineto's lines
    about a GPU that is not there (CUDA builds of torch on a node without one)."""
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
    noise = [
        line
        for line in result.output.splitlines()
        if re.search(r"gpuGetDeviceCount|^(ERROR|USDT|STAGE):|Warning:|CUDA", line)
    ]
    assert not noise, result.describe()
    with open(tmp_path / "pipeline_trace.json") as f:
        trace = json.load(f)
    assert trace["otherData"]["workers"] == ["worker0", "worker1"]
    names = [(e["pid"], e["name"]) for e in trace["traceEvents"] if e["ph"] == "X"]
    # The example records steps 2 and 3: one forward RPC each.
    forwards = "rpc_sync#_remote_forward(worker0 -> worker1)"
    assert names.count((0, forwards)) == 2, sorted(set(names))[:40]
    assert names.count((1, forwards.replace("rpc_sync", "rpc_serve"))) == 2
    for pid in (0, 1):
        assert (pid, f"{_shipping.SEND_SPAN}(worker{pid} -> worker{1 - pid})") in names
    with open(tmp_path / "pipeline_timeline.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# --- Lightning -----------------------------------------------------------------------------


def step_clock():
    """A callback noting when each training step starts and ends on this rank
    (``time.time_ns``, the clock of the traces), in its ``steps``."""
    import lightning as L

    class StepClock(L.Callback):
        def __init__(self):
            self.steps: dict[int, list[int]] = {}

        def on_train_batch_start(self, trainer, *args):
            self.steps[trainer.global_step] = [time.time_ns(), 0]

        def on_train_batch_end(self, trainer, *args):
            self.steps[trainer.global_step - 1][1] = time.time_ns()

    return StepClock()


def fit_pipeline(world, steps: int, **trainer_kwargs):
    """Fit the pipeline example's model for ``steps`` steps, the last rank serving; the
    Trainer (a serving rank's too)."""
    import lightning as L
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(REPO / "examples"))
    import lightning_pipeline

    L.seed_everything(0, verbose=False)
    data = lightning_pipeline.make_dataset(steps * 8 * (world.size - 1), seed=1)
    trainer = make_trainer(max_steps=steps, **trainer_kwargs)
    trainer.fit(lightning_pipeline.PipelineModel(), DataLoader(data, batch_size=8))
    return trainer


@pytest.mark.mpi(min_size=2)
def test_lightnings_pytorch_profiler_lists_the_rpcs_and_what_the_server_ran(rpc_world, tmp_path):
    from lightning.pytorch.profilers import PyTorchProfiler

    # Six steps: the profiler's default schedule records steps 3 to 5. A timeline of step 4
    # records at the same time (its trace is trainer 0's, at its path).
    trainer = fit_pipeline(
        rpc_world,
        6,
        profiler=PyTorchProfiler(dirpath=tmp_path, filename="p"),
        callbacks=[profiler.TimelineCallback(tmp_path / "trace.json", 4, 1)],
    )
    if trainer.strategy.is_server:
        return
    server = rpc_world.size - 1
    call = f"rpc_sync#_remote_forward({rpc_world.name} -> worker{server})"
    events = trainer.profiler.function_events
    assert [e.node_id for e in events if e.name == call] == [-1] * 3
    remote = {e.name[len(call + REMOTE_OP) :]: e.node_id for e in events if e.is_remote}
    assert {"aten::linear", "aten::tanh"} <= set(remote), sorted(remote)
    assert set(remote.values()) == {server}
    assert call in trainer.profiler.summary()
    if rpc_world.rank == 0:
        with open(tmp_path / "trace.json") as f:
            names = [(e["pid"], e["name"]) for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
        for rank in range(server):
            assert names.count((rank, call.replace("worker0", f"worker{rank}"))) == 1


@pytest.mark.mpi(min_size=2)
def test_the_timeline_callback_records_the_chosen_steps_on_every_rank(rpc_world, tmp_path_factory):
    world = rpc_world
    folder = world.comm.bcast(str(tmp_path_factory.mktemp("steps")) if world.rank == 0 else None)
    clock = step_clock()  # before the timeline: a step's clock starts before its recording
    timeline = profiler.TimelineCallback(f"{folder}/trace.json", start_step=2, num_steps=2)
    fit_pipeline(world, 6, callbacks=[clock, timeline])
    steps = world.comm.gather(clock.steps, root=0)
    if world.rank != 0:
        return
    with open(f"{folder}/trace.json") as f:
        trace = json.load(f)
    events, other = trace["traceEvents"], trace["otherData"]
    lanes = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert lanes == dict(enumerate(world.names))
    server, trainers = world.size - 1, range(world.size - 1)

    def at(rank: int, time_ns: int) -> float:
        """A time of ``rank``'s clock, in the trace's."""
        return time_ns / 1000 - other["clock_offset_us"][rank] - other["start_unix_us"]

    spans = [
        e
        for e in events
        if e["ph"] == "X" and e["name"].startswith(("rpc_", "torch::distributed::autograd::"))
    ]
    forward = "_remote_forward"
    for rank in trainers:
        mine = [e for e in spans if e["pid"] == rank]
        start, end = at(rank, steps[rank][2][0]), at(rank, steps[rank][3][1])
        assert all(start <= e["ts"] and e["ts"] + e["dur"] <= end for e in mine), (start, end)
        for step in (2, 3):  # one forward RPC in each step recorded
            begin, finish = (at(rank, t) for t in steps[rank][step])
            calls = [e for e in mine if forward in e["name"] and begin <= e["ts"] <= finish]
            expected = f"rpc_sync#{forward}(worker{rank} -> {lanes[server]})"
            assert [e["name"] for e in calls] == [expected]
        assert_backward_spans_nest(events, rank)
    # The server ran what the trainers asked for in those steps, and nothing else.
    served = [e for e in spans if e["pid"] == server]
    assert sorted(e["name"] for e in served if forward in e["name"]) == sorted(
        f"rpc_serve#{forward}(worker{rank} -> {lanes[server]})" for rank in trainers for _ in (2, 3)
    )
    slack = other["clock_error_us"][server] + 1.0
    first = min(at(rank, steps[rank][2][0]) for rank in trainers) - slack
    last = max(at(rank, steps[rank][3][1]) for rank in trainers) + slack
    assert all(first <= e["ts"] and e["ts"] + e["dur"] <= last for e in served)
    assert any(e["name"].startswith(_shipping.RECEIVE_SPAN) for e in served)


def test_the_timeline_callback_rejects_a_bad_window_and_another_strategy(tmp_path):
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    for bad in ({"start_step": -1}, {"num_steps": 0}, {"start_step": 1.5}):
        with pytest.raises(ValueError, match="must be an int"):
            profiler.TimelineCallback(tmp_path / "t.json", **bad)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[profiler.TimelineCallback(tmp_path / "t.json")],
    )
    model = BoringModel()
    with pytest.raises(TypeError, match="DistAutogradStrategy"):
        trainer.fit(model)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("root", [0, -1])
def test_clock_offsets_reach_the_root_down_a_tree_within_their_bounds(rpc_world, root):
    # One machine, one clock: every offset is 0, so each estimate lies within its bound.
    from lightning_distgrad.profiler._timeline import clock_offsets

    root = root % rpc_world.size
    offsets = clock_offsets(rpc_world.comm, root)
    if rpc_world.rank != root:
        assert offsets is None
        return
    assert len(offsets) == rpc_world.size and offsets[root] == (0.0, 0.0)
    for rank, (offset, bound) in enumerate(offsets):
        assert abs(offset) <= bound + 1.0, (rank, offset, bound)
