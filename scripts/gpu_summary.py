#!/usr/bin/env python
"""Gather what scripts/gpu_check.sh measured into RESULTS/summary.json and summary.md.

    python scripts/gpu_summary.py docs/results/h100-2026-11-27

Reads, where present (a missing or failed step leaves its keys null):
  selection.json  scripts/bench_selection.py --out: exact-k rows against torch.topk
  stages.json     scripts/bench_bucket_select.py --out: the exact-k stages against compute
  overhead.json   scripts/bench_overhead.py --json: the exchange against compute, host reads,
                  at batch 16 and 128 (overhead_cuda.md, its table, where the JSON is missing)
  profile.json    scripts/profile_exchange.py --out: device time and kernel launches per step
  env.json        device and versions (gpu_check.sh)

summary.json keys: device, torch; selection_speedup_vs_topk {1M, 16M, 64M}: median
torch.topk time over median exact-k (Triton) time, Gaussian, D = 0.001, same process, eager
(also under selection_speedup_vs_topk_eager), beside selection_speedup_vs_topk_graph, the
same launches replayed from a CUDA graph; exchange_share_of_compute {vgg_fc4096, resnet20}:
the compressed exchange over forward + backward + update at the model's batch (16), and
exchange_share_of_compute_b128 at batch 128, from bench_overhead.py's rows of the method that
selects exactly k per layer of a bucket on the device (``redsync_mc_exact_k``, else the first
*exact_k* method); exchange_device_ms and launches_per_step {vgg_fc4096, resnet20}: that
method's device time and kernel launches per exchange step at batch 16 (profile_exchange.py,
torch.profiler); host_waits_per_step: its host reads in one whole exchange step outside the
finite check (the hooks' submits, the collectives' start, the decode; the largest over the
models), or, without overhead.json, the synchronising calls in one step of the exact-k stages
(bench_bucket_select.py, Triton). ``finite_check_reads_per_step`` and
``device_syncs_per_step`` (torch's sync debug mode over the same step, finite check
included) stand beside it. Further keys give the other rows behind these numbers (the graph
variant's, ``redsync_mc_exact_k_graph``, where the configuration has it).
"""
from __future__ import annotations

import json
import os
import re
import sys

SIZES = {"1M": 1 << 20, "16M": 1 << 24, "64M": 1 << 26}
MODELS = ("vgg_fc4096", "resnet20")


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def selection(results):
    """{backend: {size: speedup}} at D = 0.001 (Gaussian) from bench_selection's rows."""
    data = load_json(os.path.join(results, "selection.json"))
    out = {}
    for r in (data or {}).get("rows", []):
        if r.get("dist") != "gauss" or abs(r.get("density", 0) - 0.001) > 1e-12 or r["method"] == "torch.topk":
            continue
        size = next((s for s, n in SIZES.items() if n == r["n"]), None)
        if size is None:
            continue
        speedup = r.get("speedup")
        out.setdefault(r["method"], {})[size] = None if speedup != speedup else round(speedup, 3)  # nan: null
    return out


def overhead(results, batch=16):
    """{method: {model: row}} at one batch size from bench_overhead's JSON (rows without a batch:
    the model's own, 16), or (older runs) its markdown table, where a row holds only the share."""
    data = load_json(os.path.join(results, "overhead.json"))
    out = {}
    if data is not None:
        for r in data.get("rows", []):
            if r.get("batch", 16) == batch:
                out.setdefault(r["method"], {})[r["model"]] = r
        return out
    try:
        with open(os.path.join(results, "overhead_cuda.md")) as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    for line in lines if batch == 16 else []:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 9 and cells[0] in MODELS and re.fullmatch(r"[\d.]+%", cells[8]):
            out.setdefault(cells[2], {})[cells[0]] = {"ratio": float(cells[8][:-1]) / 100}
    return out


def profiled(results, method):
    """{model: row} of profile_exchange.py's rows for one method at batch 16."""
    data = load_json(os.path.join(results, "profile.json")) or {}
    return {r["model"]: r for r in data.get("exchange", []) if r.get("method") == method and r.get("batch") == 16}


def shares(over, method):
    return {m: (round(over[method][m]["ratio"], 4) if method and m in over.get(method, {}) else None) for m in MODELS}


def exact_k_method(over):
    if "redsync_mc_exact_k" in over:
        return "redsync_mc_exact_k"
    return next((m for m in over if "exact_k" in m), None)


def most(rows, key):
    values = [r.get(key) for r in rows if r.get(key) is not None]
    return max(values) if values else None


