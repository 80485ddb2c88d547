"""The supported releases and the private torch/Lightning APIs of ``lightning_distgrad._compat``.

Serial tests: version checks with monkeypatched version strings (and once in a fresh
interpreter, where the check runs at import), and each private API against plain torch.
Then, with torch's own RPC and without it (``LIGHTNING_DISTGRAD_TEST_WITHOUT_TORCH_RPC=1``,
see ``tests/without_torch_rpc``): which private names depend on it, their fallbacks, and
that every rank and every job the suite starts runs in the mode it was started in (one MPI
test and one serial test that starts a job).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
import warnings

import lightning
import pytest
import torch
from _job_runner import LAUNCHER, clean_env, mpi_job
from _timing import scaled
from without_torch_rpc import torch_rpc_off

from lightning_distgrad import _compat, _versions

SUPPORTED = ((2, 5), (2, 14))


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test starts with no newer release warned about."""
    monkeypatch.setattr(_versions, "_warned", set())


@pytest.mark.parametrize(
    "found", ["2.5.0", "2.5.1+cu124", "2.11.0", "2.13.0+cpu", "2.14.1", "2.13.0a0+git1234"]
)
def test_a_supported_release_passes_silently(found):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _versions.check_version("torch", found, SUPPORTED)


@pytest.mark.parametrize("found", ["2.4.1", "2.0.0+cu118", "1.13.1"])
def test_a_release_below_the_floor_raises_naming_the_missing_engine_feature(found):
    with pytest.raises(ImportError) as info:
        _versions.check_version("torch", found, SUPPORTED)
    text = str(info.value)
    assert f"needs torch 2.5 or newer (supported: 2.5 to 2.14), but torch {found} is" in text
    assert "GradientEdge roots" in text
    assert "pip install 'torch>=2.5'" in text


@pytest.mark.parametrize("found", ["2.15.0", "2.16.0.dev20261101+cpu", "3.0.0", "nightly"])
def test_a_newer_release_warns_once_and_runs(found):
    with pytest.warns(RuntimeWarning) as caught:
        for _ in range(3):
            _versions.check_version("torch", found, SUPPORTED)
    assert [str(w.message).split(". ")[0] for w in caught] == [
        f"lightning_distgrad is tested with torch 2.5 to 2.14, not with torch {found}"
    ]


def test_each_package_warns_once():
    with pytest.warns(RuntimeWarning) as caught:
        _versions.check_version("torch", "2.15.0", SUPPORTED)
        _versions.check_version("lightning", "2.9.0", ((2, 4), (2, 6)))
        _versions.check_version("lightning", "2.9.0", ((2, 4), (2, 6)))
    assert len(caught) == 2
    assert "lightning 2.4 to 2.6, not with lightning 2.9.0" in str(caught[1].message)


def test_a_lightning_below_the_floor_names_what_it_lacks():
    with pytest.raises(ImportError, match=r"Strategy hooks that Lightning has had since 2\.4"):
        _versions.check_version("lightning", "2.3.3", ((2, 4), (2, 6)))


