"""The bench's results: one row per (model, method, network) with the cost model's
predictions, the CSV and markdown tables, and the plots (``bench_end_to_end.py``)."""
from __future__ import annotations

import statistics
from pathlib import Path

from redsync_hvd.config.compression import DECENTRALIZED
from redsync_hvd.policy import costmodel as cm

from ..tables import markdown as markdown_table
from ..tables import short
from .predict import fusion_bytes, plan_from_run, predict
from .predict import network as cm_network

MPI_DENSE = "dense/mpi"   # dense Horovod, launched with the decentralized methods under mpirun
# forward, backward and the update in the launch, with no exchange: local steps whose round never ends
NO_EXCHANGE = "no-exchange"
NO_EXCHANGE_MPI = "no-exchange/mpi"   # the same in the mpirun launch
NO_EXCHANGE_COMPRESSION = {"method": "redsync", "local_steps": 10 ** 9}
MPI = "mpi"   # a result entry's (and a results.csv row's) ``launch`` where it ran under mpirun


def no_exchange_runs(label: str = NO_EXCHANGE) -> list:
    """The launch's runs that give ``launch_compute`` its forward, backward and update."""
    return [{"label": label, "compression": NO_EXCHANGE_COMPRESSION},
            {"label": f"{label}/comm", "compression": NO_EXCHANGE_COMPRESSION, "comm_only": True}]


def launch_rows(run: dict) -> tuple:
    """(dense's label, the no-exchange row's label) in the launch that ran ``run``: the mpirun
    launch's (the decentralized methods) or the Gloo launch's."""
    return (MPI_DENSE, NO_EXCHANGE_MPI) if run.get("launch") == MPI else ("dense", NO_EXCHANGE)


def build_rows(cfg, setting, model, result, methods, probe, compute) -> list[dict]:
    hosts, bw, lat = int(setting["hosts"]), setting.get("bandwidth_mbit"), float(setting.get("latency_ms", 0.0))
    base = dict(model=model["name"], hosts=hosts, bandwidth_mbit=bw, latency_ms=lat,
                goodput_mbit=probe.get("goodput_mbit"), rtt_ms=probe.get("rtt_ms"))
    rows = []
    if result is None:
        return [dict(base, method=name, status="failed") for name, _ in methods]
    alpha0 = cfg["base_latency_s"] if cfg["base_latency_s"] is not None else (probe.get("rtt_ms", 0.0) / 2e3)
    fusion = fusion_bytes(result.get("horovod_env"))
    labels = [name for name, _ in methods] + [k for k in result["runs"] if k.endswith("/comm") or
                                               k in (MPI_DENSE, NO_EXCHANGE, NO_EXCHANGE_MPI)]
    for name in labels:
        r = result["runs"].get(name)
        if r is None:
            rows.append(dict(base, method=name, status="missing"))
            continue
        # Horovod's alpha/B as this launch saw them (costmodel.probe_network); MPI launches have their own
        hp = r.get("network_probe") or result.get("network_probe")
        half = (hp or {}).get("half_sum_s", 0.0)   # what this launch's fp16 allreduces add: its CPU's sum
        # nominal: the tbf rate (an unshaped link has none: what TCP measured on it), added + base latency
        net = cm_network(bw, lat, alpha0, None if bw else probe.get("goodput_mbit"), half)
        net_hvd = cm.Network(hp["alpha_s"], hp["bandwidth_Bps"], half) if hp else None
        r = {**r, "horovod_env": result.get("horovod_env")}
        if r.get("comm_only"):   # no forward/backward: the exchange and the update only
            c_n = c_alone = 0.0
        else:
            c_alone = compute[model["name"]]["1"]["compute_s"]
            c_n = compute[model["name"]].get(str(hosts), compute[model["name"]]["1"])["compute_s"]
        c_launch = launch_compute(result["runs"], name)
        p = predict(r, hosts, net, c_n if c_launch is None else c_launch, fusion)
        row = dict(
            base, method=name, launch=r.get("launch", "gloo"), step_time_s=r["step_time_s"],
            wire_bytes_per_step=r["wire_bytes_per_step"],
            dense_bytes_per_step=r["dense_bytes_per_step"], compression_ratio=r.get("compression_ratio"),
            compute_s=r["compute_s"], select_s=r["select_s"], communicate_s=r["communicate_s"],
            decompress_s=r["decompress_s"],
            overhead_pct_of_compute=100 * (r["select_s"] + r["decompress_s"]) / r["compute_s"]
            if r["compute_s"] > 0 else None,
            compute_alone_s=c_alone, compute_nproc_s=c_n, compute_launch_s=c_launch,
            compute_source="alone" if c_launch is None else "launch", half_sum_ns=half * 1e9,
            predicted_step_time_s=p["predicted_step_time_s"],
            prediction_error_pct=_err(p["predicted_step_time_s"], r["step_time_s"]),
            predicted_overlap_s=p["predicted_overlap_s"], predicted_comm_s=p["predicted_comm_s"],
            compressed_layers=sum(1 for _, _, m in plan_from_run(r) if not m.startswith("dense")),
            **part_errors(r, p),
            loadavg_1min=(result.get("loadavg") or [None])[0],
            status=f"ok ({r['statistic']} of {len(r['steps_s'])} steps)")
        if net_hvd is not None:
            pc = predict(r, hosts, net_hvd, c_n, fusion)
            row.update(hvd_alpha_ms=hp["alpha_s"] * 1e3, hvd_bandwidth_mbit=hp["bandwidth_Bps"] * 8 / 1e6,
                       predicted_calibrated_s=pc["predicted_step_time_s"],
                       calibrated_error_pct=_err(pc["predicted_step_time_s"], r["step_time_s"]))
            pr = predict({**r, "select_s": 0.0, "decompress_s": 0.0}, hosts, net_hvd, in_run_work(r), fusion)
            row.update(predicted_in_run_s=pr["predicted_step_time_s"],
                       in_run_error_pct=_err(pr["predicted_step_time_s"], r["step_time_s"]))
        rows.append(row)
    return speedups(rows, methods)


