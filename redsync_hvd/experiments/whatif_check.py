"""whatif's pick against what a network sweep measured fastest, from the sweep's recorded rows.

    python -m redsync_hvd.experiments.whatif_check docs/results/*/*/results.csv

1. reads each bench ``results.csv`` (``scripts/bench_end_to_end.py``) with the ``config.yaml`` beside
   it: the models and each method's compression settings;
2. per cell (one model at one network setting of one launch): the measured step of every method of
   the gradient exchange (no ``<method>/comm`` rows; the decentralized methods are not whatif's);
3. prices each method with ``whatif.price`` on the model's own layers, from what the sweep recorded
   and nothing timed here: N, the link (the tbf rate, or the measured goodput where unshaped;
   alpha half the unloaded RTT plus the added latency; the launch's measured fp16 sum, where the
   sweep recorded ``half_sum_ns``), the compute of N processes, and the
   method's own measured selection and decoding per step as a cost per element of the layers it
   compressed (fp16: its conversions; none: nothing, its row is the allreduce alone);
4. whatif's pick is the lowest predicted step. It agrees with the cell when it is the method
   measured fastest, or one measured within ``TIE`` of it: the same cell measured in six launches
   (quick.yaml, ``docs/results/cpu-2cores-2026-11-26/quick-*``) spread by 12% (RedSync 0.188 to
   0.210 s), so a closer call is not an order the sweep measured.
"""
from __future__ import annotations

import csv
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from redsync_hvd.compressors.base import Layer
from redsync_hvd.config import exchange_every, parse_compression
from redsync_hvd.config.compression import DECENTRALIZED, MOVED, expand_shorthands
from redsync_hvd.experiments.netbench.report import timed_over_rounds
from redsync_hvd.experiments.netbench.worker import DEFAULTS, build
from redsync_hvd.experiments.whatif import price
from redsync_hvd.policy.costmodel import ComputeModel, Network

TIE = 0.10


@dataclass
class Cell:
    """One model at one network setting of one launch: what each method measured and recorded."""
    where: str
    model: dict
    N: int
    net: Network
    compute_s: float
    rows: dict = field(default_factory=dict)      # method label -> its results.csv row
    specs: dict = field(default_factory=dict)     # method label -> its compression settings


def current(spec: dict, rounds: bool = False) -> dict:
    """A compression section of an older sweep with its flat keys where they live now
    (``threshold_reuse: 5`` -> ``selection: {threshold_reuse: 5}``). Sweeps recorded before
    ``local_steps: auto`` became RedSync's default ran it every step: a section that does not name
    ``local_steps`` is priced as it ran, every step unless its row was timed over rounds of local
    steps (``rounds``: the row's status says "mean")."""
    out = expand_shorthands({k: v for k, v in spec.items() if k not in MOVED or k == "layers"})
    if out.get("method") == "redsync" and not rounds:
        out.setdefault("local_steps", 1)
    for key, value in spec.items():
        if key in MOVED and key != "layers":
            group, name = MOVED[key].split(".")
            out[group] = {**(out.get(group) or {}), name: value}
    return out


