"""Per-rank figures exchanged between ranks: one all_gather per measurement (the metric table's fields, metrics.py).

Every rank starts these at the same step (collectives); without a process group they return this rank's alone.
"""
from __future__ import annotations

import math
from array import array

import torch



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


class Route:
    """Where one run's figures travel: the default process group, its size, the device the gather runs on and the
    group's own `all_gather_single` with its options, read once (`route`). Called directly: torch.distributed's
    Python layers around it (argument checks, backend and coalescing look-ups) cost tens of microseconds a
    measurement once training has left them out of the cache."""

    __slots__ = ("group", "world", "device", "call", "options", "buffers")

    def __init__(self, device: torch.device):
        dist = torch.distributed
        self.group = dist.group.WORLD if dist.is_available() else None
        self.world = 1 if self.group is None else self.group.size()
        self.device, self.call, self.options = torch.device("cpu"), None, None
        self.buffers: dict = {}  # CPU gathers: {number of fields: (values, their tensor, the output tensor)}
        if self.world > 1:
            self.device = device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
            self.options = dist.distributed_c10d.AllgatherOptions()
            self.options.asyncOp = True
            # named _allgather_base before torch 2.13 (as the public function was all_gather_into_tensor)
            self.call = getattr(self.group, "all_gather_single", None) or self.group._allgather_base


def route(device: torch.device, known: Route | None = None) -> Route:
    """`known` while the default process group is still the one it was read from, else that group read afresh."""
    dist = torch.distributed
    if known is not None and known.group is (dist.group.WORLD if dist.is_available() else None):
        return known
    return Route(device)


def start_gather(values: dict, step: int, via: Route, fields) -> Gathered:
    """Every rank's `values` (same keys everywhere) via one all_gather over `via`, started without waiting (the
    caller waits in `result()`, so a rank that arrives first need not idle here); just ours when not distributed."""
    if via.world == 1:
        return Gathered(values, step, ranks=[values])
    # through an array: torch.tensor(list) reads each float on its own (several times slower)
    sent = array("d", map(float, map(values.__getitem__, fields)))
    if via.device.type != "cpu":
        mine = torch.frombuffer(sent, dtype=torch.float64).to(via.device)
        out = mine.new_empty(via.world * len(fields))
    else:  # the same tensors each time (two tensor allocations less): a gather completes before the next starts
        held = via.buffers.get(len(sent))
        if held is None:
            values_in = array("d", sent)
            held = via.buffers[len(sent)] = (values_in, torch.frombuffer(values_in, dtype=torch.float64),
                                              torch.empty(via.world * len(sent), dtype=torch.float64))
        held[0][:] = sent
        _, mine, out = held
    return Gathered(values, step, fields, mine, out, via.call(out, mine, via.options))


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


# A figure not measured on a rank travels as NaN (every rank sends the same fields); reading one back:
def as_float(value) -> float:
    if value is None:
        return math.nan
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def none_if_nan(value):
    return None if value is None or math.isnan(value) else value


def int_or_none(value):
    return None if value is None or math.isnan(value) else int(value)
