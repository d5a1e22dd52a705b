"""The result files of the experiment tools: markdown tables, CSV, JSON, the command that made them."""
from __future__ import annotations

import csv
import json
import math
import platform
import shlex
import sys
from pathlib import Path

from .machine import cpu_name


def cell(v, spec: str = "", suffix: str = "") -> str:
    """``v`` formatted by ``spec`` with ``suffix``; "-" for None or NaN (nothing measured)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:{spec}}{suffix}"


def short(v, digits: int = 4) -> str:
    """A number for a CSV or a wide table: ``digits`` significant digits below 1e4, whole
    numbers above; "" for None, NaN and infinity."""
    if v is None or v == "":
        return ""
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return ""
        return f"{v:.{digits}g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def markdown(head: list, rows: list, align: str = "") -> str:
    """A markdown table of string cells; ``align`` has one character per column, "r" for
    right-aligned numbers (default: all left)."""
    rule = ["---:" if a == "r" else "---" for a in align.ljust(len(head), "l")]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_csv(path: Path, rows: list, columns: list, digits: int | None = None) -> None:
    """One line per dict of ``rows``, ``columns`` in order (missing keys empty, others left out);
    with ``digits``, floats are written by :func:`short`."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: short(r.get(k), digits) if digits and isinstance(r.get(k), float) else r.get(k, "")
                        for k in columns})


def write_json(path: Path, obj) -> None:
    Path(path).write_text(json.dumps(obj, indent=1, default=str) + "\n")


def write_result(path: str, info: dict, rows: list, text: str) -> None:
    """A benchmark's ``--out``: {"machine": info, "rows": rows} where the name ends in .json,
    else the markdown ``text``."""
    if path.endswith(".json"):
        write_json(Path(path), {"machine": info, "rows": rows})
    else:
        Path(path).write_text(text + "\n")


def config_arguments(ap, default: str) -> None:
    """A one-process tool's ``--config`` (a run config, relative to the repo), ``--set`` and ``--out``."""
    ap.add_argument("--config", default=default)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=None)


def config_of(args, *extra: str):
    """The run config ``args.config`` names, with ``extra`` and then ``--set`` applied."""
    from ..config import load_config
    from .jobs import REPO
    path = args.config if Path(args.config).is_absolute() else str(REPO / args.config)
    return load_config(path, [*extra, *args.overrides])


def one_process_report(argv, program: str, what: str, seconds: float, body: str, out: str | None) -> str:
    """A one-process measurement's markdown: the command, ``what`` ran on which machine and
    software, and ``body``; printed, and written to ``out`` where given."""
    torch = sys.modules.get("torch")   # its version where the caller loaded it; these tools need no torch
    version = f", torch {torch.__version__}" if torch is not None else ""
    text = (f"`{command_line(argv, program)}`\n\n{what}, one process, {cpu_name()}{version}, Python "
            f"{platform.python_version()}, {seconds:.0f} s\n\n{body}")
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    return text


def command_line(argv=None, program: str | None = None) -> str:
    """The invocation as a user types it from the repository root (for a result's command.txt);
    ``program``: what follows ``python`` (default: the script run)."""
    args = sys.argv[1:] if argv is None else list(argv)
    return f"python {program or shlex.quote(sys.argv[0])} " + " ".join(shlex.quote(a) for a in args)
