"""The summary file's contents (`summary.FIELDS`): what the profiler detected and measured, every rank's figures.

`contents` is called on rank 0 at the profiler's `close()`, after the run's last exchange; it reads nothing of the
model or the process group (every figure is handed in), so it runs after the profiler let go of them.
"""
from __future__ import annotations

import torch

from .. import __version__
from ..strategy import num_nodes
from .guard import instrument_statuses
from .memory import memory_kind
from .precision import run_verdict
from .stragglers import straggler


def contents(ranks: list[dict], results: list[dict], statuses: list[dict], *, detected: dict, extra: dict,
             model: dict, frozen_flops: dict, device, precision: str | None, precision_ranks: list[dict],
             global_step: int, locations: dict, windows, link_probe: dict | None, memory: dict) -> dict:
    """The summary: `ranks` (each rank's reported figures, `rank_figures.complete`), `results` and `statuses` (each
    rank's instruments' results and "ok"/why not), `detected` (strategy, world size, mesh, plan), `extra` (the
    caller's top-level keys), `model` (its facts), `frozen_flops` ({name: FlopsModel}), `precision_ranks` (each
    rank's precision report), `windows` (`stragglers.Windows`), `memory` (rank 0's last memory reading)."""
    by_rank = precision_ranks or [{}] * len(ranks)
    return {
        "shardscope_version": __version__,
        "strategy": detected.get("strategy"),
        "strategy_detail": {k: v for k, v in detected.items() if k not in ("strategy", "world_size", "plan", "mesh")},
        "mesh": detected.get("mesh"),
        "preflight_plan": detected.get("plan"),
        **extra,
        "world_size": detected.get("world_size", len(ranks)),
        "num_nodes": num_nodes(),
        "model": model,
        "frozen_models": {name: {"params_total": fm.total_params} for name, fm in frozen_flops.items()},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "precision": precision,
        "precision_verdict": run_verdict(precision_ranks),
        "global_step": global_step,
        "state_locations": locations,
        "straggler": straggler(ranks, windows),
        "link_probe": link_probe,
        "memory_details_rank0": memory,
        "ranks": [{"rank": i, **r, "memory_kind": memory_kind(device, memory, r), **(result or {}),
                   **{k: v for k, v in p.items() if k != "precision_verdict"}}
                  for i, (r, p, result) in enumerate(zip(ranks, by_rank, results))],
        "instruments": instrument_statuses(statuses),
    }