def test_the_installed_releases_are_supported(monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # within the tested range: no warning either
        _versions.check_torch_version()
        _versions.check_lightning_version()
    _compat.check_lightning_hooks()
    installed = tuple(int(part) for part in torch.__version__.split(".")[:2])
    assert (
        _versions.SUPPORTED_TORCH[0] <= installed <= _versions.SUPPORTED_TORCH[1]
    )  # CI's releases
    monkeypatch.setattr(torch, "__version__", "2.4.1")
    with pytest.raises(ImportError, match=r"torch 2\.4\.1 is installed"):
        _versions.check_torch_version()
    monkeypatch.setattr(lightning, "__version__", "2.3.3")
    with pytest.raises(ImportError, match=r"lightning 2\.3\.3 is installed"):
        _versions.check_lightning_version()


def test_a_missing_lightning_hook_is_named(monkeypatch):
    hooks = (*_compat._LIGHTNING_HOOKS, ("lightning.pytorch.strategies", "Strategy", "_gone"))
    monkeypatch.setattr(_compat, "_LIGHTNING_HOOKS", hooks)
    with pytest.raises(ImportError, match=r"lightning\.pytorch\.strategies\.Strategy\._gone"):
        _compat.check_lightning_hooks()


def test_a_missing_private_name_is_named():
    with pytest.raises(ImportError, match=r"private torch\._C\._functions\.Gone, which"):
        _compat._private("torch._C._functions", "Gone")


def test_the_checks_run_at_import():
    script = textwrap.dedent(
        """
        import json, sys, warnings
        import lightning, torch

        real_torch = torch.__version__
        torch.__version__ = "2.4.1"
        try:
            import lightning_distgrad
        except ImportError as e:
            print("REFUSED:", e)
        for name in [m for m in sys.modules if m.startswith("lightning_distgrad")]:
            del sys.modules[name]
        torch.__version__, lightning.__version__ = "2.15.0", "2.7.0"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import lightning_distgrad  # registers the strategy: Lightning is imported
            from lightning_distgrad import DistAutogradStrategy
        print("WARNINGS:", json.dumps([str(w.message) for w in caught]))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "REFUSED: lightning_distgrad needs torch 2.5 or newer" in out, out
    line = next(ln for ln in out.splitlines() if ln.startswith("WARNINGS: "))
    warned = json.loads(line.split(" ", 1)[1])
    assert sum("not with torch 2.15.0" in w for w in warned) == 1, warned
    assert sum("not with lightning 2.7.0" in w for w in warned) == 1, warned


# ---------------------------------------------------------------------------
# The private torch APIs, against plain torch


def test_engine_run_backward_matches_autograd_grad():
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    y = (x * w).sin()
    grad_out = torch.randn(3)
    expected = torch.autograd.grad([y], [x, w], [grad_out], retain_graph=True)
    got = _compat.engine_run_backward((y,), (grad_out,), False, False, (x, w), True, False)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)


def test_delayed_error_node_raises_its_message_in_local_backward():
    x = torch.ones(2, requires_grad=True)
    out = _compat.DelayedError("not here", 1)(x)
    with pytest.raises(RuntimeError, match="not here"):
        out.sum().backward()


def test_futures_from_collect_all_are_cfutures():
    fut = torch.futures.collect_all([torch.futures.Future()])
    assert isinstance(fut, _compat.CFuture)
    assert not isinstance(fut, torch.futures.Future)  # why the C class is needed
    assert _compat.future_done(fut) is False


def test_unwrap_func_runs_on_every_wait():
    fut = torch.futures.Future()
    seen = []
    _compat.set_unwrap_func(fut, seen.append)
    fut.set_result(21)
    assert fut.wait() == 21 and fut.wait() == 21
    assert seen == [21, 21]
    failing = torch.futures.Future()
    _compat.set_unwrap_func(failing, lambda v: (_ for _ in ()).throw(ValueError(v)))
    failing.set_result("raised on wait")
    with pytest.raises(ValueError, match="raised on wait"):
        failing.wait()


def test_profiler_enabled_follows_a_profiler():
    assert _compat.profiler_enabled() is False
    with torch.autograd.profiler.profile():
        assert _compat.profiler_enabled() is True


def test_find_builtin_names_torch_operators_only():
    assert _compat.find_builtin(torch.add) == "aten::add"
    assert _compat.find_builtin(len) is None


def test_kineto_records_this_thread_tells_kineto_from_the_legacy_profiler():
    with torch.profiler.profile():
        assert _compat.kineto_records_this_thread() is True
    with torch.autograd.profiler_legacy.profile():
        assert _compat.kineto_records_this_thread() is False


def test_wrapped_kineto_parser_lists_added_events():
    seen = []

    def add_events(profile, result, events):
        seen.append(len(events))
        return events

    _compat.wrap_kineto_results_parser(add_events)
    _compat.wrap_kineto_results_parser(add_events)  # idempotent: one wrapper
    with torch.profiler.profile() as prof:
        torch.add(torch.ones(2), 1)
    names = {e.key for e in prof.key_averages()}
    assert "aten::add" in names
    assert seen and seen[0] >= 1


def test_span_on_future_ends_with_the_future():
    fut = torch.futures.Future()
    with torch.autograd.profiler.profile() as prof:
        record = torch.autograd.profiler.record_function("compat-span")
        record.__enter__()
        out = _compat.end_span_on_future(record, fut)
        fut.set_result(5)
        assert out.wait() == 5
    assert "compat-span" in {e.name for e in prof.function_events}


def test_tensor_hooks_and_node_inputs():
    x = torch.ones(2, requires_grad=True)
    assert not _compat.tensor_hooks(x)
    handle = x.register_hook(lambda g: g * 3)
    hooks = _compat.tensor_hooks(x)
    assert len(hooks) == 1
    handle.remove()
    assert len(hooks) == 0
    a, b = torch.ones(4, requires_grad=True).split(2)
    assert _compat.num_node_inputs(a.grad_fn) == 2  # split: one gradient per output
    assert _compat.num_node_inputs((a * 2).grad_fn) == 1


def test_node_post_hooks_lists_a_nodes_hooks_in_order_and_leaves_them_as_they_were():
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    node = y.grad_fn.next_functions[0][0]  # x's AccumulateGrad, alive while y is
    assert _compat.node_post_hooks(node) == {}
    calls = []
    first = node.register_hook(lambda grad_inputs, grad_outputs: calls.append("first"))
    node.register_hook(lambda grad_inputs, grad_outputs: calls.append("second"))
    first.remove()
    node.register_hook(lambda grad_inputs, grad_outputs: calls.append("third"))
    for hook in _compat.node_post_hooks(node).values():
        hook((), (torch.ones(2),))
    assert calls == ["second", "third"]
    assert len(_compat.node_post_hooks(node)) == 2  # no stand-in hook left behind
    y.sum().backward()  # the node keeps its hooks
    assert calls == ["second", "third", "second", "third"]


def test_node_pre_hooks_lists_a_nodes_pre_hooks_in_order_and_leaves_them_as_they_were():
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    node = y.grad_fn.next_functions[0][0]
    assert _compat.node_pre_hooks(node) == {}
    first = node.register_prehook(lambda grads: (grads[0] + 1,))
    node.register_prehook(lambda grads: (grads[0] * 10,))
    first.remove()
    node.register_prehook(lambda grads: (grads[0] - 1,))
    grads = (torch.ones(2),)
    for hook in _compat.node_pre_hooks(node).values():
        grads = hook(grads)
    assert grads[0].tolist() == [9.0, 9.0]
    assert len(_compat.node_pre_hooks(node)) == 2  # no stand-in hook left behind
    y.sum().backward()  # the node keeps its hooks: (2 * 10) - 1
    assert x.grad.tolist() == [19.0, 19.0]


def test_post_accumulate_grad_hooks_is_the_live_dict():
    p = torch.nn.Parameter(torch.ones(2))
    assert not _compat.post_accumulate_grad_hooks(p)
    handle = p.register_post_accumulate_grad_hook(lambda t: None)
    assert len(_compat.post_accumulate_grad_hooks(p)) == 1
    handle.remove()
    assert not _compat.post_accumulate_grad_hooks(p)


@pytest.fixture
def one_rank_process_group(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ddp_parameters_are_the_reduced_and_the_delayed_ones(one_rank_process_group):
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    net[1].bias.requires_grad_(False)
    delayed = [("0.weight", net[0].weight)]
    ddp = DDP(net, delay_all_reduce_named_params=delayed, param_to_hook_all_reduce=net[0].weight)
    reduced, late = _compat.ddp_parameters(ddp)
    assert reduced == [net[0].bias, net[1].weight] and late == [net[0].weight]


def test_fully_shard_modules_lists_the_modules_of_fully_shard(one_rank_process_group):
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch 2.5
        from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    net = torch.nn.Linear(2, 2)
    assert net not in _compat.fully_shard_modules()
    try:
        fully_shard(net, mesh=init_device_mesh("cpu", (1,)))
        assert _compat.fully_shard_modules() == [net]
    except RuntimeError as e:
        if "requires CUDA" not in str(e):
            raise
        pytest.skip(f"fully_shard does not run on CPU in torch {torch.__version__}")
    finally:
        torch.distributed._composable_state._module_state_mapping.pop(net, None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="its CUDA behaviour is in test_cuda.py")
def test_cuda_ipc_sharing_takes_a_storage_and_refuses_without_a_gpu():
    """The export takes one storage and the import torch's 8 export fields (as
    ``tests/test_cuda.py`` runs them on a GPU); here both refuse with a RuntimeError, which
    ``init_rpc``'s probe and the receiver catch."""
    with pytest.raises(RuntimeError):
        _compat.share_cuda_storage(torch.UntypedStorage(4))
    with pytest.raises(RuntimeError):
        _compat.open_cuda_storage(0, b"h" * 64, 4, 0, b"/torch_0_0", 0, b"e" * 64, False)


def test_module_children_is_the_live_registry():
    seq = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.ReLU())
    children = _compat.module_children(seq)
    assert list(children) == ["0", "1"]
    del children["1"]
    assert len(seq) == 1


