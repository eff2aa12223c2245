"""The summary file's contents (`summary.FIELDS`): the run's facts (`run_facts.RunFacts`) and what its end gathered
from every rank (`RunEnd`).

`contents` is called on rank 0 at the profiler's `close()`, after the run's last exchange; it reads nothing of the
model or the process group (every figure is handed in), so it runs after the profiler let go of them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import __version__
from ..strategy import num_nodes
from .guard import instrument_statuses
from .memory import memory_kind
from .precision import run_verdict
from .run_facts import RunFacts
from .stragglers import Windows, verdict as straggler_verdict


@dataclass
class RunEnd:
    """What the end of the run gathered, one entry per rank: its figures as the metric table writes them
    (`metrics.written`), its precision report, its instruments' results and statuses; beside them the optimizer steps
    taken, each logged window's compute seconds per rank (`stragglers.Windows`) and the collectives' timing."""

    global_step: int
    figures: list[dict]
    precision_reports: list[dict]
    results: list[dict]
    statuses: list[dict]
    windows: Windows
    link_probe: dict | None = None


def contents(facts: RunFacts, end: RunEnd) -> dict:
    """The summary of the run: its top-level keys, then one entry per rank."""
    detected, device = facts.detected, facts.device
    by_rank = end.precision_reports or [{}] * len(end.figures)
    return {
        "shardscope_version": __version__,
        "strategy": detected.get("strategy"),
        "strategy_detail": {k: v for k, v in detected.items() if k not in ("strategy", "world_size", "mesh")},
        "mesh": detected.get("mesh"),
        "live_plan": facts.live_plan,
        **facts.extra,
        "world_size": detected.get("world_size", len(end.figures)),
        "num_nodes": num_nodes(),
        "model": facts.model,
        "frozen_models": {name: {"params_total": count} for name, count in facts.frozen_params.items()},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "precision": facts.configured_precision,
        "precision_verdict": run_verdict(end.precision_reports),
        "global_step": end.global_step,
        "state_locations": facts.state_locations,
        "straggler": straggler_verdict(end.figures, end.windows),
        "link_probe": end.link_probe,
        "memory_details_rank0": facts.memory_reading,
        "ranks": [{"rank": i, **r, "memory_kind": memory_kind(device, facts.memory_reading, r), **(result or {}),
                   **{k: v for k, v in p.items() if k != "precision_verdict"}}
                  for i, (r, p, result) in enumerate(zip(end.figures, by_rank, end.results))],
        "instruments": instrument_statuses(end.statuses),
    }
