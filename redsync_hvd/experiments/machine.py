"""What a measurement ran on: CPU model, cores, GPU, versions and load, for every result file."""
from __future__ import annotations

import os
import platform


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, or what ``platform`` knows elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine() or "unknown CPU"


def describe(device: str = "cpu", versions: tuple = (), **extra) -> dict:
    """host, cpu, cores, device, torch, python, the 1-minute load average, the GPU's name on
    ``device`` "cuda", and the version of each module named in ``versions`` (None where it does
    not import); then ``extra``."""
    import torch
    info = {"host": platform.node(), "cpu": cpu_name(), "cores": os.cpu_count(), "device": str(device),
            "torch": torch.__version__, "python": platform.python_version(),
            "load_average_1min": round(os.getloadavg()[0], 2)}
    if str(device).startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    for name in versions:
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    return {**info, **extra}


def line(info: dict) -> str:
    """One line for a table's head: "host: CPU, N cores[, GPU]; torch X, Python Y; load Z"."""
    gpu = f", {info['gpu']}" if info.get("gpu") else ""
    return (f"{info['host']}: {info['cpu']}, {info['cores']} cores{gpu}; torch {info['torch']}, "
            f"Python {info['python']}; load average {info['load_average_1min']}")