def test_the_first_profiler_cycle_starts_without_the_cycle_warning():
    filters = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _compat.quiet_first_profiler_cycle():
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        torch.add(torch.ones(2), 1)
        prof.__exit__(None, None, None)
    assert not [w for w in caught if "clears events" in str(w.message)], caught
    assert warnings.filters == filters  # the user's filters are as they were
    assert "aten::add" in {e.key for e in prof.key_averages()}


def test_kineto_is_quieted_only_without_a_gpu(monkeypatch):
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    _compat.quiet_kineto_without_gpu()
    assert os.environ.get("KINETO_LOG_LEVEL") == (None if torch.cuda.is_available() else "6")
    monkeypatch.setenv("KINETO_LOG_LEVEL", "2")
    _compat.quiet_kineto_without_gpu()
    assert os.environ["KINETO_LOG_LEVEL"] == "2"  # the user's choice stays


# ---------------------------------------------------------------------------
# torch's own RPC: optional (run with and without it, see the module doc)


def a_ddp_module() -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(torch.nn.Linear(1, 1))


#: For a private name of an instance attribute: an instance of its class.
INSTANCES = {
    "torch.autograd.graph.Node": lambda: (torch.ones(1, requires_grad=True) * 2).grad_fn,
    "torch.nn.Module": torch.nn.Module,
    "torch.nn.parallel.DistributedDataParallel": a_ddp_module,
}


