"""A sweep's results: each run's figures from its folder, the means over seeds, the table,
the plots and the records (``python -m redsync_hvd.experiments.sweep``).

Columns a sweep (or a part of it) can ask for, by name:

    metric              the sweep's metric (final_accuracy, final_perplexity or final_loss), mean of seeds
    per_seed            the metric of each seed
    spread              the seeds' sample standard deviation (accuracy in points), "-" for one seed
    vs_reference        against the reference row (the row's ``reference``, else the sweep's) at the same
                        launch: accuracy in points below it, perplexity and loss in % above it
    ratio               dense fp32 bytes over the bytes sent (means of seeds)
    ratio_vs_reference  the reference row's bytes over this row's
    wire_mb             MB one worker put into collectives over the run
    sparse_mb           of which the compressed layers' (``wire_bytes[sparse]``)
    budget_mb           of which the per-layer budget's statistics (``bytes_budget``)
    steps               training steps
    step_s              (wall time - evaluation time) / steps on rank 0, first step included
    wall_s              wall time of the run
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from . import machine
from .stats import mean
from .tables import cell, command_line, markdown, write_csv, write_json

METRICS = {"final_accuracy": ("accuracy", ".4f"), "final_perplexity": ("test perplexity", ".2f"),
           "final_loss": ("test loss", ".4f")}
COLUMNS = ("metric", "spread", "per_seed", "vs_reference", "ratio", "ratio_vs_reference", "wire_mb", "sparse_mb",
           "budget_mb", "steps", "step_s", "wall_s")
# headers where rows report different metrics (accuracy in points, perplexity in %)
MIXED_HEADS = {"metric": "accuracy or perplexity (mean)", "spread": "spread (sd)",
               "vs_reference": "vs reference (accuracy: points below; perplexity: % above)"}
DEFAULT_COLUMNS = ["metric", "per_seed", "vs_reference", "ratio", "wire_mb", "steps"]
CSV_COLUMNS = ["part", "row", "launch", "seed", "status", "final_accuracy", "final_perplexity", "final_loss",
               "wire_bytes", "dense_bytes", "ratio", "steps", "wall_s", "step_s", "load_before", "load_after"]


def read_run(folder: Path) -> dict:
    """A finished run's figures: summary.json, its evaluations (metrics.jsonl), the budget's
    choices (decisions.json) and the load average around it (load.json)."""
    s = json.loads((folder / "summary.json").read_text())
    detail, t = s.get("comm_detail", {}), s.get("time_breakdown", {})
    run = {"status": "ok", **{k: s.get(k) for k in ("final_accuracy", "final_perplexity", "final_loss")},
           "wire_bytes": s["wire_bytes"], "dense_bytes": s["dense_bytes"], "ratio": float(s["compression_ratio"]),
           "steps": s["steps"], "wall_s": s["wall_time_s"],
           "step_s": (s["wall_time_s"] - t.get("eval", 0.0)) / max(1, s["steps"]),
           "sparse_bytes": detail.get("wire_bytes[sparse]"), "budget_bytes": detail.get("bytes_budget"),
           "data": {k: v for k, v in (s.get("data") or {}).items() if k in ("name", "python", "text_sha256")}}
    metrics = folder / "metrics.jsonl"
    if metrics.is_file():
        evals = [json.loads(line) for line in metrics.read_text().splitlines() if '"test_' in line]
        run["curve"] = {key: [(e["step"], e[key]) for e in evals if key in e]
                        for key in ("test_accuracy", "test_perplexity", "test_loss")}
    decisions = folder / "decisions.json"
    budget = json.loads(decisions.read_text()).get("budget") if decisions.is_file() else None
    if budget:
        run["budget"] = {"bytes_per_step": budget["bytes_per_step"],
                         "history": [{"step": h["step"], "k": h["k"]} for h in budget["history"]]}
    if (folder / "load.json").is_file():
        run.update(json.loads((folder / "load.json").read_text()))
    return run


def aggregate(runs: list, metric: str) -> dict:
    """Means over the seeds that finished (``runs``: [(seed, run)])."""
    ok = [(seed, r) for seed, r in runs if r["status"] == "ok"]
    if not ok:
        return {"seeds_done": 0}
    rs = [r for _, r in ok]
    wire, dense = mean([r["wire_bytes"] for r in rs]), mean([r["dense_bytes"] for r in rs])
    return {"seeds_done": len(ok), "seeds": [s for s, _ in ok], "values": [r.get(metric) for r in rs],
            "mean": mean([r.get(metric) for r in rs]), "wire_bytes": wire, "dense_bytes": dense,
            "ratio": dense / wire if wire else None, "steps": rs[0]["steps"], "step_s": mean([r["step_s"] for r in rs]),
            "wall_s": mean([r["wall_s"] for r in rs]), "sparse_bytes": mean([r.get("sparse_bytes") for r in rs]),
            "budget_bytes": mean([r.get("budget_bytes") for r in rs])}


def _spread(a: dict, metric: str):
    values = [v for v in a.get("values", []) if v is not None]
    if len(values) < 2:
        return "-"
    sd = statistics.stdev(values)
    return f"±{100 * sd:.2f}" if metric == "final_accuracy" else f"±{sd:.2f}"


def _vs(a: dict, ref: dict | None, metric: str):
    if not ref or a.get("mean") is None or ref.get("mean") is None:
        return "-"
    if metric == "final_accuracy":
        return f"{100 * (ref['mean'] - a['mean']):+.2f}"
    return f"{100 * (a['mean'] / ref['mean'] - 1):+.1f}%"


def column(name: str, a: dict, ref: dict | None, metric: str, ref_name: str | None) -> tuple:
    """(header, cell) of column ``name`` for the aggregate ``a`` (the reference row's: ``ref``)."""
    what, spec = METRICS[metric]

    def mb(key, spec=".3f"):
        return cell(a[key] / 1e6 if a.get(key) is not None else None, spec)
    cells = {
        "metric": (f"{what} (mean)", lambda: cell(a.get("mean"), spec)),
        "spread": ("spread (sd)" + (" points" if metric == "final_accuracy" else ""), lambda: _spread(a, metric)),
        "per_seed": ("per seed", lambda: " ".join(cell(v, spec) for v in a.get("values", [])) or "-"),
        "vs_reference": (f"below {ref_name} (points)" if metric == "final_accuracy" else f"vs {ref_name}",
                         lambda: _vs(a, ref, metric)),
        "ratio": ("ratio", lambda: cell(a.get("ratio"), ".1f", "x")),
        "ratio_vs_reference": (f"ratio vs {ref_name}", lambda: cell(
            ref["wire_bytes"] / a["wire_bytes"] if ref and ref.get("wire_bytes") and a.get("wire_bytes") else None,
            ".1f", "x")),
        "wire_mb": ("MB/worker", lambda: mb("wire_bytes")),
        "sparse_mb": ("compressed layers MB/worker", lambda: mb("sparse_bytes")),
        "budget_mb": ("of which statistics MB", lambda: mb("budget_bytes", ".4f")),
        "steps": ("steps", lambda: cell(a.get("steps"), "d")),
        "step_s": ("step s", lambda: cell(a.get("step_s"), ".3f")),
        "wall_s": ("wall s", lambda: cell(a.get("wall_s"), ".0f")),
    }
    if name not in cells:
        raise ValueError(f"unknown column {name!r}; choose from {', '.join(cells)}")
    head, value = cells[name]
    return head, value()


def rows(sweep, results: list) -> dict:
    """{(row, launch): {part: aggregate}} in the sweep's order."""
    grouped: dict = {}
    for job, run in results:
        grouped.setdefault((job.row, job.launch), {}).setdefault(job.part, []).append((job.seed, run))
    return {key: {part: aggregate(runs, row_metric(sweep, key[0])) for part, runs in parts.items()}
            for key, parts in grouped.items()}


def row_metric(sweep, row: str) -> str:
    """A row's metric: its own ``metric`` (a text model's perplexity in a sweep of images), else the sweep's."""
    return sweep.rows[row].get("metric", sweep.metric)


def table(sweep, table_rows: dict) -> str:
    """One line per row and launch; per part, its columns (headed by the part's name when there
    are several parts). The reference columns name the reference row where every row has the same."""
    launches = {launch for _, launch in table_rows}
    refs = {key: sweep.rows[key].get("reference") or sweep.reference for key, _ in table_rows}
    named = set(refs.values()) - {None}
    shown = next(iter(named)) if len(named) == 1 else "reference"
    mixed = len({row_metric(sweep, key) for key, _ in table_rows}) > 1
    head, lines = ["method"] + (["launch"] if len(launches) > 1 else []), []
    for i, ((key, launch), parts) in enumerate(table_rows.items()):
        cells = [sweep.rows[key]["label"]] + ([launch] if len(launches) > 1 else [])
        for pname, part in sweep.parts.items():
            ref = table_rows.get((refs[key], launch), {}).get(pname)
            for name in part.get("columns") or sweep.columns or DEFAULT_COLUMNS:
                if name in ("vs_reference", "ratio_vs_reference") and not named:
                    continue
                h, c = column(name, parts.get(pname, {}), ref, row_metric(sweep, key), shown)
                h = MIXED_HEADS.get(name, h) if mixed else h
                head += [f"{pname} {h}" if len(sweep.parts) > 1 else h] if i == 0 else []
                cells.append(c)
        lines.append(cells)
    return markdown(head, lines)


def write(out: Path, sweep, results: list, argv, about: dict) -> None:
    """table.md, results.json, results.csv, the plots, command.txt and machine.json; the table also to stdout."""
    out.mkdir(parents=True, exist_ok=True)
    table_rows = rows(sweep, results)
    command = command_line(argv, "-m redsync_hvd.experiments.sweep")
    text = f"`{command}`\n\n{table(sweep, table_rows)}"
    (out / "table.md").write_text(text)
    runs = [{"part": j.part, "row": j.row, "launch": j.launch, "seed": j.seed, **j.identity(), **r}
            for j, r in results]
    write_json(out / "results.json", {"sweep": sweep.name, "metric": sweep.metric,
                                      "rows": [{"row": k, "launch": launch, "label": sweep.rows[k]["label"],
                                                "parts": parts} for (k, launch), parts in table_rows.items()],
                                      "runs": runs})
    write_csv(out / "results.csv", runs, CSV_COLUMNS)
    (out / "command.txt").write_text(f"PYTHONPATH=$PWD {command}\n")
    write_json(out / "machine.json", {**machine.describe(), **about})
    for pname, part in sweep.parts.items():
        for kind in part.get("plots", sweep.plots):
            plot(out, sweep, pname, kind, table_rows, results)
    print(text)
    print(f"written: {out}")


def plot(out: Path, sweep, pname: str, kind: str, table_rows: dict, results: list) -> None:
    """``kind`` "bytes": the metric's mean against bytes per worker, one point per row (rows at one
    point share a label); "steps": the mean of the seeds' evaluations against steps."""
    import matplotlib
    matplotlib.use("Agg")   # headless: no display on clusters or CI
    import matplotlib.pyplot as plt
    what = METRICS[sweep.metric][0]
    fig, ax = plt.subplots(figsize=(8, 5))
    if kind == "bytes":
        points: dict = {}
        for (key, _), parts in table_rows.items():
            a = parts.get(pname, {})
            if a.get("mean") is not None:
                points.setdefault((round(a["wire_bytes"] / 1e6, 3), a["mean"]), []).append(sweep.rows[key]["label"])
        for i, ((x, y), labels) in enumerate(sorted(points.items(), key=lambda p: p[0])):
            ax.scatter(x, y)
            ax.annotate(" = ".join(labels), (x, y), fontsize=7, xytext=(5, 3 + 9 * (i % 3)), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("bytes sent per worker over the run (MB, log scale)")
    else:
        key = "test_" + sweep.metric.removeprefix("final_")
        for (row, launch), _ in table_rows.items():
            curves = [dict(r.get("curve", {}).get(key, [])) for j, r in results
                      if (j.row, j.launch, j.part) == (row, launch, pname) and r["status"] == "ok"]
            steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            ax.plot(steps, [mean([c[s] for c in curves]) for s in steps], label=sweep.rows[row]["label"])
        ax.set_yscale("log" if sweep.metric == "final_perplexity" else "linear")
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    ax.set_ylabel(f"{what}, mean of seeds")
    ax.set_title(f"{sweep.name}{' ' + pname if pname else ''}: {what} against {kind}")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / f"{what.split()[-1]}_vs_{kind}{'_' + pname if pname else ''}.png", dpi=120)
    plt.close(fig)
