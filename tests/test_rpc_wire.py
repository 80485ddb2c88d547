"""The wire format's pieces on their own (serial): tensor metadata and the receive-buffer pool."""

from __future__ import annotations

import math
import os
import pickle
import re
import time

import pytest
import torch

from lightning_distgrad.rpc._calls import payload as payload_module
from lightning_distgrad.rpc._calls.payload import decode_payload, encode_payload
from lightning_distgrad.rpc._transport import frames, tensor_bytes
from lightning_distgrad.rpc._transport.receive_buffers import ReceiveBufferPool
from lightning_distgrad.rpc._transport.tensor_bytes import allocate_tensor, describe_host_tensor

MIB = 1 << 20


def _received(pool: ReceiveBufferPool, n: int) -> torch.Tensor:
    meta, _ = describe_host_tensor(torch.zeros(n // 4))
    return allocate_tensor(meta, pool)


def test_inline_tensors_round_trip_through_pickle_as_writable_tensors():
    for t in (
        torch.arange(5, dtype=torch.float64),
        torch.tensor(True),
        torch.zeros(0, 3),
        torch.arange(6).view(2, 3).t(),  # non-contiguous
        torch.ones(2, 2, dtype=torch.bfloat16),
        torch.ones(3, dtype=torch.complex64),
        torch.arange(4, dtype=torch.int8).view(1, 2, 2),
    ):
        meta, buffer = describe_host_tensor(t)
        assert buffer is None
        back = allocate_tensor(pickle.loads(pickle.dumps(meta, 5)))
        assert torch.equal(back, t)
        back.zero_() if back.dtype != torch.bool else back.logical_not_()  # writable


def test_pool_reuses_a_buffer_only_when_no_tensor_uses_it():
    pool = ReceiveBufferPool(min_bytes=MIB, max_bytes=64 * MIB)
    a = _received(pool, 2 * MIB)
    b = _received(pool, 2 * MIB)
    b_ptr = b.data_ptr()
    assert a.data_ptr() != b_ptr
    view = b[10:20]
    del b
    c = _received(pool, 2 * MIB)  # b's buffer is still used by the view
    assert c.data_ptr() not in (a.data_ptr(), b_ptr)
    del view
    d = _received(pool, 2 * MIB)  # now it is free
    assert d.data_ptr() == b_ptr and pool.pooled_bytes == 6 * MIB


def test_pooled_buffers_start_on_a_page_boundary():
    # Page-aligned: MPICH's single-copy path fills misaligned buffers slowly.
    pool = ReceiveBufferPool(min_bytes=MIB, max_bytes=64 * MIB)
    for n in (MIB, 3 * MIB + 4, 5 * MIB):
        t = _received(pool, n)
        assert t.data_ptr() % 4096 == 0
        assert t.numel() * t.element_size() == n // 4 * 4


def _mapping_of(address: int) -> tuple[str, str]:
    """(permissions, VmFlags) of this process's mapping that holds ``address``."""
    with open("/proc/self/smaps") as f:
        blocks = re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", f.read())
    for block in blocks:
        span, perms = block.split()[:2]
        start, end = (int(x, 16) for x in span.split("-"))
        if start <= address < end:
            return perms, re.search(r"VmFlags:(.*)", block).group(1).split()
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux only")
def test_big_receive_buffers_are_private_mappings_advised_for_huge_pages():
    # A single copy into them walks 2 MiB pages; a shared mapping would get none.
    pool = ReceiveBufferPool(min_bytes=MIB, max_bytes=64 * MIB)
    for n in (MIB, 3 * MIB + 4):
        t = _received(pool, n)
        perms, flags = _mapping_of(t.data_ptr())
        assert perms == "rw-p" and "hg" in flags, (perms, flags)


def test_pool_stays_within_its_budget():
    pool = ReceiveBufferPool(min_bytes=MIB, max_bytes=4 * MIB)
    kept = [_received(pool, 2 * MIB) for _ in range(4)]
    assert pool.pooled_bytes == 4 * MIB
    assert len({t.data_ptr() for t in kept}) == 4
    small = _received(pool, MIB // 2)  # under min_bytes: never pooled
    assert small.numel() == MIB // 8 and pool.pooled_bytes == 4 * MIB


def test_free_buffers_of_other_sizes_make_room_for_a_new_size():
    pool = ReceiveBufferPool(min_bytes=MIB, max_bytes=5 * MIB)
    a = _received(pool, 2 * MIB)
    b = _received(pool, 2 * MIB)
    del a  # free; ``b`` stays in use
    big = _received(pool, 2 * MIB + 4)  # a's buffer makes room
    assert pool.pooled_bytes == 4 * MIB + 4
    big_ptr = big.data_ptr()
    del big
    assert _received(pool, 2 * MIB + 4).data_ptr() == big_ptr  # pooled
    assert torch.equal(b, torch.zeros(MIB // 2))


def test_trim_frees_only_buffers_no_tensor_used_for_idle_s():
    pool = ReceiveBufferPool(min_bytes=MIB, max_bytes=64 * MIB, idle_s=1.0)
    used = _received(pool, 2 * MIB)
    free = _received(pool, 3 * MIB)
    del free
    now = time.monotonic()
    pool.trim(now)  # the free one has been free for less than idle_s
    assert pool.pooled_bytes == 5 * MIB and pool.next_trim <= now + 1.0
    pool.trim(now + 2.0)
    assert pool.pooled_bytes == 2 * MIB  # the one in use stays, however long
    used_ptr = used.data_ptr()
    del used
    pool.trim(now + 2.5)  # seen in use at now + 2.0
    assert pool.pooled_bytes == 2 * MIB
    assert _received(pool, 2 * MIB).data_ptr() == used_ptr
    pool.trim(now + 10.0)
    assert pool.pooled_bytes == 0 and pool.next_trim == math.inf


def test_a_tensor_that_occurs_twice_travels_once_and_arrives_as_one():
    t = torch.arange(4.0)
    p = torch.nn.Parameter(torch.zeros(2))
    payload, table, _ = encode_payload({"a": t, "b": [t, (t, p)], "c": p}, dst_id=1)
    assert [id(x) for x in table] == [id(t), id(p)]
    back = decode_payload(payload, [x.detach().clone() for x in table])
    assert back["a"] is back["b"][0] is back["b"][1][0]
    assert back["c"] is back["b"][1][1] and isinstance(back["c"], torch.nn.Parameter)
    assert torch.equal(back["a"], t) and torch.equal(back["c"], p)


def test_operators_travel_as_cached_references_and_bound_methods_with_their_object():
    items = [1, 2]
    payload, tensors, _ = encode_payload((torch.add, math.sqrt, items.append), 0)
    op, sqrt, append = decode_payload(payload, tensors)
    assert op is torch.add and sqrt is math.sqrt
    cached = payload_module._function_bytes
    assert torch.add in cached and math.sqrt in cached
    # A method bound to an object is pickled with that object's state each time.
    assert items.append not in cached
    append(3)
    assert append.__self__ == [1, 2, 3] and items == [1, 2]


# A CUDA IPC export as torch writes it: (device, memory handle, size, offset, counter
# handle, counter offset, event handle, event recorded), then the tensor's storage offset.
_SHARE = (0, b"h" * 64, 4096, 0, b"/torch_1_2", 3, b"e" * 64, True)
_GPU_LIMITS = frames.FrameLimits(1 << 30, frozenset({"cpu", "cuda", "cuda:0"}))


def _ipc_frame(inline, device: str = "cuda:0") -> bytes:
    meta = (tensor_bytes.DTYPE_CODES[torch.float32], (3,), 12, inline, device)
    return frames.Frame(frames.Kind.REQUEST, 1, b"", (meta,)).dumps()


def test_a_well_formed_cuda_ipc_export_decodes():
    frame = frames.decode_frame(_ipc_frame(("cuda-ipc", _SHARE, 0)), _GPU_LIMITS)
    assert frame.metas[0][3] == ("cuda-ipc", _SHARE, 0)


@pytest.mark.parametrize(
    "inline, device, says",
    [
        (("cuda-ipc", _SHARE, 0), "cpu", "CUDA IPC export mapped to the CPU"),
        (("cuda-ipc", _SHARE[:7], 0), "cuda:0", "not torch's 8-field export"),
        (("cuda-ipc", (*_SHARE[:1], "h", *_SHARE[2:]), 0), "cuda:0", "wrong types"),
        (("cuda-ipc", _SHARE, -1), "cuda:0", "negative device or offset"),
        (("other", _SHARE, 0), "cuda:0", "neither bytes nor an IPC export"),
        (("cuda-ipc", _SHARE, 0), "cuda:7", "which this worker lacks"),
    ],
)
def test_a_malformed_cuda_ipc_export_is_refused_saying_why(inline, device, says):
    with pytest.raises(frames.MalformedFrame, match=re.escape(says)):
        frames.decode_frame(_ipc_frame(inline, device), _GPU_LIMITS)
