"""Timing collectives on a process group: the preflight's link checks and the profiler's link probe share it.

Bus bandwidth follows nccl-tests' convention (its doc/PERFORMANCE.md), with `size` the whole buffer (all_reduce:
the tensor; all_gather: the gathered output; reduce_scatter: the input) and `n` ranks in the group:
    algbw = size / seconds;  busbw = algbw x 2(n-1)/n (all_reduce), x (n-1)/n (all_gather, reduce_scatter)
so that busbw is comparable to one link's speed whatever n is. A collective's time is the slowest rank's,
averaged over ITERS calls after WARMUP calls.

The link probe (`probe_links`, run by `ShardingProfiler.close()` on every rank): each kind on the whole world, in
one message as large as the counted step's traffic of its busiest kind (within PROBE_BYTES), so a run that never
issued a kind (DDP: no all_gather, no reduce_scatter) still says how fast this cluster moves it. One large message
times the link's throughput, not a call's latency: the step-time model takes it, as measured, for the kinds the
run did not issue. Its cost is bounded by a step's traffic x 3 kinds x (WARMUP + ITERS) calls.
"""
from __future__ import annotations

import time

KINDS = ("all_reduce", "all_gather", "reduce_scatter")
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n}
WARMUP, ITERS = 2, 5
PROBE_BYTES = (64 * 2 ** 10, 32 * 2 ** 20)  # the probe's message, at least / at most (the step's busiest kind)


def bus_bandwidth(kind: str, size_bytes: int, seconds: float, ranks: int) -> float:
    """nccl-tests' bus bandwidth (bytes/s) of one collective call (formula in the module docstring)."""
    return size_bytes / seconds * BUS_FACTOR[kind](ranks)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def call_collective(kind: str, buffers, group) -> None:
    """One call of `kind` on (whole buffer, this rank's part)."""
    import torch.distributed as dist

    full, part = buffers
    if kind == "all_reduce":
        dist.all_reduce(full, group=group)
    elif kind == "all_gather":
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(full, part, group=group)
    else:  # torch 2.13 renamed the tensor forms *_single
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(part, full, group=group)


def buffers_for(size: int, ranks: int, device, dtype) -> tuple:
    """(whole buffer, one rank's part) of `size` bytes rounded down to a multiple of the ranks' elements."""
    import torch

    element = torch.empty((), dtype=dtype).element_size()
    numel = max(size // element // ranks, 1) * ranks
    return torch.ones(numel, dtype=dtype, device=device), torch.ones(numel // ranks, dtype=dtype, device=device)


def time_collective(kind: str, buffers, group, device) -> tuple[float, int]:
    """(seconds per call, bytes of the whole buffer) of one collective on `group` over `buffers` (`buffers_for`),
    this rank's view (the caller takes the slowest rank's)."""
    import torch.distributed as dist

    for _ in range(WARMUP):
        call_collective(kind, buffers, group)
    sync(device)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(ITERS):
        call_collective(kind, buffers, group)
    sync(device)
    return (time.perf_counter() - start) / ITERS, buffers[0].numel() * buffers[0].element_size()


def slowest(seconds: float, group, device) -> float:
    """The slowest rank's seconds in `group` (every rank of it calls this)."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return float(value.item())


def probe_size(ranks: list[dict]) -> int | None:
    """The probe's message size: the counted step's bytes of its busiest kind on any rank, within PROBE_BYTES;
    None when no step was counted."""
    traffic = [kind["bytes"] for rank in ranks for kind in (rank.get("comm") or {}).values() if kind.get("calls")]
    return min(max(int(max(traffic)), PROBE_BYTES[0]), PROBE_BYTES[1]) if traffic else None


def probe_links(size: int | None, device) -> dict | None:
    """{"size_bytes", "ranks", "backend", "seconds": {kind}, "bus_bytes_per_s": {kind}} of each kind on the whole
    world in fp32 (module docstring); None on one process or when no rank has a size. Every rank calls this: the
    ranks first agree on the size (the largest any proposes) and make the buffers, and a rank that could not make
    them makes every rank skip, so no rank waits in a collective another never joins."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    ranks = dist.get_world_size()
    agreed = torch.tensor([size or 0], dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    size = int(agreed.item())
    if not size:
        return None
    try:
        buffers = buffers_for(size, ranks, device, torch.float32)
    except RuntimeError:  # out of memory on this rank
        buffers = None
    ready = torch.tensor([int(buffers is not None)], device=device)
    dist.all_reduce(ready, op=dist.ReduceOp.MIN)
    if not ready.item():
        return None
    out = {"size_bytes": None, "ranks": ranks, "backend": dist.get_backend(), "seconds": {}, "bus_bytes_per_s": {}}
    for kind in KINDS:
        seconds, out["size_bytes"] = time_collective(kind, buffers, None, device)
        seconds = slowest(seconds, None, device)
        out["seconds"][kind] = seconds
        out["bus_bytes_per_s"][kind] = bus_bandwidth(kind, out["size_bytes"], seconds, ranks)
    return out
