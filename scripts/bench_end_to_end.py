#!/usr/bin/env python
"""End-to-end training speed on an emulated, shaped network (needs root and iproute2).

    sudo .venv/bin/python scripts/bench_end_to_end.py --config configs/bench/quick.yaml

For every network setting of the sweep (hosts, bandwidth, added latency) it builds the
hosts as network namespaces behind a bridge with tc-shaped links
(``redsync_hvd/experiments/netbench/netns.py``), measures what the links carry (TCP goodput, RTT),
and starts one Horovod worker per host (``redsync_hvd/experiments/netbench/launcher.py``). Each worker
(``redsync_hvd/experiments/netbench/worker.py``) trains every model with every method on the same
synthetic data for the same number of steps, methods interleaved over ``rounds``.
Before that, each model's compute time is measured with no communication, by one
process and by N processes at once (the CPU sharing of an N-worker run).

Output, in ``<output_dir>/<name>-<timestamp>/``:

* ``results.csv``: one row per (model, method, network): step time (median of the timed
  steps; mean for SBC), speedup vs dense at the same setting, wire bytes per step and
  per worker, the time split (compute / select / communicate / decompress), the
  compression overhead in % of compute, the cost model's predicted step time and its
  error (``redsync_hvd/experiments/netbench/predict.py``) with three sets of inputs: the link's nominal
  rate and latency with the local work measured in the same launch from the ``<method>/comm`` rows
  (``netbench/report.py:launch_compute``; compute-only compute where the launch lacks them,
  ``compute_source``) (``predicted_step_time_s``), and each part's error; Horovod's
  probed alpha and B (``predicted_calibrated_s``; all three price its fp16 sum, ``half_sum_ns``); those and each
  step's slowest rank's own local work (``predicted_in_run_s``, see ``netbench/report.py:in_run_work``);
* ``models.csv``: parameters, compute time at 1 and N processes and the
  compute/communication ratio of dense fp32 at each setting;
* ``speedup_vs_bandwidth.png``, ``time_breakdown.png``, ``predicted_vs_measured.png``;
* ``results.json`` (everything, per-step times included), ``config.yaml``, worker logs.

Settings with added latency need the kernel's netem qdisc; without it they are
reported as skipped (``status``), not run. The CSV path is printed as the last line.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from redsync_hvd.config import ConfigError, read_yaml
from redsync_hvd.config.compression import DECENTRALIZED, expand_shorthands
from redsync_hvd.experiments.jobs import REPO
from redsync_hvd.experiments.netbench import allocator, netns, worker
from redsync_hvd.experiments.netbench.launcher import LaunchError, launch
from redsync_hvd.experiments.netbench.mpi_launcher import launch_mpi
from redsync_hvd.experiments.netbench.report import (
    MPI,
    MPI_DENSE,
    NO_EXCHANGE,
    NO_EXCHANGE_MPI,
    build_rows,
    markdown,
    no_exchange_runs,
    plots,
    skipped_rows,
)
from redsync_hvd.experiments.tables import write_csv
from redsync_hvd.policy import costmodel as cm

WORKER = "redsync_hvd.experiments.netbench.worker"

COLUMNS = ["model", "method", "launch", "hosts", "bandwidth_mbit", "latency_ms", "step_time_s", "speedup_vs_dense",
           "wire_bytes_per_step", "dense_bytes_per_step", "compression_ratio", "compute_s", "select_s",
           "communicate_s", "decompress_s", "overhead_pct_of_compute", "compute_alone_s", "compute_nproc_s",
           "compute_launch_s", "compute_source", "half_sum_ns",
           "predicted_step_time_s", "prediction_error_pct", "compute_error_pct", "overhead_error_pct",
           "comm_error_pct", "predicted_calibrated_s", "calibrated_error_pct",
           "predicted_in_run_s", "in_run_error_pct", "predicted_overlap_s", "predicted_comm_s",
           "compressed_layers", "goodput_mbit", "rtt_ms", "hvd_alpha_ms", "hvd_bandwidth_mbit", "loadavg_1min",
           "status"]
MODEL_COLUMNS = ["model", "parameters", "dense_mbytes", "hosts", "bandwidth_mbit", "latency_ms", "compute_alone_s",
                 "compute_nproc_s", "dense_allreduce_model_s", "compute_to_comm", "dense_step_measured_s"]
TOP_KEYS = {"name", "output_dir", "steps", "warmup", "rounds", "threads", "timeout_s", "seed", "lr",
            "models", "methods", "networks", "compute_steps", "base_latency_s", "comm_only", "keep_large_allocations",
            "horovod_cycle_time_ms", "pin_workers"}
MODEL_KEYS = {"name", "model", "options", "batch_size", "input_shape", "num_classes", "seq_len", "methods"}
NET_KEYS = {"hosts", "bandwidth_mbit", "latency_ms", "models", "methods"}


class BenchConfigError(ValueError):
    pass


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


# -- configuration ---------------------------------------------------------------------------
def load_config(path: str) -> dict:
    """A sweep config; ``base: other.yaml`` supplies the keys it leaves out (the training
    configs' loader), and a derived config is named after its own file unless it says otherwise."""
    try:
        cfg = read_yaml(Path(path))
        own = yaml.safe_load(Path(path).read_text()) or {}
    except ConfigError as exc:
        raise BenchConfigError(str(exc)) from None
    if "base" in own and "name" not in own:
        cfg.pop("name", None)
    unknown = set(cfg) - TOP_KEYS
    if unknown:
        raise BenchConfigError(f"{path}: unknown keys {sorted(unknown)}; valid: {sorted(TOP_KEYS)}")
    cfg.setdefault("name", Path(path).stem)
    cfg.setdefault("output_dir", "runs/bench")
    cfg.setdefault("steps", 6)
    cfg.setdefault("warmup", 3)
    cfg.setdefault("rounds", 2)
    cfg.setdefault("threads", 1)
    cfg.setdefault("timeout_s", 300)
    cfg.setdefault("seed", 0)
    cfg.setdefault("lr", 0.01)
    cfg.setdefault("compute_steps", 6)
    cfg.setdefault("base_latency_s", None)
    cfg.setdefault("comm_only", [])   # methods also run without forward/backward: "<method>/comm"
    # glibc keeps freed >32 MB blocks for the next step instead of page-faulting them in again
    # (redsync_hvd/experiments/netbench/allocator.py); false measures with glibc's defaults
    cfg.setdefault("keep_large_allocations", True)
    # Horovod's background thread wakes every cycle (HOROVOD_CYCLE_TIME); null keeps Horovod's
    # default. With every worker on one shared 2-core machine its polling takes CPU from the
    # workers' compute, which a real cluster node has spare; a longer cycle gives it back but
    # delays each collective round by up to one cycle. Every method of a sweep runs with it.
    cfg.setdefault("horovod_cycle_time_ms", None)
    c = cfg["horovod_cycle_time_ms"]
    if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or c <= 0):
        raise BenchConfigError(f"{path}: horovod_cycle_time_ms must be a positive number of "
                               f"milliseconds or null (Horovod's default), got {c!r}")
    # one CPU per emulated host (rank i on the i-th allowed CPU, round robin), with its
    # Horovod thread: hosts stop trading cores, as separate machines would not (auto: worker.pinned_launch)
    cfg.setdefault("pin_workers", False)
    for key, ok in (("keep_large_allocations", "true or false"), ("pin_workers", "true, false or auto")):
        if not (isinstance(cfg[key], bool) or (key == "pin_workers" and cfg[key] == "auto")):
            raise BenchConfigError(f"{path}: {key} must be {ok}, got {cfg[key]!r}")
    for m in cfg.get("models") or []:
        bad = set(m) - MODEL_KEYS
        if bad or "name" not in m or "model" not in m:
            raise BenchConfigError(f"models entry {m}: needs name and model; valid keys {sorted(MODEL_KEYS)}")
    for n in cfg.get("networks") or []:
        bad = set(n) - NET_KEYS
        if bad or "hosts" not in n:
            raise BenchConfigError(f"networks entry {n}: needs hosts; valid keys {sorted(NET_KEYS)}")
    if not cfg.get("models") or not cfg.get("methods") or not cfg.get("networks"):
        raise BenchConfigError(f"{path}: needs non-empty models, methods and networks")
    return cfg


