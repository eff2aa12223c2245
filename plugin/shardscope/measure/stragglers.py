"""Which rank drags every step: each rank's compute time beside its wall time, per logged window, and the verdict.

Under DDP (and every strategy whose steps end in a collective) a slow rank does not show in wall time: the others
wait for it inside the collective, so every rank's step lasts as long as the slowest's. What differs is the time
computing: on CPU ranks the training thread's CPU time (`throughput.ThroughputWindow.compute`; a wait inside a
collective blocks without using CPU); on CUDA ranks each step's GPU time less its NCCL collectives' GPU time
(`cuda_compute.py`; read lazily, so a step may count in a later logged window than it ran in).

Per logged window (every `every_n_steps` steps, the figures the profiler gathers anyway) a rank whose compute
exceeds the median of all ranks' by more than `SLOWER` is slow in that window; a rank slow in more than half of
the windows, of at least `MIN_WINDOWS`, is named the straggler (`straggler_rank`). For each other rank, `waiting_share` =
(straggler's compute - its compute) / its wall time over the run: the share of its step spent waiting for the
straggler. Beside it, the timed step's `busiest_rank` (`time_breakdown.across_ranks`) is one step's reading, not a
verdict: the two can differ.
"""
from __future__ import annotations

import math
import statistics

SLOWER = 0.20  # compute above the median by more than this share: slow in that window
MIN_WINDOWS = 3  # a straggler is slow over time: fewer logged windows name none (a short run's one step can be uneven)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not math.isnan(value)


class Windows:
    """Each logged window's compute seconds per rank (`add`: the gathered fields of one measurement)."""

    def __init__(self):
        self.compute: list[list[float]] = []

    def add(self, ranks: list[dict]) -> None:
        values = [r.get("compute_seconds") for r in ranks]
        if len(values) > 1 and all(_number(v) and v > 0 for v in values):
            self.compute.append(values)


def slow_windows(windows: list[list[float]]) -> list[int]:
    """Per rank, the windows in which its compute exceeds the median's by more than SLOWER."""
    counts = [0] * (len(windows[0]) if windows else 0)
    for values in windows:
        median = statistics.median(values)
        for rank, value in enumerate(values):
            counts[rank] += value > median * (1 + SLOWER)
    return counts


def verdict(ranks: list[dict], windows: Windows) -> dict | None:
    """The summary's top-level `straggler`: the timed step's figures (`time_breakdown.across_ranks`: busiest_rank,
    step_s, busy_s, spread) and, where every rank measured its compute, `compute_s` and `wall_s` per rank over the
    run, `windows`, `slow_windows` per rank, `straggler_rank` (or None) and `waiting_share` {rank: share}."""
    from . import time_breakdown  # (here: `line` serves report/ and compare, which need no torch)

    out = dict(time_breakdown.across_ranks([r.get("time_breakdown") for r in ranks]) or {})
    compute = [(r.get("throughput") or {}).get("compute_seconds") for r in ranks]
    wall = [(r.get("throughput") or {}).get("seconds") for r in ranks]
    if len(ranks) < 2 or not all(_number(v) for v in compute + wall):
        return out or None
    logged = windows.compute or [compute]  # a run shorter than one logged window: the run is the window
    slow = slow_windows(logged)
    named = [r for r, n in enumerate(slow) if n > len(logged) / 2 and len(logged) >= MIN_WINDOWS]
    rank = max(named, key=compute.__getitem__) if named else None
    out.update(compute_s=compute, wall_s=wall, windows=len(logged), slow_windows=slow, straggler_rank=rank,
               waiting_share=None if rank is None else {
                   str(r): max(0.0, (compute[rank] - compute[r]) / wall[r]) if wall[r] > 0 else None
                   for r in range(len(ranks)) if r != rank})
    return out


def line(result: dict | None) -> str | None:
    """One sentence naming the straggler (None when there is none)."""
    if not result or result.get("straggler_rank") is None:
        return None
    rank, compute = result["straggler_rank"], result["compute_s"]
    median = statistics.median(compute)
    waits = ", ".join(f"rank {r} {share:.0%}" for r, share in result["waiting_share"].items() if share is not None)
    return (f"rank {rank} is a straggler: {compute[rank]:.3g} s computing vs the median {median:.3g} s "
            f"(slower by >{SLOWER:.0%} in {result['slow_windows'][rank]} of {result['windows']} logged windows); "
            f"share of each other rank's step spent waiting for it: {waits}")
