"""Each rank's achieved matmul FLOP/s at the training dtype, and the straggler below STRAGGLER of the median.

A square matmul of side n costs 2·n³ FLOPs. The figure is the best of REPEATS windows of ITERS matmuls (the
best, because anything else running on the machine only ever slows a timing down). GPU ranks are timed at
once (each has its own GPU), in wall time after a synchronize. CPU ranks share the node's cores: they take
turns, and a window is timed in the process's CPU time, so that a rank descheduled by other load does not
read as a slow rank (on CPU the figure is FLOPs per CPU-second of the rank).
`slow_rank` is for tests only (`--test-slow-rank`): that rank computes every matmul SLOW_FACTOR times and
counts it once, so it is really SLOW_FACTOR times slower, in wall and CPU time alike.
"""
from __future__ import annotations

import statistics
import time

SIDE = {"cuda": 8192, "cpu": 512}
ITERS, REPEATS = 5, 10
STRAGGLER = 0.8   # a rank below 80% of the median is named (the threshold)
SLOW_FACTOR = 4


def measure(me: int, world: int, device, dtype, slow_rank: int | None) -> dict:
    """This rank's {"flops_per_s", "side", "dtype", "clock"}: the best of REPEATS windows of ITERS matmuls. GPU
    ranks time at once; CPU ranks take turns window by window, with a barrier on the whole world after each
    turn. Every rank calls this."""
    import torch
    import torch.distributed as dist

    from ..measure.collective_timing import sync

    side = SIDE.get(device.type, SIDE["cuda"])
    a, b = (torch.randn(side, side, device=device).to(dtype) for _ in range(2))
    torch.matmul(a, b)  # warm-up: kernels chosen, memory allocated
    sync(device)
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    calls = ITERS * (SLOW_FACTOR if me == slow_rank else 1)

    def window() -> float:
        start = clock()
        for _ in range(calls):
            torch.matmul(a, b)
        sync(device)
        return clock() - start

    best = float("inf")
    for _ in range(REPEATS):
        for turn in range(world) if device.type != "cuda" else [me]:
            if turn == me:
                best = min(best, window())
            if device.type != "cuda":
                dist.barrier()
    return {"flops_per_s": 2 * side ** 3 * ITERS / best, "side": side, "dtype": str(dtype).removeprefix("torch."),
            "clock": "wall" if device.type == "cuda" else "cpu"}


def stragglers(flops: dict[int, float], where=None) -> list[dict]:
    """A finding per rank below STRAGGLER x the median FLOP/s; `where(rank)` adds its node to its name."""
    if len(flops) < 2:
        return []
    median = statistics.median(flops.values())
    return [{"code": "straggler", "key": "matmul_flops", "ranks": [rank], "value": value, "median": median,
             "message": f"rank {rank}{where(rank) if where else ''} is a straggler: {value / 1e12:.3g} TFLOP/s, "
                        f"{value / median:.0%} of the median {median / 1e12:.3g} TFLOP/s (below {STRAGGLER:.0%}); "
                        "every collective waits for it"}
            for rank, value in sorted(flops.items()) if value < STRAGGLER * median]