def _number(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def cells(path: Path) -> list:
    """Step 2 for one results.csv: its cells, each with its exchange methods' rows."""
    config = yaml.safe_load((path.parent / "config.yaml").read_text())
    models = {m["name"]: m for m in config["models"]}
    methods = config["methods"]
    out: dict = {}
    for row in csv.DictReader(open(path)):
        spec = methods.get(row["method"])
        if not _number(row.get("step_time_s")) or spec is None or spec.get("method") in DECENTRALIZED:
            continue
        key = (row["model"], row["hosts"], row["bandwidth_mbit"], row["latency_ms"])
        if key not in out:
            mbit = _number(row["bandwidth_mbit"]) or _number(row.get("goodput_mbit"))
            alpha = (_number(row["latency_ms"]) or 0.0) / 1e3 + (_number(row.get("rtt_ms")) or 0.0) / 2e3
            out[key] = Cell(f"{path.parent.name} {row['model']} N={row['hosts']} {row['bandwidth_mbit']} Mbit/s",
                            models[row["model"]], int(row["hosts"]),
                            Network(alpha, mbit * 1e6 / 8, (_number(row.get("half_sum_ns")) or 0.0) * 1e-9),
                            float(row["compute_nproc_s"]))
        out[key].rows[row["method"]] = row
        out[key].specs[row["method"]] = current(spec, rounds=timed_over_rounds(row))
    return list(out.values())


def layers_of(model: dict) -> list:
    """The bench model's parameters as the exchange's layers (built here; nothing is timed)."""
    spec = {**DEFAULTS, "model": model["model"], "model_options": model.get("options") or {}}
    for key in ("input_shape", "num_classes", "seq_len"):
        if key in model:
            spec[key] = model[key]
    return [Layer(n, tuple(p.shape), p.numel(), i, torch.device("cpu"))
            for i, (n, p) in enumerate(build(spec).named_parameters())]


def recorded_rates(row: dict, spec: dict, layers: list) -> ComputeModel | None:
    """The method's measured selection and decoding per exchange, per element of the layers it
    compressed (the ``compressed_layers`` largest; every layer its size floor admits where the row
    counts none, as for PowerSGD, whose factors travel as an allreduce); None for none. A row with
    local steps recorded them per step, a round's mean: ``price`` spreads an exchange over its round."""
    config = parse_compression(spec)
    every = exchange_every(spec)
    if config.method == "none":
        return None
    count = int(_number(row.get("compressed_layers")) or 0)
    floor = getattr(getattr(config, "policy", None), "min_compress_numel", 0)
    sizes = sorted((l.numel for l in layers), reverse=True)
    chosen = sizes[:count] if count else [n for n in sizes if n >= floor]
    local = (float(row["select_s"]) + float(row["decompress_s"])) * every
    return ComputeModel(select_c0=0.0, select_c1=local / max(sum(chosen), 1), decompress_c0=0.0, decompress_c1=0.0)


def judge(cell: Cell, layers: list) -> dict:
    """Steps 3-4 for one cell: each method's predicted step, whatif's pick, the measured fastest."""
    predicted = {label: price(spec, layers, cell.N, cell.net, recorded_rates(cell.rows[label], spec, layers),
                              cell.compute_s, 0.0)["step_s"] for label, spec in cell.specs.items()}
    measured = {label: float(row["step_time_s"]) for label, row in cell.rows.items()}
    pick, fastest = min(predicted, key=predicted.get), min(measured, key=measured.get)
    return {"cell": cell.where, "pick": pick, "fastest": fastest, "ratio": measured[pick] / measured[fastest],
            "agrees": measured[pick] <= measured[fastest] * (1 + TIE), "predicted": predicted, "measured": measured}


def check(paths) -> list:
    """Every cell of every results.csv in ``paths`` that has a config.yaml beside it and two exchange
    methods or more, judged."""
    built, out = {}, []
    for path in map(Path, paths):
        header = path.read_text().split("\n", 1)[0]
        if not (path.parent / "config.yaml").exists() or "predicted_step_time_s" not in header:
            continue
        for cell in cells(path):
            if len(cell.rows) < 2:   # one exchange method (a launch that measured MPI's dense): no pick to judge
                continue
            name = cell.model["name"]
            built.setdefault(name, layers_of(cell.model))
            out.append(judge(cell, built[name]))
    return out


def main(paths: list) -> int:
    results = check(paths)
    print("| cell | whatif's pick | measured fastest | pick's measured step / fastest's |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['cell']} | {r['pick']} | {r['fastest']} | {r['ratio']:.2f}{'' if r['agrees'] else ' (no)'} |")
    agree = sum(r["agrees"] for r in results)
    print(f"\nwhatif's pick is the measured fastest in {sum(r['pick'] == r['fastest'] for r in results)} of "
          f"{len(results)} cells, within {TIE:.0%} of it in {agree} ({agree / max(len(results), 1):.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]) if sys.argv[1:] else print(__doc__) or 2)
