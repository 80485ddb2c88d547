"""The tested versions and the private torch/Lightning APIs of ``lightning_distgrad._compat``.

Serial tests: version checks with monkeypatched version strings (and once in a fresh
interpreter, where the check runs at import), and each private API against plain torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings

import lightning
import pytest
import torch
from _job_runner import clean_env

from lightning_distgrad import _compat

TESTED = ((2, 13), (2, 14))


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test starts with no untested version warned about and the variable unset."""
    monkeypatch.setattr(_compat, "_warned", set())
    monkeypatch.delenv(_compat.ALLOW_UNTESTED_ENV, raising=False)


@pytest.mark.parametrize("found", ["2.13.0", "2.13.0+cpu", "2.13.2", "2.13.0a0+git1234"])
def test_a_tested_version_passes_silently(found):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compat.check_version("torch", found, TESTED)


@pytest.mark.parametrize("found", ["2.14.0", "2.12.1+cu121", "3.0.0", "nightly"])
def test_an_untested_version_raises_saying_what_to_do(found):
    with pytest.raises(ImportError) as info:
        _compat.check_version("torch", found, TESTED)
    text = str(info.value)
    assert f"torch {found} is installed" in text
    assert "tested with torch 2.13.x" in text
    assert "pip install 'torch>=2.13,<2.14'" in text
    assert f"{_compat.ALLOW_UNTESTED_ENV}=1" in text


def test_a_range_of_releases_is_described_by_its_first_and_last():
    with pytest.raises(ImportError, match=r"tested with lightning 2\.4\.x to 2\.6\.x"):
        _compat.check_version("lightning", "2.7.0", ((2, 4), (2, 7)))


def test_allow_untested_warns_once_per_package(monkeypatch):
    monkeypatch.setenv(_compat.ALLOW_UNTESTED_ENV, "1")
    with pytest.warns(RuntimeWarning) as caught:
        for _ in range(3):
            _compat.check_version("torch", "2.14.0", TESTED)
        _compat.check_version("lightning", "2.9.0", ((2, 4), (2, 7)))
    assert [str(w.message).split(" (")[0] for w in caught] == [
        "lightning_distgrad runs on untested torch 2.14.0",
        "lightning_distgrad runs on untested lightning 2.9.0",
    ]


def test_allow_untested_needs_the_value_one(monkeypatch):
    monkeypatch.setenv(_compat.ALLOW_UNTESTED_ENV, "yes")
    with pytest.raises(ImportError):
        _compat.check_version("torch", "2.14.0", TESTED)


def test_installed_versions_are_checked(monkeypatch):
    _compat.check_torch_version()  # the installed ones are tested
    _compat.check_lightning_version()
    _compat.check_lightning_hooks()
    monkeypatch.setattr(torch, "__version__", "2.14.0")
    with pytest.raises(ImportError, match=r"torch 2\.14\.0 is installed"):
        _compat.check_torch_version()
    monkeypatch.setattr(lightning, "__version__", "2.3.3")
    with pytest.raises(ImportError, match=r"lightning 2\.3\.3 is installed"):
        _compat.check_lightning_version()


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
        import json, os, sys, warnings
        import lightning, torch

        torch.__version__, lightning.__version__ = "2.14.0", "2.7.0"
        try:
            import lightning_distgrad
        except ImportError as e:
            print("REFUSED:", e)
        os.environ["LIGHTNING_DISTGRAD_ALLOW_UNTESTED"] = "1"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import lightning_distgrad  # registers the strategy: Lightning is imported
            from lightning_distgrad import DistAutogradStrategy
        print("WARNINGS:", json.dumps([str(w.message) for w in caught]))
        del os.environ["LIGHTNING_DISTGRAD_ALLOW_UNTESTED"]
        for name in [m for m in sys.modules if m.startswith("lightning_distgrad.lightning")]:
            del sys.modules[name]
        del lightning_distgrad.lightning  # imported afresh by the next line
        try:
            from lightning_distgrad import DistAutogradStrategy
        except ImportError as e:
            print("LIGHTNING REFUSED:", e)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=clean_env(), capture_output=True, text=True, timeout=300
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "REFUSED: lightning_distgrad is tested with torch 2.13.x" in out, out
    line = next(ln for ln in out.splitlines() if ln.startswith("WARNINGS: "))
    warned = json.loads(line.split(" ", 1)[1])
    assert sum("untested torch 2.14.0" in w for w in warned) == 1, warned
    assert sum("untested lightning 2.7.0" in w for w in warned) == 1, warned
    assert "LIGHTNING REFUSED: lightning_distgrad is tested with lightning 2.4.x" in out, out


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


def test_module_children_is_the_live_registry():
    seq = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.ReLU())
    children = _compat.module_children(seq)
    assert list(children) == ["0", "1"]
    del children["1"]
    assert len(seq) == 1
