"""The sparse reduce-scatter path (aggregation: sparse_reduce_scatter): the communicators'
alltoall, the regions, one bucket's algorithm (exchange/reduce_scatter.py) and the exchange with
it, across real processes (horovodrun -np 2/3/4 over MPI, -np 3 over Gloo, torchrun -np 4)
against one-process references: tests/mp/reduce_scatter_exchange.py."""
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from launch import REPO, run_script, run_torch_script, start, summary, train
from launch import finish as finish_job

from redsync_hvd import checkpoint
from redsync_hvd.comm import LocalCommunicator
from redsync_hvd.exchange.regions import Regions
from redsync_hvd.exchange.scatter_wire import ChunkFormat


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


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), size=st.integers(1, 16))
def test_a_position_and_its_place_in_the_owners_region_map_both_ways(n, size):
    """Coded positions travel as places in the owner's region: [0, its size), and back."""
    regions, p = Regions.of(n, size), torch.arange(n)
    owners, places = regions.owners(p), regions.local(p)
    for o, size_o in enumerate(regions.sizes()):
        mine = owners == o
        assert int(mine.sum()) == size_o and bool((places[mine] < size_o).all() and (places[mine] >= 0).all())
        assert torch.equal(regions.position(places[mine], o), p[mine])


@settings(max_examples=60, deadline=None)
@given(data=st.data(), golomb=st.booleans(), value=st.sampled_from(["fp32", "fp16", "int8", "sign_mean"]))
def test_a_chunk_unpacks_to_what_was_packed(data, golomb, value):
    """scatter_wire's chunk: counts, positions (int32 or Golomb) and values (fp32, fp16, int8 with
    a scale per layer, or one mean per layer) come back as packed; its length is a multiple of 8."""
    numels = data.draw(st.lists(st.integers(1, 300), min_size=1, max_size=4))
    fmt = ChunkFormat(tuple(numels), {"fp16": torch.float16, "int8": torch.int8}.get(value, torch.float32),
                      golomb, value == "sign_mean")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    positions = [torch.sort(torch.randperm(n, generator=gen)[:data.draw(st.integers(0, n))]).values for n in numels]
    values = [torch.randn(p.numel(), generator=gen) * 10 for p in positions]
    counts = [p.numel() for p in positions]
    per_layer = wire = None
    if value == "sign_mean":
        per_layer = torch.randn(len(numels), generator=gen)
        worth = torch.cat([per_layer[l].expand(c) for l, c in enumerate(counts)])
    else:
        wire, per_layer, worth = fmt.quantize(values)
    chunk = fmt.pack(counts, torch.cat(positions), wire, per_layer)
    lid, got_pos, got_val = fmt.unpack(chunk)
    assert chunk.numel() % 8 == 0 and lid.tolist() == [l for l, c in enumerate(counts) for _ in range(c)]
    assert torch.equal(got_pos, torch.cat(positions)) and torch.equal(got_val, worth)
    if value in ("fp32", "int8"):   # fp32 exact; int8 within half a code of its layer's scale
        bound = torch.cat([torch.full((c,), 0.0 if value == "fp32" else 0.5001 * float(s))
                           for c, s in zip(counts, per_layer if value == "int8" else [0.0] * len(counts))])
        assert bool(((torch.cat(values) - worth).abs() <= bound).all())


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


def test_reduce_scatter_exchange_under_torchrun():
    out = run_torch_script("reduce_scatter_exchange.py", "torch", nproc=4, timeout=400).stdout
    assert out.count("OK reduce-scatter exchange torch of 4") == 4, out


def test_yaml_run_takes_the_path_auto_picks_logs_it_and_resumes_on_fewer_workers(tmp_path):
    """horovodrun -np 3: top-k with ``aggregation: auto`` on a 10 Mbit/s network and a compressed
    layer's cost (given, not probed: the same choice at any load) takes the reduce-scatter for its
    bucket and says so in layers.log; its checkpoints (residuals that the reduce-scatter returned
    entries to) resume on 2 workers with the resize rule ``sum``, which conserves the residuals as
    for the allgather."""
    common = ["compression.aggregation=auto", "compression.policy.latency_s=2.5e-5",
              "compression.policy.bandwidth_gbit=0.01", "compression.policy.compute_s=[1e-4, 1e-9]",
              "training.log_every=5"]
    train(tmp_path, "configs/digits/topk.yaml", *common, "training.steps=20", "output.name=three", np=3,
          timeout=400)
    log = (tmp_path / "three" / "layers.log").read_text()
    compressed = [line for line in log.splitlines() if ": compressed" in line]
    assert compressed and all("aggregation sparse_reduce_scatter (cost model: allgather" in line
                              for line in compressed), log
    decisions = json.loads((tmp_path / "three" / "decisions.json").read_text())
    assert {d.get("aggregation") for d in decisions["layers"] if d["compressed"]} == {"sparse_reduce_scatter"}
    residuals = [checkpoint.load(tmp_path / "three", rank)["optimizer"]["redsync"]["memory"]["residual"]
                 for rank in range(3)]
    owed = sum(float(t.double().abs().sum()) for held in residuals for t in held.values())
    r = train(tmp_path, "configs/digits/topk.yaml", *common, f"training.resume={tmp_path / 'three'}",
              "training.on_resize=sum", "training.steps=30", "output.name=two", np=2, timeout=400)
    s = summary(tmp_path / "two")
    assert s["steps"] == 30 and s["workers"] == 2 and math.isfinite(s["final_loss"]), r.stdout[-3000:]
    resize = s["resumes"][-1]["resize"]
    assert (resize["rule"], resize["old_world_size"], resize["dropped_elements"]) == ("sum", 3, 0), resize
    assert owed > 0.0   # the residuals carried over held something
