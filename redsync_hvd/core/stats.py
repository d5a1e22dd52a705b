"""Communication accounting: real bytes put into collectives, and where the time went."""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager


class CommStats:
    """Cumulative per-worker figures since start, plus the figures of the last step.

    ``wire_bytes`` counts every byte this worker hands to a collective: indices,
    values, per-layer scalars and the headers that make variable-size messages
    decodable. ``dense_bytes`` is what fp32 allreduce of the same gradients
    would hand over. Times are wall-clock seconds on this worker.
    """

    PHASES = ("select", "communicate", "decompress")

    def __init__(self) -> None:
        self.total = defaultdict(float)
        self.step = defaultdict(float)
        self.steps = 0
        self.layers: dict[str, dict] = {}

    @contextmanager
    def timer(self, phase: str, group: str | None = None):
        """Time a phase; with ``group`` also under ``time_<phase>[group]``: select by layer kind
        ("sparse"/"dense"), communicate and decompress by collective ("allreduce"/"allgather"/
        "reduce_scatter")."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add_time(phase, group, time.perf_counter() - t0)

    def add_time(self, phase: str, group: str | None, seconds: float) -> None:
        """``seconds`` of ``phase`` (what ``timer`` adds), measured elsewhere."""
        self.add(f"time_{phase}", seconds)
        if group:
            self.add(f"time_{phase}[{group}]", seconds)

    def add(self, key: str, value: float) -> None:
        self.step[key] += value

    def add_many(self, values: dict) -> None:
        """Several ``add``s at once (a planned bucket's figures, the same every step of a layout)."""
        for key, value in values.items():
            self.step[key] += value

    def add_bytes(self, by_kind: dict, group: str = "all") -> None:
        for kind, n in by_kind.items():
            self.step[f"bytes_{kind}"] += n
            self.step[f"bytes_{kind}[{group}]"] += n
            self.step["wire_bytes"] += n
            self.step[f"wire_bytes[{group}]"] += n

    def layer(self, name: str, group: str, selected, k, wire: int, dense: int) -> None:
        self.layers[name] = {"group": group, "selected": selected, "k": k, "wire_bytes": wire, "dense_bytes": dense}

    def end_step(self) -> dict:
        last = dict(self.step)
        for key, value in last.items():
            self.total[key] += value
        self.steps += 1
        self.step = defaultdict(float)
        self.last = last
        return last

    def summary(self) -> dict:
        wire = self.total.get("wire_bytes", 0.0)
        dense = self.total.get("dense_bytes", 0.0)
        out = {
            "wire_bytes": int(wire),
            "dense_bytes": int(dense),
            "compression_ratio": (dense / wire) if wire else float("inf") if dense else 1.0,
            "steps": self.steps,
        }
        for phase in self.PHASES:
            out[phase] = self.total.get(f"time_{phase}", 0.0)
            for group in ("sparse", "dense", "allreduce", "allgather", "reduce_scatter"):
                if f"time_{phase}[{group}]" in self.total:
                    out[f"{phase}[{group}]"] = self.total[f"time_{phase}[{group}]"]
        for key, value in self.total.items():
            if key.startswith(("bytes_", "wire_bytes[", "selected", "k[")) or key == "k":
                out[key] = int(value)
        return out

    def state_dict(self) -> dict:
        return {"total": dict(self.total), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.total = defaultdict(float, state["total"])
        self.steps = state["steps"]
