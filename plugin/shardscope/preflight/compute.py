"""Each rank's achieved matmul FLOP/s at the training dtype, and the straggler below STRAGGLER of the median.

A square matmul of side n costs 2·n³ FLOPs. The figure is the best of REPEATS timings of ITERS matmuls (the
best, because anything else running on the machine only ever slows a timing down). GPU ranks are timed all
at once (each has its own GPU); CPU ranks share the node's cores, so they take turns.
`slow_rank` is for tests only (`--test-slow-rank`): that rank waits SLOW_FACTOR - 1 times its matmuls' time
inside each timing, so it reads as a GPU SLOW_FACTOR times slower.
"""
from __future__ import annotations

import statistics
import time

SIDE = {"cuda": 8192, "cpu": 512}
ITERS, REPEATS = 5, 10
STRAGGLER = 0.8   # a rank below 80% of the median is named (the threshold)
SLOW_FACTOR = 4.0


def measure(me: int, world: int, device, dtype, slow_rank: int | None) -> dict:
    """This rank's {"flops_per_s", "side", "dtype"}: the best of REPEATS windows of ITERS matmuls. GPU ranks time
    at once; CPU ranks take turns window by window (so a burst of other load hits every rank alike), with a
    barrier on the whole world after each turn. Every rank calls this."""
    import torch
    import torch.distributed as dist

    from .links import sync

    side = SIDE.get(device.type, SIDE["cuda"])
    a, b = (torch.randn(side, side, device=device).to(dtype) for _ in range(2))
    torch.matmul(a, b)  # warm-up: kernels chosen, memory allocated
    sync(device)

    def window() -> float:
        start = time.perf_counter()
        for _ in range(ITERS):
            torch.matmul(a, b)
        sync(device)
        elapsed = time.perf_counter() - start
        if me == slow_rank:
            time.sleep(elapsed * (SLOW_FACTOR - 1))
        return elapsed * (SLOW_FACTOR if me == slow_rank else 1)

    best = float("inf")
    for _ in range(REPEATS):
        for turn in range(world) if device.type != "cuda" else [me]:
            if turn == me:
                best = min(best, window())
            if device.type != "cuda":
                dist.barrier()
    return {"flops_per_s": 2 * side ** 3 * ITERS / best, "side": side, "dtype": str(dtype).removeprefix("torch.")}


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
