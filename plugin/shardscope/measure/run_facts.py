"""The run's facts: what the profiler detected and read of the run as a whole, one record.

Set where the profiler is made (the strategy detected, the device, the configured precision, the models' parameter
counts, the device's peak FLOP/s), completed as the run goes (the live-run plan at the first training batch, the
devices each state was found on and the last memory reading, at the summary's measurement), and written into the
summary's top-level keys by `run_summary.contents`. The per-rank figures are the metric table's (`metrics.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .throughput import split_degrees


@dataclass
class RunFacts:
    detected: dict  # what the strategy was read from (detect.py): strategy, world_size, mesh, ZeRO's buckets, ...
    device: torch.device  # the device this rank trains on
    configured_precision: str | None  # fp32, bf16 or fp16 as configured: the summary's `precision`
    extra: dict = field(default_factory=dict)  # top-level keys the caller owns (the callback's fit, accumulation)
    model: dict = field(default_factory=dict)  # {name_or_path, params_total, trainable_params}
    frozen_params: dict = field(default_factory=dict)  # {name: parameter count} of each frozen model
    peak_flops: float | None = None  # the device's peak FLOP/s at that precision (MFU's denominator); None: unknown
    live_plan: dict | None = None  # the planner's row for this run at its first training batch (on a GPU)
    state_locations: dict = field(default_factory=dict)  # {params, grads, optimizer: the devices they were on}
    memory_reading: dict = field(default_factory=dict)  # this rank's last `memory.read_memory` readings

    @property
    def strategy(self) -> str | None:
        return self.detected.get("strategy")

    @property
    def mesh(self) -> dict | None:
        return self.detected.get("mesh")

    @property
    def world_size(self) -> int:
        return self.detected.get("world_size", 1)

    @property
    def split(self) -> tuple[int, int]:
        """(ranks that share each batch: tp x cp, ranks that share each sequence's tokens: sp)."""
        return split_degrees(self.mesh)
