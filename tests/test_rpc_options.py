"""Options, backend type and ``WorkerInfo``: plain objects, no MPI job needed."""

from __future__ import annotations

import datetime
import pickle

import pytest
import torch

from lightning_distgrad import rpc
from lightning_distgrad.rpc import (
    BackendType,
    MPIRpcBackendOptions,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
    WorkerInfo,
)


def test_options_defaults():
    options = MPIRpcBackendOptions()
    assert options.rpc_timeout == 60.0
    assert options.num_worker_threads == 16
    assert options.comm is None
    assert options.device_maps == {}


def test_options_keyword_arguments():
    sentinel = object()
    options = MPIRpcBackendOptions(
        rpc_timeout=5,
        num_worker_threads=4,
        comm=sentinel,
        device_maps={"worker1": {0: 1}},
        init_method="env://",
    )
    assert options.rpc_timeout == 5.0 and isinstance(options.rpc_timeout, float)
    assert options.num_worker_threads == 4
    assert options.comm is sentinel
    assert options.device_maps == {"worker1": {torch.device("cuda", 0): torch.device("cuda", 1)}}
    with pytest.raises(TypeError):
        MPIRpcBackendOptions(5)  # keyword-only, like torch's options


def test_options_reject_zero_worker_threads():
    with pytest.raises(ValueError, match="num_worker_threads"):
        MPIRpcBackendOptions(num_worker_threads=0)


def test_set_device_map_is_one_to_one():
    options = MPIRpcBackendOptions()
    options.set_device_map("worker1", {0: 1, "cuda:1": "cuda:0"})
    assert options.device_maps["worker1"] == {
        torch.device("cuda", 0): torch.device("cuda", 1),
        torch.device("cuda", 1): torch.device("cuda", 0),
    }
    with pytest.raises(ValueError, match="only supports 1-to-1 mapping"):
        options.set_device_map("worker1", {2: 1})


def test_torch_names_are_aliases():
    assert TensorPipeRpcBackendOptions is MPIRpcBackendOptions
    # As torch's: the base class of every agent's options, which init_rpc does not take alone.
    assert issubclass(MPIRpcBackendOptions, RpcBackendOptions)
    assert RpcBackendOptions().rpc_timeout == 60.0
    assert BackendType.TENSORPIPE is BackendType.MPI


def test_worker_info_pickles_and_compares():
    info = WorkerInfo("worker3", 3)
    assert pickle.loads(pickle.dumps(info)) == info
    assert {info: 1}[WorkerInfo("worker3", 3)] == 1
    assert (info.name, info.id) == ("worker3", 3)


def test_unset_timeout_sentinel_matches_torch():
    assert rpc.UNSET_RPC_TIMEOUT == -1.0


@pytest.mark.parametrize("bad", [-5, -0.001, -1, -1.0, float("nan"), float("inf")], ids=repr)
def test_options_reject_bad_rpc_timeout(bad):
    with pytest.raises(
        ValueError,
        match=r"^rpc_timeout must be a number of seconds >= 0 "
        r"\(0: no timeout\); got ",
    ) as info:
        MPIRpcBackendOptions(rpc_timeout=bad)
    assert "UNSET_RPC_TIMEOUT" not in str(info.value)  # the default itself cannot be unset


@pytest.mark.parametrize("bad", ["60", None, True, datetime.timedelta(seconds=5)], ids=repr)
def test_options_reject_an_rpc_timeout_of_another_type_with_torchs_type_error(bad):
    with pytest.raises(TypeError, match="incompatible constructor arguments") as info:
        TensorPipeRpcBackendOptions(rpc_timeout=bad)
    assert "rpc_timeout must be a number of seconds >= 0 (0: no timeout); got" in str(info.value)


def test_options_accept_zero_and_positive_rpc_timeouts():
    for good, expected in ((0, 0.0), (0.0, 0.0), (1e-6, 1e-6), (5, 5.0), (2.5, 2.5)):
        assert MPIRpcBackendOptions(rpc_timeout=good).rpc_timeout == expected


def test_check_timeout_says_what_is_allowed():
    from lightning_distgrad.rpc._calls.dispatch import check_timeout

    assert check_timeout(rpc.UNSET_RPC_TIMEOUT) == rpc.UNSET_RPC_TIMEOUT
    assert check_timeout(0) == 0.0 and check_timeout(3) == 3.0
    with pytest.raises(ValueError) as info:
        check_timeout(-5)
    assert str(info.value) == (
        "timeout must be a number of seconds >= 0 (0: no timeout) or "
        "UNSET_RPC_TIMEOUT (-1) for the default; got -5"
    )
    with pytest.raises(ValueError, match=r"; got inf; use 0 for no timeout$"):
        check_timeout(float("inf"))
    with pytest.raises(TypeError, match=r"; got '1' \(str\)$"):  # a type: as torch's
        check_timeout("1")
    with pytest.raises(ValueError, match=r"^shutdown timeout must be .*; got nan$"):
        check_timeout(float("nan"), "shutdown timeout", unset_ok=False)


def test_timeout_error_keeps_torch_text_and_shows_sub_millisecond_timeouts():
    from lightning_distgrad.rpc._calls.errors import timeout_error

    dst = WorkerInfo("worker1", 1)
    assert str(timeout_error(1e-6, dst)) == (
        "RPC ran for more than set timeout (0.001 ms) and will now be marked with an error "
        "(call to worker1, rank 1)"
    )
    assert str(timeout_error(0.1, dst)).startswith("RPC ran for more than set timeout (100 ms) ")
    assert "(1.5 ms)" in str(timeout_error(0.0015, dst))
    assert "(60000 ms)" in str(timeout_error(60.0, dst))
    assert str(timeout_error(2.0)) == (
        "RPC ran for more than set timeout (2000 ms) and will now be marked with an error"
    )
