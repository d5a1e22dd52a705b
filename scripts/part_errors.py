"""Which part of a step the cost model misses, from a bench's results.csv (scripts/bench_end_to_end.py).

    .venv/bin/python scripts/part_errors.py docs/results/<machine>/<run>/results.csv [more.csv ...]

Per row: each part's (predicted - measured) in % of the measured step, adding up to the whole
step's error (``redsync_hvd/experiments/netbench/report.py:part_errors``): compute (the step less
the exchange's timed phases, against compute measured alone with N processes), overhead
(selection and decoding, priced from the run's own medians) and comm (the collectives). Then,
per part, the mean signed error and how many rows it under-predicts: a bias of one sign across
cells is a missing term, not noise. Older CSVs without the part columns are recomputed from
their measured and predicted columns.
"""
from __future__ import annotations

import csv
import statistics
import sys

from redsync_hvd.experiments.netbench.report import PARTS, part_errors


def _number(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def rows_of(path: str) -> list:
    out = []
    for r in csv.DictReader(open(path)):
        if not r.get("step_time_s") or not r.get("predicted_step_time_s"):
            continue
        f = {k: _number(v) for k, v in r.items()}
        comm_only = r["method"].endswith("/comm")
        predicted = {"predicted_compute_s": 0.0 if comm_only else f["compute_nproc_s"],
                     "predicted_overhead_s": f["select_s"] + f["decompress_s"],
                     "predicted_comm_s": f["predicted_comm_s"]}
        out.append({"cell": f"{r['model']} N={r['hosts']} {r['bandwidth_mbit']}M {r['method']}",
                    "total": f["prediction_error_pct"], **part_errors(f, predicted)})
    return out


def main(paths: list) -> int:
    rows = [row for p in paths for row in rows_of(p)]
    print("| cell | whole step | " + " | ".join(PARTS) + " |\n|---|---|" + "---|" * len(PARTS))
    for r in rows:
        parts = " | ".join(f"{r[p + '_error_pct']:+.1f}%" for p in PARTS)
        print(f"| {r['cell']} | {r['total']:+.1f}% | {parts} |")
    print(f"\n{len(rows)} rows; mean signed error, and the rows each part under-predicts:")
    for part in ("total", *PARTS):
        vals = [r[part if part == "total" else part + "_error_pct"] for r in rows]
        print(f"  {part}: {statistics.fmean(vals):+.1f}% of the step, low in {sum(v < -0.05 for v in vals)} "
              f"of {len(vals)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]) if sys.argv[1:] else print(__doc__) or 2)
