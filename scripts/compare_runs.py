"""Print a comparison table of run folders (their summary.json files).

    python scripts/compare_runs.py runs/demo/dense runs/demo/topk [--markdown]

Columns aligned as plain text for a terminal; ``--markdown``: a Markdown table (for docs/ and the
README; scripts/demo.sh prints this one).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

HEAD = ["run", "method", "accuracy", "wire MB/worker", "dense MB/worker", "ratio", "steps", "wall s"]


def load(folder: str) -> dict:
    path = Path(folder) / "summary.json"
    if not path.is_file():
        raise SystemExit(f"error: {path} not found; is {folder} a finished run folder?")
    return json.loads(path.read_text())


def row(run: str, s: dict) -> list:
    return [Path(run).name, s["compression"]["method"], f"{s['final_accuracy']:.4f}",
            f"{s['wire_bytes'] / 1e6:.3f}", f"{s['dense_bytes'] / 1e6:.3f}",
            f"{float(s['compression_ratio']):.1f}x", str(s["steps"]), f"{s['wall_time_s']:.1f}"]


def table(rows: list, markdown: bool) -> str:
    widths = [max(len(r[i]) for r in rows + [HEAD]) for i in range(len(HEAD))]
    if not markdown:
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [HEAD, *rows])
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(HEAD), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run folders (each with a summary.json)")
    ap.add_argument("--markdown", action="store_true", help="a Markdown table instead of aligned text")
    args = ap.parse_args(argv)
    print(table([row(run, load(run)) for run in args.runs], args.markdown))


if __name__ == "__main__":
    main()
