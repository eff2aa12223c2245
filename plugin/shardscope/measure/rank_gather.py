"""Per-rank figures exchanged between ranks: one all_gather per measurement, and the cross-rank metrics logged.

Every rank calls these at the same step (collectives); without a process group they return this rank's alone.
"""
from __future__ import annotations

import torch

from ..summary import reduce_ranks

PREFIX = "shardscope/"
REDUCED = ("params_bytes", "grads_bytes", "optimizer_bytes", "frozen_models_bytes", "peak_memory_bytes",
           "peak_tensor_bytes", "tokens_per_s", "tflops_per_device", "mfu")


def all_gather_figures(values: dict, device: torch.device, fields) -> list[dict]:
    """Every rank's `values` (same keys everywhere), via one all_gather; just ours when not distributed."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [values]
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor([float(values[k]) for k in fields], dtype=torch.float64, device=on)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [dict(zip(fields, t.tolist())) for t in gathered]


def gather_objects(mine) -> list:
    """Every rank's JSON-able `mine` (one all_gather_object); just ours when not distributed."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def log_metrics(ranks: list[dict], tp: int = 1) -> dict:
    """Cross-rank min/max/mean of per-rank figures, plus global samples/s and tokens/s (each of the
    `tp` ranks of a tensor-parallel group counts its shared batch: the group's replica counts once)."""
    flat = [{**{k: v for k, v in r.items() if k != "throughput"}, **r["throughput"]} for r in ranks]
    reduced = reduce_ranks(flat, REDUCED, tp)
    metrics = {}
    for key in REDUCED:
        if key in reduced:
            name = "tokens_per_s_per_device" if key == "tokens_per_s" else key
            metrics.update({f"{PREFIX}{name}_{k}": v for k, v in reduced[key].items()})
    for key in ("samples_per_s", "tokens_per_s"):
        if reduced[f"global_{key}"] is not None:
            metrics[f"{PREFIX}{key}"] = reduced[f"global_{key}"]
    return metrics