def speedups(rows: list, methods) -> list:
    """Each row's ``speedup_vs_dense`` against dense Horovod in its own launch: the decentralized
    methods ran under mpirun with "dense/mpi", the /comm rows against "dense/comm", the others
    under Gloo with "dense"."""
    by = {row["method"]: row for row in rows}
    mpi_launch = {n for n, c in methods if (c or {}).get("method") in DECENTRALIZED} | {MPI_DENSE, NO_EXCHANGE_MPI}
    for row in rows:
        name = row["method"].removesuffix("/comm")
        dense = MPI_DENSE if name in mpi_launch or row.get("launch") == MPI else "dense"
        base_label = f"{dense}/comm" if row["method"].endswith("/comm") else dense
        dense = by.get(base_label)
        if dense and row.get("step_time_s") and dense.get("step_time_s"):
            row["speedup_vs_dense"] = dense["step_time_s"] / row["step_time_s"]
    return rows


def in_run_work(r: dict) -> float:
    """Seconds per step of local work (compute + select + decompress: all but the waits in
    collectives) of the slowest rank, step by step: a synchronous step cannot end before
    its slowest rank has done its own work, and which rank that is changes from step to
    step on shared cores. The median (the mean for communication delay) over steps, as
    for the measured step time. Older results without per-step lists per rank: the rank
    with the largest medians."""
    ranks = r.get("per_rank") or [r]
    agg = statistics.fmean if r.get("statistic") == "mean" else statistics.median
    if all("steps_s" in x for x in ranks):
        per_step = zip(*[[s - m for s, m in zip(x["steps_s"], x["phases_s"]["communicate"])] for x in ranks])
        return agg(max(w) for w in per_step)
    return max(x["compute_s"] + x["select_s"] + x["decompress_s"] for x in ranks)


