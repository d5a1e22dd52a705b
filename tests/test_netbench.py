"""Emulated-network bench (redsync_hvd/experiments/netbench): two namespaces, two Horovod workers, teardown.

Needs root and iproute2 (``ip``, ``tc``); skipped cleanly otherwise. The unit part
(cost-model prediction from a run's measured messages, config checks) runs anywhere.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from redsync_hvd import launchers
from redsync_hvd.experiments.netbench import netns
from redsync_hvd.experiments.netbench.predict import plan_from_run, predict, wire_method
from redsync_hvd.experiments.netbench.report import NO_EXCHANGE_COMPRESSION
from redsync_hvd.experiments.netbench.worker import _summarise, pinned_launch, sends_fp16, whole_rounds
from redsync_hvd.policy import costmodel as cm

REPO = Path(__file__).resolve().parent.parent
# every variable a launcher names a rank by (launchers.rank; torchrun's RANK where TORCHELASTIC_RUN_ID
# is set), and the compute-only launch's
RANK_NAMES = (*launchers.RANK_VARS, "RANK", "TORCHELASTIC_RUN_ID", "NETBENCH_INDEX")
WORKER = "redsync_hvd.experiments.netbench.worker"


def _can_build() -> str | None:
    why = netns.missing_prerequisites()
    if why:
        return "; ".join(why)
    try:   # root in a container without CAP_SYS_ADMIN/NET_ADMIN still cannot create namespaces
        p = subprocess.run(["ip", "netns", "add", "rsnbtestcap"], capture_output=True, text=True, timeout=10)
        if p.returncode != 0:
            return f"cannot create a network namespace: {p.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", "rsnbtestcap"], capture_output=True, timeout=10)
    return None


_WHY = _can_build() if shutil.which("ip") else "iproute2 (ip, tc) is not installed"
needs_netns = pytest.mark.skipif(_WHY is not None, reason=f"netbench needs root and iproute2: {_WHY}")


# -- anywhere ------------------------------------------------------------------------------
def test_prediction_uses_measured_message_sizes():
    run = {"compression": {"method": "redsync", "local_steps": 1, "message": {"quantize": "sign_mean"}},
           "select_s": 0.01, "decompress_s": 0.02,
           "layers": [{"name": "fc", "group": "sparse", "wire_bytes": 4 * 1000 + 4, "dense_bytes": 4 * 1_000_000},
                      {"name": "bias", "group": "dense", "wire_bytes": 400, "dense_bytes": 400}],
           "buckets": [["fc"]]}
    plan = plan_from_run(run)
    assert plan[0][2] == "sign_mean" and cm.message_bytes(plan[0][0], plan[0][1], "sign_mean") == 4004
    assert plan[1] == (100, 1.0, "dense")
    net = cm.Network(alpha=1e-4, bandwidth=125e6)
    p = predict(run, 2, net, compute_s=0.5)
    # the bucket is one allgather (payload + its header); the finite flag rides with the dense bias
    wire = cm.ring_allgather(2, 4004 + 8, net) + cm.ring_allreduce(2, 400 + 4, net)
    assert p["predicted_step_time_s"] == pytest.approx(0.5 + 0.03 + wire)
    two = dict(run, layers=run["layers"] + [{"name": "fc2", "group": "sparse", "wire_bytes": 4004,
                                             "dense_bytes": 4 * 1_000_000}])
    one_round = predict(dict(two, buckets=[["fc2", "fc"]]), 2, net, 0.0)["predicted_comm_s"]
    two_rounds = predict(dict(two, buckets=[["fc2"], ["fc"]]), 2, net, 0.0)["predicted_comm_s"]
    assert two_rounds - one_round == pytest.approx(net.alpha)
    dense = {"compression": {"method": "none"}, "layers": [{"name": "w", "group": "dense", "wire_bytes": 4e6,
                                                             "dense_bytes": 4e6}]}
    assert predict(dense, 2, net, 0.0)["predicted_comm_s"] == pytest.approx(cm.ring_allreduce(2, 4e6 + 4, net))
    assert wire_method({"method": "fp16"}) == "dense_fp16" and wire_method({"method": "topk"}) == "pairs"
    # PowerSGD's factors are allreduced in fp32: a compressed layer is priced by the bytes it sent
    psgd = {"compression": {"method": "powersgd", "rank": 2}, "layers": [
        {"name": "w", "group": "sparse", "wire_bytes": 4 * 2 * (1000 + 1000), "dense_bytes": 4e6},
        {"name": "b", "group": "dense", "wire_bytes": 4000, "dense_bytes": 4000}]}
    assert plan_from_run(psgd) == [(4000, 1.0, "dense"), (1000, 1.0, "dense")]


def test_an_fp16_allreduce_is_priced_with_the_sum_its_launch_measured():
    """A dense layer that sent half its fp32 bytes traveled as fp16 (the fp16 method, or a compressed
    method's dense layers under ``policy.dense_values: fp16``); its allreduce is priced with the fp16
    sum its launch's probe measured (``network_probe.half_sum_s``), in the nominal and in-run rows."""
    from redsync_hvd.experiments.netbench.report import build_rows
    layers = [{"name": "w", "group": "sparse", "wire_bytes": 4 * 1000 + 4, "dense_bytes": 4 * 1_000_000},
              {"name": "b", "group": "dense", "wire_bytes": 2000, "dense_bytes": 4000}]
    run = {"compression": {"method": "redsync", "local_steps": 1, "message": {"quantize": "sign_mean"}},
           "layers": layers, "buckets": [["w"]]}
    assert plan_from_run(run)[1] == (1000, 1.0, "dense_fp16")
    assert sends_fp16({"method": "fp16"}) and sends_fp16({"method": "redsync", "policy": {"dense_values": "fp16"}})
    assert not sends_fp16({"method": "none"}) and not sends_fp16(None)   # the launch probes its fp16 sum only then
    assert plan_from_run(dict(run, layers=[dict(layers[1], wire_bytes=4000)]))[0] == (1000, 1.0, "dense")
    n = 4_000_000
    fp16 = {"compression": {"method": "fp16"}, "step_time_s": 1.0, "compute_s": 0.4, "select_s": 0.0,
            "communicate_s": 0.6, "decompress_s": 0.0, "wire_bytes_per_step": 2 * n, "dense_bytes_per_step": 4 * n,
            "statistic": "median", "steps_s": [1.0] * 5, "phases_s": {"communicate": [0.6] * 5},
            "layers": [{"name": "w", "group": "dense", "wire_bytes": 2 * n, "dense_bytes": 4 * n}]}
    probe = {"alpha_s": 1e-4, "bandwidth_Bps": 1.25e8}
    compute = {"m": {"1": {"compute_s": 0.4}, "2": {"compute_s": 0.4}}}

    def comm(half, mbit=1000, link=None):
        result = {"runs": {"fp16": fp16}, "network_probe": {**probe, "half_sum_s": half}}
        row = build_rows({"base_latency_s": 1e-4}, {"hosts": 2, "bandwidth_mbit": mbit}, {"name": "m"}, result,
                         [("fp16", {"method": "fp16"})], link or {}, compute)[0]
        return row["predicted_comm_s"], row["predicted_in_run_s"]
    (nominal0, in_run0), (nominal, in_run) = comm(0.0), comm(25e-9)
    assert nominal - nominal0 == pytest.approx(0.5 * n * 25e-9) and in_run - in_run0 == pytest.approx(0.5 * n * 25e-9)
    # an unshaped link has no tbf rate: it is priced at what TCP measured on it, not as infinitely fast
    assert comm(0.0, None, {"goodput_mbit": 1000})[0] == pytest.approx(nominal0)


def test_the_parts_errors_add_up_to_the_steps_and_name_the_part_that_missed(tmp_path):
    from redsync_hvd.experiments.netbench.report import markdown, part_errors, plots
    run = {"step_time_s": 1.0, "select_s": 0.1, "decompress_s": 0.05, "communicate_s": 0.5}
    # compute measured alone 0.2 where the run spent 0.35 outside its phases; the link priced 0.55
    p = {"predicted_compute_s": 0.2, "predicted_overhead_s": 0.15, "predicted_comm_s": 0.55}
    errs = part_errors(run, p)
    assert errs == pytest.approx({"compute_error_pct": -15.0, "overhead_error_pct": 0.0, "comm_error_pct": 5.0})
    total = 100 * (sum(p.values()) - run["step_time_s"]) / run["step_time_s"]
    assert sum(errs.values()) == pytest.approx(total)
    row = {"model": "m", "method": "redsync", "hosts": 2, "bandwidth_mbit": 1000, "latency_ms": 0.0,
           "speedup_vs_dense": 1.0, **run, "predicted_step_time_s": sum(p.values()), "prediction_error_pct": total,
           **errs}
    assert (tmp_path / "part_errors.png") in plots(tmp_path, [row]) and "| redsync |" in markdown([row])


def test_in_run_work_takes_each_steps_slowest_rank():
    from redsync_hvd.experiments.netbench.report import in_run_work
    # rank 0 is slower in steps 0 and 2, rank 1 in step 1: the per-step maxima are 5, 6, 7
    ranks = [{"steps_s": [9, 8, 9], "phases_s": {"communicate": [4, 4, 2]}},
             {"steps_s": [9, 8, 9], "phases_s": {"communicate": [5, 2, 5]}}]
    assert in_run_work({"per_rank": ranks}) == 6
    assert in_run_work({"per_rank": ranks, "statistic": "mean"}) == pytest.approx(6)
    # older results: the rank with the largest medians
    old = [{"compute_s": 1, "select_s": 0.5, "decompress_s": 0.1}, {"compute_s": 1.2, "select_s": 0.1,
                                                                      "decompress_s": 0.1}]
    assert in_run_work({"per_rank": old}) == pytest.approx(1.6)


def test_the_nominal_compute_is_measured_in_the_launch_where_its_rows_are():
    """Forward and backward from dense's local work less dense's exchange alone, plus the method's
    own exchange alone, less what the run's phases time: every figure from the launch's own rows."""
    from redsync_hvd.experiments.netbench.report import launch_compute

    def local(seconds, select=0.0, decompress=0.0, comm_only=False):
        return {"per_rank": [{"compute_s": seconds - select - decompress, "select_s": select,
                              "decompress_s": decompress}], "select_s": select, "decompress_s": decompress,
                "comm_only": comm_only}
    runs = {"dense": local(0.30), "dense/comm": local(0.05, comm_only=True),
            "redsync": local(0.31, select=0.02, decompress=0.01), "redsync/comm": local(0.07, 0.02, 0.01, True)}
    # 0.30 - 0.05 of forward and backward, 0.07 of RedSync's exchange, 0.03 of it timed by the run's phases
    assert launch_compute(runs, "redsync") == pytest.approx(0.25 + 0.07 - 0.03)
    assert launch_compute(runs, "dense") == pytest.approx(0.30)   # dense's own local work back
    assert launch_compute(runs, "redsync/comm") is None
    assert launch_compute({k: v for k, v in runs.items() if k != "dense/comm"}, "redsync") is None


def test_with_a_run_without_exchanges_the_compute_takes_dense_allreduces_share_by_bytes():
    """Forward and backward from the launch's run without exchanges less its update; dense's local
    work beyond that and its exchange alone is what its allreduce takes from the cores, charged to
    every method by its bytes on the wire: dense still gets its own local work back."""
    from redsync_hvd.experiments.netbench.report import (
        MPI,
        MPI_DENSE,
        NO_EXCHANGE,
        NO_EXCHANGE_MPI,
        in_run_work,
        launch_compute,
        parts_table,
    )

    def local(seconds, select=0.0, decompress=0.0, comm_only=False, wire=0):
        return {"per_rank": [{"compute_s": seconds - select - decompress, "select_s": select,
                              "decompress_s": decompress}], "select_s": select, "decompress_s": decompress,
                "comm_only": comm_only, "wire_bytes_per_step": wire}
    runs = {"dense": local(0.30, wire=1000), "dense/comm": local(0.05, comm_only=True, wire=1000),
            "redsync": local(0.25, 0.02, 0.01, wire=10), "redsync/comm": local(0.07, 0.02, 0.01, True, 10),
            NO_EXCHANGE: local(0.20), f"{NO_EXCHANGE}/comm": local(0.03, comm_only=True)}
    # forward and backward 0.20 - 0.03; dense's allreduce takes 0.30 - 0.17 - 0.05 = 0.08 for 1000 bytes
    assert launch_compute(runs, "redsync") == pytest.approx(0.17 + (0.07 - 0.03) + 0.08 * 10 / 1000)
    assert launch_compute(runs, "dense") == pytest.approx(0.30)
    assert launch_compute(runs, NO_EXCHANGE) == pytest.approx(0.20)
    assert launch_compute(runs, "redsync", work=lambda r: None) is None   # a row without its local work
    # local steps without an exchange alone (sbc): the no-exchange row's own steps, its update included
    sbc = {**local(0.26, 0.004, 0.001, wire=5), "statistic": "mean"}
    assert launch_compute({**runs, "sbc": sbc}, "sbc") == pytest.approx(0.17 + 0.03 + 0.08 * 5 / 1000)
    row = {k: v for k, v in sbc.items() if k != "statistic"}   # results.csv's form: the status says it
    assert launch_compute({**runs, "sbc": {**row, "status": "ok (mean of 20 steps)"}}, "sbc") == \
        launch_compute({**runs, "sbc": sbc}, "sbc")
    # an exchange every step with no exchange alone: nothing in the launch stands for it
    assert launch_compute({**runs, "topk": {**row, "status": "ok (median of 20 steps)"}}, "topk") is None
    # the mpirun launch beside it (the decentralized methods, dense/mpi): its own rows, never the Gloo launch's
    mpi = {label: {**row, "launch": MPI} for label, row in {
        MPI_DENSE: local(0.40, wire=1000), f"{MPI_DENSE}/comm": local(0.06, comm_only=True, wire=1000),
        "dcd": local(0.33, 0.05, wire=100), "dcd/comm": local(0.09, 0.05, comm_only=True, wire=100),
        NO_EXCHANGE_MPI: local(0.26), f"{NO_EXCHANGE_MPI}/comm": local(0.04, comm_only=True)}.items()}
    both = {**runs, **mpi}
    # forward and backward 0.26 - 0.04; dense/mpi's allreduce takes 0.40 - 0.22 - 0.06 = 0.12 for 1000 bytes
    assert launch_compute(both, "dcd") == pytest.approx(0.22 + (0.09 - 0.05) + 0.12 * 100 / 1000)
    assert launch_compute(both, MPI_DENSE) == pytest.approx(0.40)
    assert launch_compute(both, "redsync") == launch_compute(runs, "redsync")
    assert launch_compute({**runs, "dcd": mpi["dcd"]}, "dcd") is None   # no mpirun rows: compute alone stands in
    # part_errors.py's table: one line per launch (results file, model, hosts, Mbit/s, latency, launch)
    lines = parts_table({("r.csv", "m", 2, None, 0.0): both, ("r.csv", "m", 4, None, 0.0): {}}, in_run_work)
    assert lines[2:] == ["| r.csv | m | 2 | unshaped | 0.0 | gloo | 0.1700 | 0.0300 | 0.0500 | 0.0800 |",
                         "| r.csv | m | 2 | unshaped | 0.0 | mpi | 0.2200 | 0.0400 | 0.0600 | 0.1200 |"]


def test_bench_configs_validate():
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_end_to_end as bench
    for name in ("quick.yaml", "full.yaml", "costmodel.yaml", "quick-horovod-cycle.yaml", "decentralized.yaml",
                 "fast.yaml"):
        cfg = bench.load_config(str(REPO / "configs" / "bench" / name))
        for setting in cfg["networks"]:
            for method, spec in cfg["methods"].items():
                comp = bench.method_config(spec, setting)
                policy = comp.get("policy") or {}
                if policy.get("mode") == "cost_model":
                    bw = setting["bandwidth_mbit"]   # an unshaped link is given as 100 Gbit/s
                    assert policy["bandwidth_gbit"] == pytest.approx(bw / 1e3 if bw else 100.0)
                    # alpha is left to the start-up probe (Horovod's real cost per round)...
                    assert policy.get("latency_s") is None
                    # ...unless the bench config gives a base latency
                    fixed = bench.method_config(spec, setting, 1e-4)["policy"]
                    assert fixed["latency_s"] == pytest.approx(setting.get("latency_ms", 0) / 1e3 + 1e-4)
                assert bench.validate_method(comp) is None, (name, method)


def test_bench_config_with_a_base_takes_the_base_keys_it_leaves_out(tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_end_to_end as bench
    derived = bench.load_config(str(REPO / "configs" / "bench" / "quick-horovod-cycle.yaml"))
    quick = bench.load_config(str(REPO / "configs" / "bench" / "quick.yaml"))
    assert derived["horovod_cycle_time_ms"] is None and quick["horovod_cycle_time_ms"] == 5
    assert derived["name"] == "quick-horovod-cycle" and derived["models"] == quick["models"]
    loop = tmp_path / "a.yaml"
    loop.write_text("base: a.yaml\n")
    with pytest.raises(bench.BenchConfigError, match="loops back"):
        bench.load_config(str(loop))
    missing = tmp_path / "b.yaml"
    missing.write_text("base: nowhere.yaml\n")
    with pytest.raises(bench.BenchConfigError, match="nowhere.yaml"):
        bench.load_config(str(missing))


def test_unknown_bench_key_is_refused(tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_end_to_end as bench
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nstepz: 3\nmodels: []\nmethods: {}\nnetworks: []\n")
    with pytest.raises(bench.BenchConfigError, match="stepz"):
        bench.load_config(str(bad))


def test_allocator_and_cycle_time_reach_the_worker_environment(tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_end_to_end as bench

    from redsync_hvd.experiments.netbench import allocator
    base = "name: x\nmodels: [{name: m, model: mlp}]\nmethods: {dense: {method: none}}\nnetworks: [{hosts: 2}]\n"
    path = tmp_path / "ok.yaml"
    path.write_text(base + "horovod_cycle_time_ms: 20\n")
    env = bench.worker_vars(bench.load_config(str(path)))
    assert env["HOROVOD_CYCLE_TIME"] == "20" and allocator.TUNABLES in env["GLIBC_TUNABLES"]
    path.write_text(base + "keep_large_allocations: false\n")
    env = bench.worker_vars(bench.load_config(str(path)))
    assert "HOROVOD_CYCLE_TIME" not in env and allocator.TUNABLES not in env.get("GLIBC_TUNABLES", "")
    path.write_text(base + "pin_workers: true\n")
    assert bench.worker_vars(bench.load_config(str(path)))["NETBENCH_PIN_WORKERS"] == "1"
    path.write_text(base + "pin_workers: auto\n")
    cfg, cpus = bench.load_config(str(path)), len(os.sched_getaffinity(0))
    assert "NETBENCH_PIN_WORKERS" not in bench.worker_vars(cfg, cpus)
    assert bench.worker_vars(cfg, cpus + 1)["NETBENCH_PIN_WORKERS"] == "1"
    for bad, key in (("horovod_cycle_time_ms: -1", "horovod_cycle_time_ms"),
                     ("keep_large_allocations: maybe", "keep_large_allocations"),
                     ("pin_workers: 1", "pin_workers"), ("pin_workers: always", "pin_workers")):
        path.write_text(base + bad + "\n")
        with pytest.raises(bench.BenchConfigError, match=key):
            bench.load_config(str(path))
    assert allocator.env({"GLIBC_TUNABLES": "glibc.a=1"})["GLIBC_TUNABLES"] == "glibc.a=1:" + allocator.TUNABLES


def test_auto_pins_a_launch_only_where_its_processes_outnumber_the_cpus():
    decide = pinned_launch
    assert [decide("auto", procs, cpus=2) for procs in (1, 2, 3, 4)] == [False, False, True, True]
    assert [decide("auto", 4, cpus=cpus) for cpus in (2, 4, 8)] == [True, False, False]
    assert decide(True, 1, cpus=2) and not decide(False, 8, cpus=2)


def test_pinned_worker_runs_on_its_ranks_cpu():
    """pin_workers: rank r runs on the (r mod #CPUs)-th allowed CPU, and so do the threads
    torch starts afterwards. In a child process: pinning pytest itself would skew the suite."""
    allowed = sorted(os.sched_getaffinity(0))
    code = ("import os\nfrom redsync_hvd.experiments.netbench.worker import pin_to_cpu\ncpu = pin_to_cpu()\n"
            "import torch\ntorch.set_num_threads(2)\ntorch.ones(1 << 20).sum()\n"
            "tids = os.listdir('/proc/self/task')\n"
            "print(cpu, sorted({c for t in tids for c in os.sched_getaffinity(int(t))}))")
    # horovodrun's rank, mpirun's (the MPI launch: no HOROVOD_RANK there), the compute-only launch's
    for rank, var in ((0, "HOROVOD_RANK"), (1, "HOROVOD_RANK"), (2, "HOROVOD_RANK"),
                      (1, "OMPI_COMM_WORLD_RANK"), (3, "OMPI_COMM_WORLD_RANK"), (1, "NETBENCH_INDEX")):
        base = {k: v for k, v in os.environ.items() if k not in RANK_NAMES}
        env = {**base, "PYTHONPATH": str(REPO), "NETBENCH_PIN_WORKERS": "1", var: str(rank)}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        want = allowed[rank % len(allowed)]
        assert out.stdout.strip().split(maxsplit=1) == [str(want), f"[{want}]"], var
    env = {k: v for k, v in os.environ.items() if k != "NETBENCH_PIN_WORKERS"}
    out = subprocess.run([sys.executable, "-c", f"from {WORKER} import pin_to_cpu; print(pin_to_cpu())"],
                         env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "None"


def test_kept_allocations_stop_page_faulting_a_large_buffer_anew():
    """mallopt really changes glibc's behaviour: freed 64 MB blocks are reused, so allocating
    and touching one again costs (almost) no new page faults, where a fresh mmap faults it all in."""
    import resource
    import subprocess
    code = ("import resource, sys\n"
            "from redsync_hvd.experiments.netbench import allocator\n"
            "if sys.argv[1] == 'keep': assert allocator.apply_in_process()\n"
            "import torch\n"
            "for _ in range(20): torch.ones(16 << 20)   # the heap settles into reusing its blocks\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "for _ in range(5): torch.ones(16 << 20)\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n")
    faults = {}
    for mode in ("keep", "default"):
        out = subprocess.run([sys.executable, "-c", code, mode], cwd=REPO, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO), "GLIBC_TUNABLES": ""}, timeout=120)
        assert out.returncode == 0, out.stderr
        faults[mode] = int(out.stdout.split()[-1])
    pages = 5 * (64 << 20) // resource.getpagesize()
    assert faults["default"] > pages // 2 and faults["keep"] < pages // 20, faults


# -- root + iproute2 -----------------------------------------------------------------------
@needs_netns
def test_two_namespaces_two_workers_then_nothing_left(tmp_path):
    from redsync_hvd.experiments.netbench.launcher import launch
    net = netns.ShapedNetwork(hosts=2, bandwidth_mbit=1000, latency_ms=0)
    prefix = net.prefix
    out = tmp_path / "result.json"
    spec = {"model": "mlp", "input_shape": [64], "batch_size": 32, "steps": 3, "warmup": 1, "threads": 1,
            "runs": [{"label": "dense", "compression": {"method": "none"}},
                     {"label": "topk", "compression": {"method": "topk", "density": 0.05}},
                     {"label": "fp16", "compression": {"method": "fp16"}}],
            "probe_network": True, "probe_bytes": 1 << 16}
    try:
        with net:
            names = netns.list_namespaces(prefix)
            assert len(names) == 3 and f"{prefix}-sw" in names
            qd = net.qdiscs()
            assert qd.count("tbf") == 4, qd        # both directions of both links shaped
            launch(net, ["python", "-m", WORKER, "--spec", json.dumps(spec), "--out", str(out)],
                   timeout=50, log_dir=tmp_path / "logs", env={"OMP_NUM_THREADS": "1"})
    finally:
        left = netns.list_namespaces(prefix)
        netns.cleanup(prefix)
    assert left == [], f"namespaces left behind: {left}"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in listed
    assert not os.path.exists(f"/etc/netns/{prefix}-h0")
    result = json.loads(out.read_text())
    assert result["size"] == 2
    dense, topk = result["runs"]["dense"], result["runs"]["topk"]
    assert len(dense["steps_s"]) == 3 and dense["step_time_s"] > 0
    assert dense["wire_bytes_per_step"] > 0
    assert topk["wire_bytes_per_step"] < dense["wire_bytes_per_step"]
    # both ranks took part, each in its own namespace, through the shaped eth0
    assert [p["rank"] for p in dense["per_rank"]] == [0, 1]
    assert result["horovod_env"]["HOROVOD_GLOO_IFACE"] == "eth0"
    # the probe ran through Horovod on both ranks: alpha, B, and (an fp16 run is in the launch) the fp16 sum
    probe = result["network_probe"]
    assert probe["bandwidth_Bps"] > 0 and probe["alpha_s"] >= 0 and 0 <= probe["half_sum_s"] < 1e-6
    assert result["runs"]["fp16"]["wire_bytes_per_step"] < 0.51 * dense["wire_bytes_per_step"]   # and a 4-byte flag


@needs_netns
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun (openmpi-bin) is not installed")
def test_mpi_launch_runs_dcd_across_namespaces_then_nothing_left(tmp_path):
    """DCD's mpi4py neighbour exchange, one MPI rank per namespace, over the shaped links."""
    from redsync_hvd.experiments.netbench.mpi_launcher import launch_mpi
    net = netns.ShapedNetwork(hosts=2, bandwidth_mbit=1000, latency_ms=0)
    prefix = net.prefix
    out = tmp_path / "result.json"
    spec = {"model": "mlp", "input_shape": [64], "batch_size": 32, "steps": 3, "warmup": 1, "threads": 1,
            "runs": [{"label": "dense/mpi", "compression": {"method": "none"}},
                     {"label": "dcd", "compression": {"method": "dcd", "quantizer": "minmax", "bits": 8}}]}
    try:
        with net:
            launch_mpi(net, ["python", "-m", WORKER, "--spec", json.dumps(spec), "--out", str(out)],
                       timeout=90, log_dir=tmp_path / "logs", env={"OMP_NUM_THREADS": "1"})
            pids = [subprocess.run(["ip", "netns", "pids", net.host_ns(i)], capture_output=True, text=True).stdout
                    for i in range(2)]
    finally:
        left = netns.list_namespaces(prefix)
        netns.cleanup(prefix)
    assert left == [] and pids == ["", ""], (left, pids)
    result = json.loads(out.read_text())
    assert result["size"] == 2 and "HOROVOD_GLOO_IFACE" not in result["horovod_env"]   # MPI, not Gloo
    dense, dcd = result["runs"]["dense/mpi"], result["runs"]["dcd"]
    assert [p["rank"] for p in dcd["per_rank"]] == [0, 1]
    # 8-bit DCD sends about a quarter of fp32 to its one neighbour, and times its exchange
    assert 0.2 < dcd["wire_bytes_per_step"] / dense["wire_bytes_per_step"] < 0.35
    assert dcd["communicate_s"] > 0 and dcd["select_s"] > 0
    log = (tmp_path / "logs" / "mpirun.log").read_text()
    assert "btl tcp,self" in log     # no shared-memory transport between the "hosts"


@needs_netns
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun (openmpi-bin) is not installed")
def test_mpi_allreduce_probe_goes_over_the_shaped_links_and_counts_them(capsys):
    """``netbench mpi-allreduce``: MPI's allreduce alone, one rank per namespace. Its bytes go over
    the hosts' TCP (counted there), so no allreduce beats the ring at the shaped rate."""
    from redsync_hvd.experiments.netbench.__main__ import main
    assert main(["mpi-allreduce", "--bandwidth-mbit", "200", "--mb", "4", "--repeats", "2",
                 "--mca", "coll_tuned_use_dynamic_rules=1", "--mca", "coll_tuned_allreduce_algorithm=3"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bytes"] == 4_000_000 and result["mca"]["coll_tuned_allreduce_algorithm"] == "3"
    assert result["ring_at_link_rate_s"] == pytest.approx(4e6 / 25e6)
    assert len(result["times_s"]) == 2 and min(result["times_s"]) > 0.9 * result["ring_at_link_rate_s"]
    assert result["TcpOutSegs"] > 2 * 4e6 / 65536 and result["dropped"] >= 0
    assert main(["mpi-allreduce", "--mca", "no_value"]) == 2   # K=V or a clear refusal


@pytest.mark.parametrize("warmup, steps, every, expected", [
    (3, 10, 1, (3, 10)),          # an exchange every step: as given
    (3, 10, 8, (8, 16)),          # local steps: the first exchange in the warm-up, two whole rounds timed
    (3, 10, 5, (5, 10)),          # sbc's 5: already whole rounds once the warm-up ends on an exchange
    (0, 8, 8, (8, 8)),            # no warm-up asked: still one round, so the first exchange is not timed
    (0, 4, 8, (0, 4)),            # a window that never reaches an exchange: as given
    (3, 10, 10**9, (3, 10)),      # no-exchange: the exchange never comes, nothing to round
])
def test_a_method_with_local_steps_is_timed_over_whole_rounds_after_its_first_exchange(warmup, steps, every, expected):
    assert whole_rounds(warmup, steps, every) == expected


@pytest.mark.parametrize("compression, statistic", [
    ({"method": "redsync"}, "mean"),           # auto: 8 local steps, exchanges in the window: a round's mean
    ({"method": "none"}, "median"),            # every step
    (NO_EXCHANGE_COMPRESSION, "median"),       # a round that never ends in the window: no exchange to average in
])
def test_the_step_statistic_is_the_mean_only_for_rounds_that_end_in_the_window(compression, statistic):
    steps = [0.15] * 15 + [5.7]   # one descheduled step, as 4 ranks on 2 cores give
    part = {"steps": steps, "wire": [0.0] * 16, "select": [0.0] * 16, "communicate": [0.0] * 16,
            "decompress": [0.0] * 16, "parameters": 10, "final_loss": 0.0}
    row = _summarise("x", compression, [part], 0, 2, window=24)
    assert row["statistic"] == statistic
    assert row["step_time_s"] == pytest.approx(0.15 if statistic == "median" else sum(steps) / 16)
