"""Golden values of every ``configs/digits/*.yaml`` run: final weights and bytes, bit for bit.

    python tests/golden/record.py            # run every config at seeds 0 and 1, write digits.json
    python tests/golden/record.py --check    # run them again and compare with digits.json

Each run is ``horovodrun -np 2 python -m redsync_hvd.train --config <cfg> --set training.seed=<s>``
at the config's own epochs. What is kept per run: a SHA-256 of every rank's final model weights
(from the run's last checkpoint, in the state dict's order) and the byte counts of its
summary.json. A change that moves no number (a refactoring of the exchange) passes ``--check``;
one that moves a number names the run and the figure.

The weights depend on torch's CPU kernels (``torch.backends.cpu.get_cpu_capability()``):
digits.json was recorded on another machine (not AVX2, or another build), and its recording commit (604aa64) gives other
weights in all 36 runs under AVX2 (and other wire bytes in the six RedSync runs and sbc-s1, whose
selections see those weights). A machine of another capability keeps its values in
``digits-<capability>.json``, recorded from that commit (``--record-capability`` writes the runs
that differ), and ``--check`` compares with digits.json overlaid by it.

The capability does not name every kernel a run takes: two machines that both report AVX512 (an
AMD EPYC and an Intel Xeon with AMX) end 28 of the 36 runs on other weights. Such a machine keeps its values in
``digits-<capability>-<cpu model>.json`` (``--record-machine``, from the commit that last recorded
digits.json), and ``--check`` reads that file where it exists instead of the capability's.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
GOLDEN = Path(__file__).with_name("digits.json")
CAPABILITY = torch.backends.cpu.get_cpu_capability()


def cpu_model() -> str:
    """This CPU's model name as part of a file name ("Intel(R) Xeon(R) Processor": intel-xeon-processor)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    name = next((line.split(":", 1)[1] for line in lines if line.startswith("model name")), "unknown")
    return re.sub(r"[^a-z0-9]+", "-", re.sub(r"\((r|tm)\)", "", name.lower())).strip("-")


CAPABILITY_OVERLAY = Path(__file__).with_name(f"digits-{CAPABILITY}.json")
MACHINE_OVERLAY = Path(__file__).with_name(f"digits-{CAPABILITY}-{cpu_model()}.json")
OVERLAY = MACHINE_OVERLAY if MACHINE_OVERLAY.exists() else CAPABILITY_OVERLAY
SEEDS = (0, 1)
BYTES = ("wire_bytes", "dense_bytes", "steps")


def configs() -> list:
    return sorted(p for p in (REPO / "configs/digits").glob("*.yaml") if p.name != "base.yaml")


def weights_hash(state: dict) -> str:
    digest = hashlib.sha256()
    for name, tensor in state.items():
        digest.update(name.encode())
        digest.update(torch.as_tensor(tensor).detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def run(config: Path, seed: int, out: Path) -> dict:
    name = f"{config.stem}-s{seed}"
    cmd = [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", sys.executable, "-m", "redsync_hvd.train",
           "--config", str(config), "--set", f"training.seed={seed}", "--set", f"output.dir={out}",
           "--set", f"output.name={name}", "--set", "training.progress=false", "--set", "output.overwrite=true"]
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2", "OMPI_MCA_mpi_yield_when_idle": "1",
           "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"{name} failed ({res.returncode}):\n{res.stdout[-3000:]}{res.stderr[-3000:]}")
    folder = out / name
    summary = json.loads((folder / "summary.json").read_text())
    record = {key: summary.get(key) for key in BYTES}
    for rank in (0, 1):
        blob = torch.load(folder / f"checkpoint-rank{rank}.pt", map_location="cpu", weights_only=False)
        record[f"weights_rank{rank}"] = weights_hash(blob["model"])
    return record


def run_all(only, golden: dict | None = None) -> tuple:
    """Every config (or ``only`` these stems) at every seed: ({run: record}, [what differs from ``golden``])."""
    got, differ = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for config in configs():
            if only and config.stem not in only:
                continue
            for seed in SEEDS:
                key = f"{config.stem}-s{seed}"
                got[key] = run(config, seed, Path(tmp))
                same = golden is not None and golden.get(key) == got[key]
                print(f"{key:24s} {got[key]['wire_bytes']:>14} {got[key]['weights_rank0'][:12]}"
                      + ("" if golden is None else "  same" if same else "  DIFFERS"), flush=True)
                if golden is not None and not same:
                    differ.append(f"{key}: golden {golden.get(key)} now {got[key]}")
    return got, differ


def record_overlay(target: Path, only) -> int:
    """Write the runs that differ from digits.json here to ``target`` (kept: its runs not rerun)."""
    base = json.loads(GOLDEN.read_text())
    got, _ = run_all(only)
    moved = {k: v for k, v in got.items() if base.get(k) != v}
    kept = json.loads(target.read_text()) if target.exists() else {}
    kept = {k: v for k, v in kept.items() if k not in got}
    target.write_text(json.dumps({**kept, **moved}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(moved)} runs that differ from {GOLDEN.name} here to {target}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with digits.json instead of writing it")
    ap.add_argument("--only", nargs="*", default=None, help="config stems to run (default: all)")
    ap.add_argument("--record-capability", action="store_true",
                    help=f"write the runs that differ from digits.json to {CAPABILITY_OVERLAY.name} (this kind of CPU)")
    ap.add_argument("--record-machine", action="store_true",
                    help=f"write the runs that differ from digits.json to {MACHINE_OVERLAY.name} (this CPU model)")
    args = ap.parse_args()
    if args.record_machine or args.record_capability:
        return record_overlay(MACHINE_OVERLAY if args.record_machine else CAPABILITY_OVERLAY, args.only)
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if not args.check:
        got, _ = run_all(args.only)
        GOLDEN.write_text(json.dumps({**golden, **got}, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(got)} runs to {GOLDEN}")
        return 0
    overlay = json.loads(OVERLAY.read_text()) if OVERLAY.exists() else {}
    got, differ = run_all(args.only, {**golden, **overlay})
    against = GOLDEN.name + (f" + {OVERLAY.name}" if overlay else "")
    print("\n".join(differ) if differ else f"all {len(got)} runs bit-identical to {against}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