def launch_compute(runs: dict, label: str, work=None) -> float | None:
    """The nominal prediction's compute for run ``label``, measured in its own launch: what a step
    does locally beside the timed selection and decoding (priced from the run's own medians), on
    the cores the launch's workers and their Horovod threads share, each step as long as its
    slowest rank's. None where the launch lacks the rows it is taken from (then compute measured
    with no communication stands in, as before). Local work is a row's step less its waits in
    collectives (``in_run_work``); ``X/comm`` is run X with no forward and backward.

    1. Forward and backward: the local work of the launch's run without exchanges (``no-exchange``:
       the hooks and Horovod's threads present, no collective) less its update (``no-exchange/comm``).
    2. Plus ``label``'s exchange and update: the local work of ``label/comm``, less the run's timed
       selection and decoding.
    3. Plus what ``label``'s collectives take from the cores beside the backward: dense's local work
       beyond its steps 1-2, per byte on the wire, times ``label``'s bytes. On the CPU a collective's
       thread copies and sums on the cores that compute (on VGG-FC at 2 ranks of the 2-core VM, up
       to 0.03 s a step for dense's 72 MB); a compressed exchange sends a hundredth of that.

    2'. A method with local steps that has no ``/comm`` row (SBC: its exchange spans local steps) runs
       the no-exchange row's own local steps: its update is ``no-exchange/comm``'s. What its
       exchange step does beside the timed phases is then left out, spread over its round.

    For dense itself steps 1-3 give back dense's own local work: its prediction then checks the
    collectives alone. Launches without the ``no-exchange`` rows take step 1 as dense's local work
    less ``dense/comm``'s, which holds dense's step 3 for every method. ``work(row)``: a row's local
    work (default ``in_run_work``; None where a row cannot give it)."""
    work = work or in_run_work
    run, own = runs.get(label), runs.get(f"{label}/comm")
    if not run or run.get("comm_only") or label.endswith("/comm"):
        return None
    parts = compute_parts(runs, work, *launch_rows(run))
    if parts is None:
        return None
    if own is None and "update" in parts and timed_over_rounds(run):
        exchange = parts["update"]   # 2'. local steps with no exchange alone (sbc): no-exchange's own steps
    elif own is None or (exchange := work(own)) is None:                                            # 2.
        return None
    else:
        exchange -= run["select_s"] + run["decompress_s"]
    per_byte = parts.get("beside_per_byte", 0.0)                                                   # 3.
    return max(parts["forward_backward"] + exchange + per_byte * (run.get("wire_bytes_per_step") or 0.0), 0.0)


def timed_over_rounds(run: dict) -> bool:
    """A run timed as the mean over whole rounds of local steps (a result's ``statistic``, or a
    results.csv row's ``status``)."""
    return run.get("statistic") == "mean" or str(run.get("status", "")).startswith("ok (mean")


def compute_parts(runs: dict, work=None, dense: str = "dense", no_exchange: str = NO_EXCHANGE) -> dict | None:
    """``launch_compute``'s parts of one launch (its rows ``dense`` and ``no_exchange``: the Gloo
    launch's, or ``launch_rows``' of the mpirun launch), seconds a step: forward and backward (step
    1), and with the no-exchange rows the update alone, dense's exchange alone, what dense's
    allreduce takes beside the backward (step 3) and that per byte. None without dense's two rows."""
    work = work or in_run_work
    names = (dense, f"{dense}/comm", no_exchange, f"{no_exchange}/comm")
    local = {n: work(runs[n]) for n in names if runs.get(n) is not None}
    if not (dense in local and f"{dense}/comm" in local) or None in local.values():
        return None
    if no_exchange not in local or f"{no_exchange}/comm" not in local:
        return {"forward_backward": local[dense] - local[f"{dense}/comm"]}
    forward_backward = local[no_exchange] - local[f"{no_exchange}/comm"]                          # 1.
    beside = local[dense] - forward_backward - local[f"{dense}/comm"]
    wire = runs[dense].get("wire_bytes_per_step")
    return {"forward_backward": forward_backward, "update": local[f"{no_exchange}/comm"],
            "dense_exchange": local[f"{dense}/comm"], "beside": beside,
            "beside_per_byte": max(beside, 0.0) / wire if wire else 0.0}