def resolve(name: str):
    """A name of ``_compat.TORCH_PRIVATE_NAMES``; ImportError or AttributeError if missing."""
    owner, attribute = name.rsplit(".", 1)
    if owner in INSTANCES:
        return getattr(INSTANCES[owner](), attribute)
    return _compat._private(owner, attribute)


def torch_has_rpc() -> bool:
    """Whether torch's own RPC is available here; never under the test mode without it."""
    available = torch.distributed.rpc.is_available()
    assert not (available and torch_rpc_off.requested()), "the mode did not take effect"
    return available


#: Each private name that depends on torch's RPC: whether its fallback is in use.
FALLBACK_USED = {
    "torch._C._distributed_rpc._set_profiler_node_id": lambda: (
        _compat._torch_set_profiler_node_id is None
    ),
    "torch.distributed.rpc.api._thread_local_var": lambda: _compat.torch_rpc_thread_local() is None,
}


def test_every_private_torch_name_that_needs_no_torch_rpc_resolves(one_rank_process_group):
    independent = [name for name, needs in _compat.TORCH_PRIVATE_NAMES.items() if not needs]
    for name in independent:
        resolve(name)  # raises, naming it, if missing
    torch_has_rpc()


def test_each_name_that_needs_torchs_rpc_falls_back_exactly_where_it_is_missing():
    dependent = {name for name, needs in _compat.TORCH_PRIVATE_NAMES.items() if needs}
    assert dependent == set(FALLBACK_USED)  # a new dependent name needs its check here
    has_rpc = torch_has_rpc()
    for name in sorted(dependent):
        if has_rpc:
            resolve(name)
        else:
            with pytest.raises((ImportError, AttributeError)):
                resolve(name)
        assert FALLBACK_USED[name]() is not has_rpc, name


