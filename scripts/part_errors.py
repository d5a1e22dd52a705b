"""Which part of a step the cost model misses, from a bench's results.csv (scripts/bench_end_to_end.py).

    .venv/bin/python scripts/part_errors.py docs/results/<machine>/<run>/results.csv [more.csv ...]

Per row: each part's (predicted - measured) in % of the measured step, adding up to the whole
step's error (``redsync_hvd/experiments/netbench/report.py:part_errors``): compute (the slowest
rank's local work less the exchange's timed phases), overhead (selection and decoding, priced from
the run's own medians) and comm (the rest of the step, against the alpha-beta model's collectives).
Two predictions of the compute part:

* alone: forward, backward and the update measured with N processes and no communication
  (``compute_nproc_s``), what results.csv files before ``compute_source`` used;
* launch: measured in the row's own launch (``report.py:launch_compute``): dense's local work less
  that of dense's exchange alone, plus the row's method's exchange alone (its ``<method>/comm``
  row). Only where the launch has those rows; a row's local work is recovered from its recorded
  in-run and calibrated predictions (they differ by it and by nothing else).

Then, per part, the mean signed error and how many rows it under-predicts: a bias of one sign
across cells is a missing term, not noise.
"""
from __future__ import annotations

import csv
import statistics
import sys

from redsync_hvd.experiments.netbench import report
from redsync_hvd.experiments.netbench.report import PARTS, part_errors


def _number(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def local_work(f: dict) -> float | None:
    """The slowest rank's local work per step, recovered from a row's recorded predictions: the in-run
    one is ``in_run_work + comm``, the calibrated one ``compute_nproc + select + decompress + comm``
    (the same comm, Horovod's probed alpha and B)."""
    if f.get("predicted_in_run_s") is None or f.get("predicted_calibrated_s") is None:
        return None
    comm = f["predicted_calibrated_s"] - f["compute_nproc_s"] - f["select_s"] - f["decompress_s"]
    return f["predicted_in_run_s"] - comm


def launches_of(path: str) -> dict:
    """(model, hosts, Mbit/s, latency) -> {method: the row's numbers}: the rows of one launch."""
    launches = {}
    for r in csv.DictReader(open(path)):
        if r.get("step_time_s") and r.get("predicted_step_time_s"):
            f = {k: _number(v) for k, v in r.items()} | {"status": r.get("status", ""), "launch": r.get("launch", "")}
            launches.setdefault((r["model"], r["hosts"], r["bandwidth_mbit"], r["latency_ms"]), {})[r["method"]] = f
    return launches


def rows_of(path: str) -> list:
    out = []
    for cell, rows in launches_of(path).items():
        for method, f in rows.items():
            comm_only = method.endswith("/comm")
            predicted = {"predicted_compute_s": 0.0 if comm_only else f["compute_nproc_s"],
                         "predicted_overhead_s": f["select_s"] + f["decompress_s"],
                         "predicted_comm_s": f["predicted_comm_s"]}
            local = local_work(f)
            row = {"cell": f"{cell[0]} N={cell[1]} {cell[2]}M {method}", **part_errors(f, predicted, local)}
            c = report.launch_compute(rows, method, work=local_work)
            if c is not None:
                after = part_errors(f, {**predicted, "predicted_compute_s": c}, local)
                row.update({f"launch_{k}": v for k, v in after.items()})
            out.append(row)
    return out


def _total(row: dict, prefix: str = "") -> float:
    return sum(row[f"{prefix}{p}_error_pct"] for p in PARTS)


def summary(rows: list, prefix: str, label: str) -> list:
    lines = [f"{label}: {len(rows)} rows; mean signed error, rows low, rows within 20%:"]
    for part in ("step", *PARTS):
        vals = [_total(r, prefix) if part == "step" else r[f"{prefix}{part}_error_pct"] for r in rows]
        within = f", within 20% in {sum(abs(v) <= 20 for v in vals)}" if part == "step" else ""
        lines.append(f"  {part}: {statistics.fmean(vals):+.1f}% of the step, low in {sum(v < -0.05 for v in vals)} "
                     f"of {len(vals)}{within}")
    return lines


def main(paths: list) -> int:
    print("\n".join(report.parts_table({(p, *c): rows for p in paths for c, rows in launches_of(p).items()},
                                       local_work)))
    rows = [row for p in paths for row in rows_of(p)]
    print("| cell | whole step, alone | " + " | ".join(PARTS) + " | whole step, launch | compute, launch |\n"
          "|---|---|" + "---|" * len(PARTS) + "---|---|")
    for r in rows:
        parts = " | ".join(f"{r[p + '_error_pct']:+.1f}%" for p in PARTS)
        launch = (f"{_total(r, 'launch_'):+.1f}% | {r['launch_compute_error_pct']:+.1f}%"
                  if "launch_compute_error_pct" in r else "- | -")
        print(f"| {r['cell']} | {_total(r):+.1f}% | {parts} | {launch} |")
    # dense's own prediction in the launch takes back dense's own local work: only its comm is predicted
    both = [r for r in rows if "launch_compute_error_pct" in r and not r["cell"].endswith(" dense")]
    print("\n" + "\n".join(summary(rows, "", "compute measured alone, every row")))
    if both:
        label = "compute measured alone, the rows with a launch measurement (dense's own left out)"
        print("\n".join(summary(both, "", label)))
        print("\n".join(summary(both, "launch_", "compute measured in the launch, the same rows")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]) if sys.argv[1:] else print(__doc__) or 2)