def parts_table(launches: dict, work) -> list:
    """Markdown lines of :func:`compute_parts` for every launch that has the ``no-exchange`` rows
    (``scripts/part_errors.py``): ``launches``: (results file, model, hosts, Mbit/s, latency) ->
    {method: the row's numbers}; ``work(row)``: a recorded row's local work."""
    lines = []
    for (path, model, hosts, bw, lat), rows in launches.items():
        for launch in ("gloo", MPI):
            parts = compute_parts(rows, work, *launch_rows({"launch": launch}))
            if parts and "beside" in parts:
                lines.append(f"| {path} | {model} | {hosts} | {bw or 'unshaped'} | {lat} | {launch} | " + " | ".join(
                    f"{parts[k]:.4f}" for k in ("forward_backward", "update", "dense_exchange", "beside")) + " |")
    return ["| results | model | hosts | Mbit/s | latency ms | launch | forward and backward | update "
            "| dense's exchange | dense beside |", "|---|---|---|---|---|---|---|---|---|---|"] + lines if lines else []


PARTS = ("compute", "overhead", "comm")


def part_errors(r: dict, p: dict, local: float | None = None) -> dict:
    """Each part's error, (predicted - measured) in % of the measured step, so the three add up to
    ``prediction_error_pct``: compute (the step's local work less the exchange's timed phases:
    forward, backward, the optimizer, and the exchange's untimed work), overhead (selection and
    decoding, priced from the run's own medians) and comm (the rest of the step: the waits in
    collectives, against the alpha-beta model's collectives). The local work is the slowest rank's,
    step by step (``in_run_work``; ``local`` where the caller has it, rank 0's without per-rank
    lists): a rank that waits for a slower one's compute waits in a collective, and that wait is
    the slower rank's compute, not the network's."""
    step = r["step_time_s"]
    if not step:
        return {}
    overhead = r["select_s"] + r["decompress_s"]
    if local is None:
        local = in_run_work(r) if r.get("per_rank") else step - r["communicate_s"]
    measured = {"compute": local - overhead, "overhead": overhead, "comm": step - local}
    predicted = {"compute": p["predicted_compute_s"], "overhead": p["predicted_overhead_s"],
                 "comm": p["predicted_comm_s"]}
    return {f"{part}_error_pct": 100 * (predicted[part] - measured[part]) / step for part in PARTS}


def _err(predicted, measured):
    return 100 * (predicted - measured) / measured if measured else None


def skipped_rows(setting, models, methods, why) -> list[dict]:
    return [dict(model=m["name"], method=name, hosts=setting["hosts"], bandwidth_mbit=setting.get("bandwidth_mbit"),
                 latency_ms=setting.get("latency_ms", 0.0), status=f"skipped: {why}")
            for m in models for name, _ in methods]


def markdown(rows: list[dict]) -> str:
    cols = ["model", "method", "hosts", "bandwidth_mbit", "latency_ms", "step_time_s", "speedup_vs_dense",
            "wire_bytes_per_step", "compute_s", "select_s", "communicate_s", "decompress_s",
            "overhead_pct_of_compute", "compute_source", "predicted_step_time_s", "prediction_error_pct",
            "compute_error_pct",
            "overhead_error_pct", "comm_error_pct", "predicted_in_run_s", "in_run_error_pct"]
    return markdown_table(cols, [[short(r.get(c), 3) for c in cols] for r in rows if r.get("step_time_s")]).rstrip()


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plots(run_dir: Path, rows: list[dict]) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in rows if r.get("step_time_s")]
    return [draw(plt, ok, run_dir) for draw in (_speedup, _breakdown, _prediction, _part_errors)]