def test_legacy_profiler_events_carry_the_node_id_with_or_without_torchs_rpc(monkeypatch):
    monkeypatch.setattr(_compat, "_profiler_node_id", None)  # the fallback's, restored after
    # 0: what init_rpc sets in a process alone (torch's own call takes no "unset" back).
    _compat.set_profiler_node_id(0)
    with torch.autograd.profiler_legacy.profile() as prof:
        torch.add(torch.ones(1), 1)
    assert {e.node_id for e in prof.function_events} == {0}  # -1 where none was set
    _compat.enable_legacy_profiler(prof.config())
    torch.mul(torch.ones(1), 2)
    events = _compat.parse_legacy_records(_compat.disable_legacy_profiler())
    assert "aten::mul" in {e.name for e in events}
    assert {e.node_id for e in events} == {0}


def rpc_and_autograd_work(rank: int, peer: str) -> None:
    """A call, an RRef and a distributed backward between this rank and ``peer`` (run by an
    MPI test's ranks and by a job's)."""
    import lightning_distgrad.autograd as dist_autograd
    from lightning_distgrad import rpc

    x = torch.ones(2)
    assert torch.equal(rpc.rpc_sync(peer, torch.add, (x, rank)), x + rank)
    assert torch.equal(rpc.remote(peer, torch.mul, (x, 3)).to_here(), x * 3)
    x.requires_grad_()
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync(peer, torch.mul, (x, 2)).sum()
        dist_autograd.backward(context_id, [loss])
        assert torch.equal(dist_autograd.get_gradients(context_id)[x], torch.full((2,), 2.0))


@pytest.mark.mpi(min_size=2)
def test_every_rank_runs_in_the_mode_the_suite_was_started_in(rpc_world):
    import torch.distributed.autograd

    has_rpc = torch_has_rpc()
    assert torch.distributed.autograd.is_available() is has_rpc
    assert hasattr(torch._C, "_distributed_rpc") is has_rpc
    assert rpc_world.comm.allgather(has_rpc) == [has_rpc] * rpc_world.size
    rpc_and_autograd_work(rpc_world.rank, rpc_world.peer())


#: A 2-rank job: the work of rpc_and_autograd_work; then each rank writes whether torch's RPC
#: is available there.
JOB_SCRIPT = f"""
import json
import torch
from lightning_distgrad import rpc

{inspect.getsource(rpc_and_autograd_work)}

rpc.init_rpc()
me = rpc.get_worker_info()
rpc_and_autograd_work(me.id, f"worker{{1 - me.id}}")
rpc.shutdown()
with open(f"rank{{me.id}}.json", "w") as f:
    json.dump(torch.distributed.rpc.is_available(), f)
"""


@pytest.mark.skipif(LAUNCHER is None, reason="no MPI launcher found")
def test_a_job_that_the_suite_starts_runs_in_its_mode(tmp_path):
    has_rpc = torch_has_rpc()
    argv = [sys.executable, "-c", JOB_SCRIPT]
    result = mpi_job(2, argv, scaled(180), cwd=tmp_path)
    assert result.code == 0, result.describe()
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert seen == [has_rpc, has_rpc], result.describe()