def method_config(spec: dict, net: dict, base_latency_s: float | None = None) -> dict:
    """The compression dict of a method at a network setting: a cost-model policy gets the
    shaped network's bandwidth, unless the config fixes it. Its alpha is probed at start
    (Horovod's cost per collective round, what a user's run without ``latency_s`` gets),
    unless the config fixes ``latency_s`` or sets bench key ``base_latency_s``: then
    added latency + base."""
    c = expand_shorthands(dict(spec))
    policy = dict(c.get("policy") or {})
    if policy.get("mode") == "cost_model":
        if policy.get("latency_s") is None and base_latency_s is not None:
            policy["latency_s"] = float(net.get("latency_ms", 0.0)) / 1e3 + float(base_latency_s)
        if policy.get("bandwidth_gbit") is None:
            policy["bandwidth_gbit"] = float(net["bandwidth_mbit"]) / 1e3 if net.get("bandwidth_mbit") else 100.0
        c["policy"] = policy
    return c


def validate_method(comp: dict) -> str | None:
    """None if ``comp`` is a valid compression config, else the reason (it is then skipped)."""
    from redsync_hvd.config import parse_compression
    try:
        parse_compression(comp)
        return None
    except (ValueError, TypeError) as exc:
        return str(exc)


# -- measurements ----------------------------------------------------------------------------
def worker_spec(cfg: dict, model: dict, **extra) -> dict:
    spec = {"model": model["model"], "model_options": model.get("options") or {},
            "batch_size": model.get("batch_size", 16), "steps": cfg["steps"], "warmup": cfg["warmup"],
            "threads": cfg["threads"], "seed": cfg["seed"], "lr": cfg["lr"], "rounds": cfg["rounds"]}
    for k in ("input_shape", "num_classes", "seq_len"):
        if k in model:
            spec[k] = model[k]
    spec.update(extra)
    return spec