def _speedup(plt, ok: list, run_dir: Path) -> Path:
    """Speedup against bandwidth, one line per (model, method, hosts), at the smallest latency."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    keys = sorted({(r["model"], r["method"], r["hosts"]) for r in ok
                   if r["method"] != "dense" and not r["method"].endswith("/comm")})
    for model, method, hosts in keys:
        pts = sorted((float(r["bandwidth_mbit"] or 1e5), r.get("speedup_vs_dense") or float("nan")) for r in ok
                     if (r["model"], r["method"], r["hosts"]) == (model, method, hosts) and not r["latency_ms"])
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{model} {method} N={hosts}")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("link bandwidth (Mbit/s)")
    ax.set_ylabel("speedup vs dense (step time)")
    ax.set_title("End-to-end speedup on the shaped network")
    ax.legend(fontsize=7)
    return _save(plt, fig, run_dir / "speedup_vs_bandwidth.png")


def _breakdown(plt, ok: list, run_dir: Path) -> Path:
    """Where a step's time goes: stacked bars, the prediction as a tick."""
    fig, ax = plt.subplots(figsize=(max(6.4, 0.8 * len(ok) + 2), 5.2))
    labels = [f"{r['model']} N={r['hosts']} {short(r['bandwidth_mbit'])}M\n{r['method']}" for r in ok]
    bottom = [0.0] * len(ok)
    for part, color in (("compute_s", "#4c72b0"), ("select_s", "#dd8452"), ("communicate_s", "#55a868"),
                        ("decompress_s", "#c44e52")):
        vals = [max(0.0, r.get(part) or 0.0) for r in ok]
        ax.bar(range(len(ok)), vals, bottom=bottom, color=color, label=part[:-2])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.scatter(range(len(ok)), [r.get("predicted_step_time_s") or float("nan") for r in ok], marker="_", s=300,
               color="black", label="predicted (cost model)", zorder=3)
    ax.set_xticks(range(len(ok)))
    ax.set_xticklabels(labels, fontsize=6, rotation=35, ha="right")   # long method names must not overlap
    ax.set_ylabel("seconds per step (rank 0)")
    ax.set_title("Where a step's time goes")
    ax.legend(fontsize=7)
    return _save(plt, fig, run_dir / "time_breakdown.png")


def _part_errors(plt, ok: list, run_dir: Path) -> Path:
    """Which part carries the prediction's error: per cell, each part's (predicted - measured) in %
    of the measured step, side by side; a bias of one sign across cells is a missing term."""
    fig, ax = plt.subplots(figsize=(max(6.4, 0.8 * len(ok) + 2), 4.6))
    labels = [f"{r['model']} N={r['hosts']} {short(r['bandwidth_mbit'])}M\n{r['method']}" for r in ok]
    width = 0.8 / len(PARTS)
    for i, (part, color) in enumerate(zip(PARTS, ("#4c72b0", "#dd8452", "#55a868"))):
        ax.bar([x + (i - 1) * width for x in range(len(ok))], [r.get(f"{part}_error_pct") or 0.0 for r in ok],
               width, color=color, label=part)
    ax.scatter(range(len(ok)), [r.get("prediction_error_pct") or float("nan") for r in ok], marker="_", s=300,
               color="black", label="whole step", zorder=3)
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(ok)))
    ax.set_xticklabels(labels, fontsize=6, rotation=35, ha="right")
    ax.set_ylabel("predicted - measured (% of the measured step)")
    ax.set_title("The prediction's error, part by part")
    ax.legend(fontsize=7)
    return _save(plt, fig, run_dir / "part_errors.png")


def _prediction(plt, ok: list, run_dir: Path) -> Path:
    """Predicted against measured: nominal link (tbf rate) and Horovod-probed alpha/B."""
    fig, ax = plt.subplots(figsize=(5.2, 4.6))
    pts = [r for r in ok if r.get("predicted_step_time_s")]
    if pts:
        xs = [r["step_time_s"] for r in pts]
        ax.scatter(xs, [r["predicted_step_time_s"] for r in pts], label="nominal link (tbf rate)")
        cal = [r for r in pts if r.get("predicted_calibrated_s")]
        if cal:
            ax.scatter([r["step_time_s"] for r in cal], [r["predicted_calibrated_s"] for r in cal], marker="x",
                       label="alpha, B probed through Horovod")
        for r in pts:
            ax.annotate(
                f"{r['model'][:6]} {r['method']} N={r['hosts']}",
                (r["step_time_s"], r["predicted_step_time_s"]),
                fontsize=5,
            )
        ys = [r["predicted_step_time_s"] for r in pts] + [r["predicted_calibrated_s"] for r in cal]
        hi = max(xs + ys) * 1.1
        ax.plot([0, hi], [0, hi], color="grey", lw=0.8)
        ax.fill_between([0, hi], [0, hi * 0.8], [0, hi * 1.2], color="grey", alpha=0.15, label="within 20%")
        ax.set_xlim(0, hi)
        ax.set_ylim(0, hi)
        ax.legend(fontsize=7)
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title("Cost model vs measurement")
    return _save(plt, fig, run_dir / "predicted_vs_measured.png")