def summary(results):
    env = load_json(os.path.join(results, "env.json")) or {}
    sel = selection(results)
    stages = load_json(os.path.join(results, "stages.json")) or {}
    over, over128 = overhead(results), overhead(results, 128)
    exact = exact_k_method(over) or exact_k_method(over128)
    exact_rows = list(over.get(exact, {}).values())
    triton_rows = [r.get("triton", {}) for r in stages.get("rows", [])]
    stage_waits = most(triton_rows, "host_waits")
    waits = most(exact_rows, "host_reads")
    eager, graph = sel.get("exact-k triton", {}), sel.get("exact-k triton-graph", {})
    prof = profiled(results, exact or "redsync_mc_exact_k")
    return {
        "device": env.get("device") or stages.get("machine", {}).get("device"),
        "torch": env.get("torch"),
        "selection_speedup_vs_topk": {s: eager.get(s) for s in SIZES},
        "selection_speedup_vs_topk_eager": {s: eager.get(s) for s in SIZES},
        "selection_speedup_vs_topk_graph": {s: graph.get(s) for s in SIZES},
        "exchange_share_of_compute": shares(over, exact),
        "exchange_share_of_compute_b128": shares(over128, exact),
        "exchange_device_ms": {m: _round(prof.get(m, {}).get("device_ms"), 4) for m in MODELS},
        "launches_per_step": {m: _round(prof.get(m, {}).get("launches"), 1) for m in MODELS},
        "host_waits_per_step": waits if waits is not None else stage_waits,
        # what the keys above come from, and the rows beside them
        "host_waits_scope": ("one whole exchange step of %s outside the finite check: submits, collectives' start, "
                             "decode (bench_overhead.py, host-read count)" % exact) if waits is not None else
                            "one step of the exact-k stages (compensate, select with the residual update, decode), "
                            "scripts/bench_bucket_select.py, Triton backend",
        "finite_check_reads_per_step": most(exact_rows, "agreement_reads"),
        "device_syncs_per_step": most(exact_rows, "device_syncs"),
        "exact_k_stages_host_waits": stage_waits,
        "exchange_share_method": exact,
        "exchange_share_by_method": {m: {model: round(r["ratio"], 4) for model, r in rows.items()}
                                     for m, rows in over.items()},
        "exchange_share_by_method_b128": {m: {model: round(r["ratio"], 4) for model, r in rows.items()}
                                          for m, rows in over128.items()},
        "exchange_device_ms_graph": {m: _round(r.get("device_ms"), 4)
                                     for m, r in profiled(results, "redsync_mc_exact_k_graph").items()},
        "host_reads_by_method": {m: {model: r.get("host_reads") for model, r in rows.items()}
                                 for m, rows in over.items()},
        "selection_speedup_by_backend": sel,
        "exact_k_stages_share_of_compute": {
            r["model"]: {b: round(r[b]["share"], 4) for b in ("torch", "triton", "triton-graph")
                         if b in r and r[b]["share"] == r[b]["share"]} for r in stages.get("rows", [])},
        "versions": {k: env.get(k) for k in ("triton", "cupy", "driver")},
    }


def _fmt(pattern, v, scale=1):
    return "-" if v is None else pattern % (v * scale)


def _round(v, digits):
    return None if v is None or v != v else round(v, digits)


def markdown(s):
    lines = ["Device: %s; torch %s; %s." % (s["device"], s["torch"],
                                             ", ".join("%s %s" % kv for kv in s["versions"].items())), "",
             "| quantity | 1M | 16M | 64M |", "|---|---:|---:|---:|"]
    for backend, row in sorted(s["selection_speedup_by_backend"].items()):
        lines.append("| speedup vs torch.topk, D=0.001: %s | %s |" % (
            backend, " | ".join("-" if row.get(k) is None else "%.2fx" % row[k] for k in SIZES)))
    lines += ["", "| model | exchange / compute, batch 16 (%s) | batch 128 | device ms / step | launches / step "
              "| exact-k stages / compute |" % (s["exchange_share_method"] or "no exact-k method yet"),
              "|---|---:|---:|---:|---:|---|"]
    for m in MODELS:
        share, share128 = s["exchange_share_of_compute"][m], s["exchange_share_of_compute_b128"][m]
        stages = s["exact_k_stages_share_of_compute"].get(m, {})
        dev, launches = s["exchange_device_ms"][m], s["launches_per_step"][m]
        lines.append("| %s | %s | %s | %s | %s | %s |" % (
            m, _fmt("%.1f%%", share, 100), _fmt("%.1f%%", share128, 100), _fmt("%.3f", dev), _fmt("%.0f", launches),
            ", ".join("%s %.1f%%" % (b, 100 * v) for b, v in stages.items()) or "-"))
    lines += ["", "Host waits per step (%s): %s; reads of the finite check: %s; device syncs per step (torch's "
              "sync debug mode, finite check included): %s." % (
                  s["host_waits_scope"], s["host_waits_per_step"], s["finite_check_reads_per_step"],
                  s["device_syncs_per_step"])]
    return "\n".join(lines) + "\n"


def main():
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        sys.exit("usage: gpu_summary.py RESULTS_DIR (the folder gpu_check.sh wrote)")
    s = summary(sys.argv[1])
    with open(os.path.join(sys.argv[1], "summary.json"), "w") as f:
        json.dump(s, f, indent=1)
    with open(os.path.join(sys.argv[1], "summary.md"), "w") as f:
        f.write(markdown(s))
    print(json.dumps({k: s[k] for k in ("device", "torch", "selection_speedup_vs_topk_eager",
                                        "selection_speedup_vs_topk_graph", "exchange_share_of_compute",
                                        "exchange_share_of_compute_b128", "exchange_device_ms", "launches_per_step",
                                        "host_waits_per_step")}, indent=1))


if __name__ == "__main__":
    main()