def worker_vars(cfg, procs: int = 1) -> dict:
    """Environment of each process of a launch of ``procs``: threads, allocator, cycle, pinning."""
    t = str(cfg["threads"])
    extra = allocator.env(os.environ) if cfg["keep_large_allocations"] else {}
    if cfg["horovod_cycle_time_ms"] is not None:
        extra["HOROVOD_CYCLE_TIME"] = str(cfg["horovod_cycle_time_ms"])
    if worker.pinned_launch(cfg["pin_workers"], procs):
        extra["NETBENCH_PIN_WORKERS"] = "1"
    return {"OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t, **extra}


def measure_compute(cfg: dict, model: dict, procs: int, run_dir: Path) -> dict:
    """Compute-only step time (no Horovod): ``procs`` identical processes at once."""
    spec = worker_spec(cfg, model, mode="compute", steps=cfg["compute_steps"], rounds=1)
    env = {**os.environ, **worker_vars(cfg, procs), "PYTHONPATH": str(REPO)}
    ps, outs = [], []
    for i in range(procs):
        env["NETBENCH_INDEX"] = str(i)   # which CPU with pin_workers, as HOROVOD_RANK in a distributed run
        out = run_dir / f"compute-{model['name']}-p{procs}-{i}.json"
        log = open(run_dir / f"compute-{model['name']}-p{procs}-{i}.log", "w")
        ps.append((subprocess.Popen([sys.executable, "-m", WORKER, "--spec", json.dumps(spec), "--out", str(out)],
                                    cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True),
                   log))
        outs.append(out)
    try:
        for p, log in ps:
            p.wait(timeout=cfg["timeout_s"])
    finally:
        for p, log in ps:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            log.close()
    times = []
    for p_log, out in zip(ps, outs):
        if p_log[0].returncode != 0 or not out.exists():
            raise RuntimeError(f"compute measurement of {model['name']} failed; see {out.with_suffix('.log')}")
        r = json.loads(out.read_text())
        times.append(next(iter(r["runs"].values()))["compute_s"])
        params = next(iter(r["runs"].values()))["parameters"]
    times.sort()
    return {"compute_s": times[len(times) // 2], "all": times, "parameters": params}


def run_setting(cfg, net_cfg, models, methods, run_dir: Path, log) -> tuple[list, dict]:
    """One network setting: build it, probe it, run every model; returns (results, probe)."""
    hosts, bw, lat = int(net_cfg["hosts"]), net_cfg.get("bandwidth_mbit"), float(net_cfg.get("latency_ms", 0.0))
    tag = f"n{hosts}-bw{bw or 'inf'}-lat{lat:g}"
    results = []
    hvd_methods = [(n, c) for n, c in methods if c.get("method") not in DECENTRALIZED]
    dec_methods = [(n, c) for n, c in methods if c.get("method") in DECENTRALIZED]
    probe_bytes = (2 << 20) if (bw or 1e9) < 500 else (32 << 20)
    with netns.ShapedNetwork(hosts=hosts, bandwidth_mbit=bw, latency_ms=lat) as net:
        log(f"[{tag}] network up: {net.describe()}; pinned: {worker.pinned_launch(cfg['pin_workers'], hosts)}")
        from redsync_hvd.experiments.netbench.probe import measure_link
        probe = measure_link(net, nbytes=(8 << 20) if (bw or 1e9) < 500 else (64 << 20)) if hosts > 1 else {}
        log(f"[{tag}] probe: goodput {probe.get('goodput_mbit', 0):.0f} Mbit/s, RTT {probe.get('rtt_ms', 0):.3f} ms")
        for model in models:
            result = _launch_model(cfg, net, model, hvd_methods, tag, run_dir, log, probe_bytes, launch, "")
            if dec_methods:
                # mpi4py's neighbour exchange needs an MPI world: these methods, and dense
                # Horovod as their same-launch baseline ("dense/mpi"), run under mpirun
                mine = [(MPI_DENSE, {"method": "none"})] + dec_methods
                extra = _launch_model(cfg, net, model, mine, tag, run_dir, log, probe_bytes, launch_mpi, "-mpi")
                if extra is not None:
                    for entry in extra["runs"].values():
                        entry.update(network_probe=extra.get("network_probe"), launch=MPI)
                    result = result or {"runs": {}, "size": hosts}
                    result["runs"].update(extra["runs"])
            results.append((model, result))
    return results, probe


def _launch_model(cfg, net, model, methods, tag, run_dir, log, probe_bytes, launcher, suffix):
    """One worker launch for ``model``: every method in ``methods`` (and its "/comm" twin where
    ``comm_only`` names it; "dense/mpi" goes with "dense"), interleaved over rounds. Returns rank 0's
    result, or None after two failed tries."""
    if not methods:
        return None
    runs = [{"label": name, "compression": comp} for name, comp in methods]
    runs += [{"label": f"{name}/comm", "compression": comp, "comm_only": True} for name, comp in methods
             if name.removesuffix("/mpi") in cfg["comm_only"] and int(comp.get("local_steps", 1) or 1) == 1]
    if cfg["comm_only"]:   # the prediction's forward, backward and update (report.launch_compute)
        runs += no_exchange_runs(NO_EXCHANGE_MPI if launcher is launch_mpi else NO_EXCHANGE)
    # Horovod's alpha/B are fitted up to a message of the size that dominates a dense
    # step (the 67 MB FC gradient): the rate of a few-MB allreduce varies between runs of
    # the same link far more than that of the large transfer itself
    spec = worker_spec(cfg, model, runs=runs, probe_network=net.hosts > 1, probe_bytes=probe_bytes)
    out = run_dir / f"result-{model['name']}-{tag}{suffix}.json"
    t0 = time.time()
    for attempt in (1, 2):
        try:
            launcher(net, ["python", "-m", WORKER, "--spec", json.dumps(spec), "--out", str(out)],
                     timeout=cfg["timeout_s"], log_dir=run_dir / f"logs-{model['name']}-{tag}{suffix}-try{attempt}",
                     env=worker_vars(cfg, net.hosts))
            break
        except LaunchError as exc:
            log(f"[{tag}] {model['name']}{suffix}: attempt {attempt} failed: {str(exc)[:1500]}")
            if attempt == 2:
                out = None
    log(f"[{tag}] {model['name']}{suffix}: {len(runs)} methods x {cfg['rounds']} rounds in {time.time() - t0:.0f}s")
    return json.loads(out.read_text()) if out else None


# -- main ------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="YAML sweep, e.g. configs/bench/quick.yaml")
    ap.add_argument("--output-dir", default=None, help="overrides output_dir of the config")
    ap.add_argument("--models", default=None, help="comma-separated subset of the config's model names")
    ap.add_argument("--methods", default=None, help="comma-separated subset of the config's method names")
    ap.add_argument("--networks", default=None, help="comma-separated indices (from 0) into the config's networks")
    a = ap.parse_args(argv)
    try:
        cfg = load_config(a.config)
    except (OSError, BenchConfigError, yaml.YAMLError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    why = netns.missing_prerequisites()
    if why:
        print("error: the end-to-end bench builds an emulated network and needs: " + "; ".join(why), file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)

    if a.networks:
        try:
            cfg["networks"] = [cfg["networks"][int(i)] for i in a.networks.split(",")]
        except (ValueError, IndexError):
            print(f"error: --networks takes indices 0..{len(cfg['networks']) - 1}", file=sys.stderr)
            return 2
    models = [m for m in cfg["models"] if not a.models or m["name"] in a.models.split(",")]
    all_methods = [(n, c) for n, c in cfg["methods"].items() if not a.methods or n in a.methods.split(",")]
    if not models or not all_methods:
        print("error: --models/--methods left nothing to run", file=sys.stderr)
        return 2
    if "dense" not in dict(all_methods):
        print("warning: no 'dense' method: speedup_vs_dense stays empty", file=sys.stderr)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = (REPO / (a.output_dir or cfg["output_dir"]) / f"{cfg['name']}-{stamp}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    logf = open(run_dir / "bench.log", "w")
    t_start = time.time()

    def log(msg):
        line = f"[{time.time() - t_start:6.1f}s] {msg}"
        print(line, file=sys.stderr, flush=True)
        logf.write(line + "\n")
        logf.flush()

    has_netem = None
    rows, raw, compute = [], {"settings": []}, {}
    try:
        log(f"run folder {run_dir}")
        # compute time with no communication: alone, and with N copies sharing the CPU
        counts = sorted({1} | {int(n["hosts"]) for n in cfg["networks"]})
        for model in models:
            compute[model["name"]] = {}
            for procs in counts:
                c = measure_compute(cfg, model, procs, run_dir)
                compute[model["name"]][str(procs)] = c
                log(f"compute {model['name']} ({c['parameters']:,} parameters) with {procs} process(es): "
                    f"{c['compute_s']:.3f}s per step")
        raw["compute"] = compute
        for setting in cfg["networks"]:
            s_models = [m for m in models if not setting.get("models") or m["name"] in setting["models"]]
            s_methods = [(n, c) for n, c in all_methods if not setting.get("methods") or n in setting["methods"]]
            if not s_models or not s_methods:
                continue
            valid = []
            for name, spec in s_methods:
                comp = method_config(spec, setting, cfg["base_latency_s"])
                err = validate_method(comp)
                if err:
                    log(f"method {name} skipped: its config does not validate: {err}")
                    rows += skipped_rows(setting, s_models, [(name, comp)], f"config invalid: {err}")
                else:
                    valid.append((name, comp))
            if float(setting.get("latency_ms", 0.0)) > 0:
                if has_netem is None:
                    has_netem = netns.netem_available()
                if not has_netem:
                    log(f"setting {setting} skipped: added latency needs the netem qdisc, missing in this kernel")
                    rows += skipped_rows(setting, s_models, valid, "netem qdisc unavailable (no added latency)")
                    continue
            results, probe = run_setting(cfg, setting, s_models, valid, run_dir, log)
            for model, result in results:
                new = build_rows(cfg, setting, model, result, valid, probe, compute)
                rows += new
                raw["settings"].append({"setting": setting, "model": model["name"], "probe": probe,
                                        "methods": dict(valid), "result": result})
                for r in new:
                    if r.get("step_time_s"):
                        log(f"  {r['model']:>12} {r['method']:>8} N={r['hosts']} {r['bandwidth_mbit']}M: "
                            f"{r['step_time_s']:.3f}s/step, x{r.get('speedup_vs_dense') or float('nan'):.2f} vs dense, "
                            f"predicted {r['predicted_step_time_s']:.3f}s ({r['prediction_error_pct']:+.0f}%)")
    except KeyboardInterrupt:
        log("interrupted: networks torn down; writing what was measured")
    finally:
        left = netns.list_namespaces(netns.PREFIX + str(os.getpid()))
        if left:
            netns.cleanup(netns.PREFIX + str(os.getpid()))
        # models.csv: compute/communication ratio of dense fp32 at each setting
        mrows = []
        for model in models:
            c = compute.get(model["name"])
            if not c:
                continue
            params = c["1"]["parameters"]
            for setting in cfg["networks"]:
                n, bw, lat = int(setting["hosts"]), setting.get("bandwidth_mbit"), setting.get("latency_ms", 0)
                if not bw or n < 2:
                    continue
                comm = cm.ring_allreduce(n, 4 * params, cm.Network.from_config(lat / 1e3, bw / 1e3))
                measured = next((r for r in rows if r["model"] == model["name"] and r["method"] == "dense" and
                                 r["hosts"] == n and r["bandwidth_mbit"] == bw and r["latency_ms"] == lat
                                 and r.get("step_time_s")), None)
                mrows.append(dict(model=model["name"], parameters=params, dense_mbytes=4 * params / 1e6, hosts=n,
                                  bandwidth_mbit=bw, latency_ms=lat, compute_alone_s=c["1"]["compute_s"],
                                  compute_nproc_s=c.get(str(n), c["1"])["compute_s"], dense_allreduce_model_s=comm,
                                  compute_to_comm=c["1"]["compute_s"] / comm if comm else None,
                                  dense_step_measured_s=measured["step_time_s"] if measured else None))
        write_csv(run_dir / "models.csv", mrows, MODEL_COLUMNS, digits=4)
        csv_path = run_dir / "results.csv"
        write_csv(csv_path, rows, COLUMNS, digits=4)
        (run_dir / "results.json").write_text(json.dumps({"rows": rows, "models": mrows, **raw}, default=str))
        if any(r.get("step_time_s") for r in rows):
            try:
                plots(run_dir, rows)
            except Exception as exc:  # a plot must not lose the measurements
                log(f"plotting failed: {exc}")
        table = markdown(rows)
        (run_dir / "results.md").write_text(table + "\n")
        left = netns.list_namespaces(netns.PREFIX + str(os.getpid()))
        log(f"done in {time.time() - t_start:.0f}s; namespaces left: {left}")
        logf.close()
        print(table)
        print(csv_path)
    return 0 if any(r.get("step_time_s") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
