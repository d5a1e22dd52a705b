"""The sparse reduce-scatter path (aggregation: sparse_reduce_scatter): the communicators'
alltoall, the regions, one bucket's algorithm (exchange/reduce_scatter.py) and the exchange with
it, across real processes (horovodrun -np 2/3/4 over MPI, -np 3 over Gloo, torchrun -np 3/4)
against one-process references: tests/mp/reduce_scatter_exchange.py."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from launch import REPO, run_script, run_torch_script, start
from launch import finish as finish_job

from redsync_hvd.comm import LocalCommunicator
from redsync_hvd.exchange.reduce_scatter import Regions


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), size=st.integers(1, 64))
def test_regions_are_a_permutation_cut_into_equal_ranges(n, size):
    regions = Regions.of(n, size)
    owners = regions.owners(torch.arange(n))
    assert int(owners.min()) >= 0 and int(owners.max()) < size
    counts = torch.bincount(owners, minlength=size).tolist()
    assert counts == regions.sizes() and sum(counts) == n
    assert max(counts) - min(counts) <= 1
    assert len(torch.unique(torch.arange(n) * regions.multiplier % n)) == n   # a bijection


def test_a_cluster_of_positions_is_spread_over_every_owner():
    """A row of an FC layer (consecutive positions) and a column (stride of the row length)
    land on every owner about equally, where ranges would give all of it to one."""
    rows, cols, size = 1000, 4096, 8
    regions = Regions.of(rows * cols, size)
    row = torch.arange(cols) + 17 * cols
    column = torch.arange(rows) * cols + 5
    for cluster in (row, column):
        counts = torch.bincount(regions.owners(cluster), minlength=size)
        assert counts.max() <= 1.3 * cluster.numel() / size, counts.tolist()


def test_local_communicator_alltoall_returns_every_ranks_rows_for_rank_0():
    comm = LocalCommunicator(3)
    got, splits = comm.wait(comm.alltoall_async(torch.arange(6), [2, 1, 3], name="x"))
    assert got.tolist() == [0, 1] * 3 and splits == [2, 2, 2]
    with pytest.raises(ValueError, match="splits"):
        comm.alltoall_async(torch.arange(6), [2, 4], name="x")


@pytest.mark.parametrize("np", [2, 3, 4])
def test_reduce_scatter_exchange_equals_dense_the_reference_and_conserves_under_horovod(np):
    out = run_script("reduce_scatter_exchange.py", "horovod", np=np, timeout=400).stdout
    assert out.count(f"OK reduce-scatter exchange horovod of {np}") == np, out


def test_reduce_scatter_exchange_under_horovod_over_gloo():
    job = start(["python", str(REPO / "tests" / "mp" / "reduce_scatter_exchange.py"), "horovod"],
                launcher_args=["--gloo", "-np", 3, "-H", "localhost:3"])
    out = finish_job(job, timeout=400).stdout
    assert out.count("OK reduce-scatter exchange horovod of 3") == 3, out


@pytest.mark.parametrize("np", [3, 4])
def test_reduce_scatter_exchange_under_torchrun(np):
    out = run_torch_script("reduce_scatter_exchange.py", "torch", nproc=np, timeout=400).stdout
    assert out.count(f"OK reduce-scatter exchange torch of {np}") == np, out
