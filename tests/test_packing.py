"""comm/packing.py: a capacity row (header and payload in one bounded row, torch.distributed's
one-round allgather) holds pack()'s bytes, and cuts back to what each rank sent."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from redsync_hvd.comm.packing import pack, pack_row, payload_bytes, unpack_rows

DTYPES = [torch.int32, torch.float32, torch.float16, torch.int8, torch.uint8, torch.int64, torch.float64]


def message(dtypes, counts, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * 100).to(d) for n, d in zip(counts, dtypes)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(DTYPES), min_size=1, max_size=8).flatmap(
    lambda dts: st.tuples(st.just(dts), st.lists(st.lists(st.integers(0, 9), min_size=len(dts), max_size=len(dts)),
                                                 min_size=1, max_size=3))))
def test_a_capacity_row_holds_packs_bytes_and_cuts_back_per_rank(case):
    """Each rank's row: its int32 counts, then pack()'s payload byte for byte, then zeros up to the
    capacity; unpack_rows gives every rank's tensors back (dtypes whose offsets do not suit their
    alignment included: int64 and float64 after an odd number of counts)."""
    dtypes, per_rank = case
    width, most = 4 * len(dtypes), payload_bytes([9] * len(dtypes), dtypes)
    sent = [message(dtypes, counts, r) for r, counts in enumerate(per_rank)]
    rows = torch.zeros(len(per_rank), width + most, dtype=torch.uint8)
    for r, (counts, tensors) in enumerate(zip(per_rank, sent)):
        pack_row(rows[r], counts, tensors)
        payload = pack(tensors, "cpu")[1]
        assert rows[r, :width].view(torch.int32).tolist() == counts
        assert torch.equal(rows[r, width:width + payload.numel()], payload)
        assert not rows[r, width + payload.numel():].any()
    got = unpack_rows(rows, width, per_rank, dtypes)
    assert [[(t.dtype, t.tolist()) for t in ts] for ts in got] == [[(t.dtype, t.tolist()) for t in ts] for ts in sent]


def test_rows_that_describe_more_than_they_hold_are_refused():
    rows = torch.zeros(2, 4 + 8, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="rank 1's message sizes .* ranks disagree on the bucket layout"):
        unpack_rows(rows, 4, [[2], [3]], [torch.float32])
