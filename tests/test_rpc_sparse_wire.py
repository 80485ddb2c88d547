"""Sparse tensors through the wire format on their own (serial): components, frame, rebuild."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch

from lightning_distgrad._compat import coo_parts
from lightning_distgrad.rpc._calls.payload import decode_payload, encode_payload
from lightning_distgrad.rpc._transport import (
    Frame,
    FrameLimits,
    Kind,
    MalformedFrame,
    sparse,
    tensor_bytes,
)
from lightning_distgrad.rpc._transport.frames import decode_frame
from lightning_distgrad.rpc._transport.tensor_bytes import allocate_tensor, describe_host_tensor

LIMITS = FrameLimits(1 << 30, frozenset({"cpu"}))
INT64 = tensor_bytes.DTYPE_CODES[torch.int64]
FLOAT32 = tensor_bytes.DTYPE_CODES[torch.float32]


def _coo(coalesce: bool = False) -> torch.Tensor:
    # (1, 0) comes before (0, 2) and occurs twice: not coalesced.
    t = torch.sparse_coo_tensor([[1, 0, 1], [0, 2, 0]], [1.5, -2.0, 4.0], (3, 4))
    return t.coalesce() if coalesce else t


def _samples() -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():  # compressed layouts are "beta" in torch
        warnings.simplefilter("ignore")
        dense = torch.tensor([[0.0, 1.0, 0.0, 2.0], [3.0, 0.0, 0.0, 0.0]])
        blocks = torch.arange(16.0).view(4, 4)
        return {
            "coo uncoalesced": _coo(),
            "coo coalesced": _coo(coalesce=True),
            "coo hybrid (dense values)": torch.sparse_coo_tensor(
                [[0, 2]], torch.arange(6.0).view(2, 3), (4, 3)
            ),
            "coo empty": torch.sparse_coo_tensor(torch.zeros(2, 0, dtype=torch.long), [], (5, 5)),
            "coo int64 values": torch.sparse_coo_tensor([[0, 1]], [7, 9], (3,)),
            "csr": dense.to_sparse_csr(),
            "csc": dense.to_sparse_csc(),
            "bsr": blocks.to_sparse_bsr((2, 2)),
            "bsc": blocks.to_sparse_bsc((2, 2)),
        }


def _through_the_wire(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """What the transport does to ``tensors``, minus MPI: components, metas, frame bytes,
    decoding and validation, buffers, rebuilding."""
    flat, _, entries = sparse.flatten(tensors, None)
    metas, buffers = [], []
    for t in flat:
        meta, data = describe_host_tensor(t, inline_limit=0 if len(buffers) % 2 else 1 << 20)
        metas.append(meta)
        buffers.append(data)
    raw = Frame(Kind.REQUEST, 1, b"", (), None, (), entries).dumps(tuple(metas))
    frame = decode_frame(raw, LIMITS)
    received = []
    for meta, data in zip(frame.metas, buffers, strict=True):
        t = allocate_tensor(meta)
        if data is not None:  # the bytes that follow the frame
            t.copy_(data)
        received.append(t)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sparse.unflatten(received, frame.sparse)


@pytest.mark.parametrize("name", sorted(_samples()))
def test_sparse_tensors_arrive_with_their_layout_values_and_coalesced_flag(name):
    sent = _samples()[name]
    before, after = torch.ones(2), torch.arange(3)
    back = _through_the_wire([before, sent, sent, after])
    assert len(back) == 4
    assert torch.equal(back[0], before) and torch.equal(back[3], after)
    for t in back[1:3]:
        assert t.layout == sent.layout and t.shape == sent.shape and t.dtype == sent.dtype
        assert torch.equal(t.to_dense(), sent.to_dense())
        if sent.layout == torch.sparse_coo:
            assert t.is_coalesced() == sent.is_coalesced()
            assert torch.equal(t._indices(), sent._indices())  # order kept, not coalesced


def test_coo_parts_are_the_stored_indices_and_values_of_an_uncoalesced_tensor():
    t = _coo()
    indices, values = coo_parts(t)
    assert not t.is_coalesced()
    assert indices.tolist() == [[1, 0, 1], [0, 2, 0]] and values.tolist() == [1.5, -2.0, 4.0]
    assert torch.equal(torch.sparse_coo_tensor(indices, values, t.shape).to_dense(), t.to_dense())


def test_dense_only_messages_have_an_empty_sparse_table():
    flat, devices, entries = sparse.flatten([torch.ones(2), torch.zeros(1)], ["cpu", "cpu"])
    assert entries == () and len(flat) == 2 and devices == ["cpu", "cpu"]


def test_a_sparse_tensors_components_land_on_its_device():
    flat, devices, entries = sparse.flatten([torch.ones(1), _coo()], ["cuda:1", "cuda:0"])
    assert devices == ["cuda:1", "cuda:0", "cuda:0"] and len(flat) == 3
    assert entries == ((1, "coo", (3, 4), False),)


def test_wire_bytes_of_a_sparse_tensor_are_those_of_its_components():
    t = _coo()
    assert sparse.tensor_nbytes(t) == t._indices().nbytes + t._values().nbytes
    assert sparse.tensor_nbytes(torch.ones(3)) == 12


def test_payload_pickling_puts_sparse_tensors_in_the_tensor_table():
    """The table is what distributed autograd records: a sparse tensor that requires
    grad must be there as itself, not reduced to its (detached) components."""
    t = _coo().requires_grad_()
    param = torch.nn.Parameter(_coo(coalesce=True))
    data, tensors, _ = encode_payload(([t, 3], {"p": param}), dst_id=0)
    assert len(tensors) == 2
    assert tensors[0] is t and tensors[1] is param
    back = decode_payload(data, tensors)
    assert back[0][0] is t and back[0][1] == 3
    assert isinstance(back[1]["p"], torch.nn.Parameter) and back[1]["p"].is_sparse


def _frame_with(entries, metas) -> bytes:
    return pickle.dumps((int(Kind.REQUEST), 1, b"", metas, None, (), entries))


def _meta(dtype_code, shape, itemsize):
    n = itemsize
    for d in shape:
        n *= d
    return (dtype_code, shape, n, bytearray(n), "cpu")


INDICES = _meta(INT64, (2, 3), 8)
VALUES = _meta(FLOAT32, (3,), 4)

BAD_TABLES = {
    "not a tuple": ([(0, "coo", (3, 4), False)], "must be tuples"),
    "entry of 3": (((0, "coo", (3, 4)),), r"not a \(position, layout, size, coalesced\)"),
    "unknown layout": (((0, "mkldnn", (3, 4), None),), "unknown sparse layout"),
    "negative size": (((0, "coo", (-3, 4), False),), "non-negative ints"),
    "flag not a bool": (((0, "coo", (3, 4), "yes"),), "coalesced flag"),
    "positions out of order": (
        ((0, "coo", (3, 4), False), (0, "coo", (3, 4), False)),
        "is not an int above 0",
    ),
    "more components than tensors": (((1, "coo", (3, 4), False),), "more tensors than"),
    "size against indices": (((0, "coo", (3, 4, 5), False),), "does not match"),
}


@pytest.mark.parametrize("case", sorted(BAD_TABLES))
def test_a_malformed_sparse_table_is_refused_saying_what_is_wrong(case):
    entries, says = BAD_TABLES[case]
    with pytest.raises(MalformedFrame, match=says) as info:
        decode_frame(_frame_with(entries, (INDICES, VALUES)), LIMITS)
    assert info.value.frame is not None  # the call can be answered with the reason


def test_indices_of_the_wrong_dtype_or_shape_are_refused():
    float_indices = _meta(FLOAT32, (2, 3), 4)
    with pytest.raises(MalformedFrame, match="2-D int64"):
        decode_frame(_frame_with(((0, "coo", (3, 4), False),), (float_indices, VALUES)), LIMITS)
    four_values = _meta(FLOAT32, (4,), 4)
    with pytest.raises(MalformedFrame, match="do not match 3 indices"):
        decode_frame(_frame_with(((0, "coo", (3, 4), False),), (INDICES, four_values)), LIMITS)


def test_an_index_out_of_range_fails_the_rebuild_instead_of_faulting_later():
    indices = torch.tensor([[0, 7], [1, 1]])
    with pytest.raises(RuntimeError, match="size is inconsistent with indices"):
        sparse.unflatten([indices, torch.ones(2)], ((0, "coo", (3, 4), False),))
    with pytest.raises(RuntimeError, match="coalesced"):  # a false claim is caught too
        sparse.unflatten(
            [torch.tensor([[1, 0], [0, 0]]), torch.ones(2)], ((0, "coo", (3, 4), True),)
        )
