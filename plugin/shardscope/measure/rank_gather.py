"""Per-rank figures exchanged between ranks: one all_gather per measurement, and the cross-rank metrics logged.

Every rank starts these at the same step (collectives); without a process group they return this rank's alone.
"""
from __future__ import annotations

import math
from array import array

import torch

from ..summary import reduce_ranks

PREFIX = "shardscope/"
REDUCED = ("params_bytes", "grads_bytes", "optimizer_bytes", "frozen_models_bytes", "peak_memory_bytes",
           "peak_tensor_bytes", "tokens_per_s", "tflops_per_device", "mfu")


class Gathered:
    """An all_gather of per-rank figures in flight (`start_gather`); `result()` waits for it (once) and returns every
    rank's figures. `local`: this rank's own, `step`: the optimizer step they were measured at."""

    __slots__ = ("local", "step", "fields", "sent", "tensor", "work", "ranks")

    def __init__(self, local: dict, step: int, fields=(), sent=None, tensor=None, work=None, ranks=None):
        self.local, self.step, self.fields, self.ranks = local, step, fields, ranks
        self.sent, self.tensor, self.work = sent, tensor, work  # both tensors held until the gather completes

    def result(self) -> list[dict]:
        if self.ranks is None:
            self.work.wait()
            flat, n = self.tensor.tolist(), len(self.fields)
            self.ranks = [dict(zip(self.fields, flat[i:i + n])) for i in range(0, len(flat), n)]
        return self.ranks


def start_gather(values: dict, step: int, device: torch.device, fields) -> Gathered:
    """Every rank's `values` (same keys everywhere) via one all_gather, started without waiting (the caller waits in
    `result()`, so a rank that arrives first need not idle here); just ours when not distributed."""
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        return Gathered(values, step, ranks=[values])
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    # through an array: torch.tensor(list) reads each float on its own (several times slower)
    mine = torch.frombuffer(array("d", map(float, map(values.__getitem__, fields))), dtype=torch.float64).to(on)
    out = mine.new_empty(world * len(fields))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    return Gathered(values, step, fields, mine, out, gather(out, mine, async_op=True))


def process_rank() -> int:
    """This process's rank (0 when not distributed)."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


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


# A figure not measured on a rank travels as NaN (every rank sends the same fields); reading one back:
def as_float(value) -> float:
    if value is None:
        return math.nan
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def none_if_nan(value):
    return None if value is None or math.isnan(value) else value


def int_or_none(value):
    return None if value is None or math.isnan(value) else int(value)
