"""Print a comparison table of run folders (their summary.json files).

    python scripts/compare_runs.py runs/demo/dense runs/demo/topk [--markdown]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(folder: str) -> dict:
    path = Path(folder) / "summary.json"
    if not path.is_file():
        raise SystemExit(f"error: {path} not found; is {folder} a finished run folder?")
    return json.loads(path.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    args = ap.parse_args()
    head = ["run", "method", "accuracy", "wire MB/worker", "dense MB/worker", "ratio", "steps", "wall s"]
    rows = []
    for run in args.runs:
        s = load(run)
        rows.append([Path(run).name, s["compression"]["method"], f"{s['final_accuracy']:.4f}",
                     f"{s['wire_bytes'] / 1e6:.3f}", f"{s['dense_bytes'] / 1e6:.3f}",
                     f"{float(s['compression_ratio']):.1f}x", str(s["steps"]), f"{s['wall_time_s']:.1f}"])
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    print(line(head))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))


if __name__ == "__main__":
    main()
