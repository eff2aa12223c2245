"""Timing the links: collectives inside each node and across nodes, and send/recv between every pair of nodes.

Bus bandwidth follows nccl-tests' convention (its doc/PERFORMANCE.md), with `size` the whole buffer (all_reduce:
the tensor; all_gather: the gathered output; reduce_scatter: the input) and `n` ranks in the group:
    algbw = size / seconds;  busbw = algbw x 2(n-1)/n (all_reduce), x (n-1)/n (all_gather, reduce_scatter)
so that busbw is comparable to one link's speed whatever n is. A collective's time is the slowest rank's,
averaged over ITERS calls after WARMUP calls. Pairs: in round d = 1..N-1 every node sends to node k+d and
receives from node k-d at once (N-1 rounds cover every ordered pair); a pair's figure is bytes/s one way.
"""
from __future__ import annotations

import time

KINDS = ("all_reduce", "all_gather", "reduce_scatter")
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n}
WARMUP, ITERS = 2, 5


def bus_bandwidth(kind: str, size_bytes: int, seconds: float, ranks: int) -> float:
    """nccl-tests' bus bandwidth (bytes/s) of one collective call (formula in the module docstring)."""
    return size_bytes / seconds * BUS_FACTOR[kind](ranks)


def topology(members: list[dict]) -> tuple[dict[int, list[int]], dict[str, list[list[int]]]]:
    """(node -> its ranks, scope -> groups of ranks): "intra" one group per node with 2+ ranks, "inter" one group
    per local index across nodes (the i-th rank of every node), when there are 2+ nodes."""
    nodes: dict[int, list[int]] = {}
    for rank, member in enumerate(members):
        nodes.setdefault(member["node"], []).append(rank)
    groups = {"intra": [ranks for ranks in nodes.values() if len(ranks) > 1], "inter": []}
    if len(nodes) > 1:
        width = min(len(ranks) for ranks in nodes.values())
        groups["inter"] = [[ranks[i] for ranks in nodes.values()] for i in range(width)]
    return nodes, groups


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _call(kind: str, buffers, group) -> None:
    import torch.distributed as dist

    full, part = buffers
    if kind == "all_reduce":
        dist.all_reduce(full, group=group)
    elif kind == "all_gather":
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(full, part, group=group)
    else:  # torch 2.13 renamed the tensor forms *_single
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(part, full, group=group)


def time_collective(kind: str, size: int, group, ranks: int, device, dtype) -> tuple[float, int]:
    """(seconds per call, bytes of the whole buffer: `size` rounded down to a multiple of the ranks' elements)
    of one collective on `group`, this rank's view (the caller takes the slowest rank's)."""
    import torch
    import torch.distributed as dist

    element = torch.empty((), dtype=dtype).element_size()
    numel = max(size // element // ranks, 1) * ranks
    buffers = (torch.ones(numel, dtype=dtype, device=device), torch.ones(numel // ranks, dtype=dtype, device=device))
    for _ in range(WARMUP):
        _call(kind, buffers, group)
    sync(device)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(ITERS):
        _call(kind, buffers, group)
    sync(device)
    return (time.perf_counter() - start) / ITERS, numel * element


def slowest(seconds: float, group, device) -> float:
    """The slowest rank's seconds in `group` (every rank of it calls this)."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return float(value.item())


def measure_collectives(members: list[dict], me: int, sizes: list[int], device, dtype) -> list[dict]:
    """Rows of every collective x size, per group of each scope (recorded by the group's first rank). Every rank
    calls this: each group is made by all ranks, and the groups of one scope run at the same time."""
    import torch.distributed as dist

    _, scopes = topology(members)
    rows = []
    for scope, groups in scopes.items():
        handles = [dist.new_group(ranks) for ranks in groups]
        for index, (ranks, group) in enumerate(zip(groups, handles)):
            if me not in ranks:
                continue
            for kind in KINDS:
                for size in sizes:
                    seconds, real = time_collective(kind, size, group, len(ranks), device, dtype)
                    seconds = slowest(seconds, group, device)
                    if me == ranks[0]:
                        rows.append({"kind": kind, "scope": scope, "group": index, "ranks": ranks,
                                     "nodes": sorted({members[r]["node"] for r in ranks}), "size_bytes": real,
                                     "seconds": seconds,
                                     "busbw_bytes_per_s": bus_bandwidth(kind, real, seconds, len(ranks))})
        dist.barrier()
    return rows


def measure_pairs(members: list[dict], me: int, size: int, device, dtype) -> list[dict]:
    """Send/recv between the first ranks of every two nodes (rounds in the module docstring), `size` bytes each
    way; one row per ordered pair, recorded by the sender. Every rank calls this."""
    import torch
    import torch.distributed as dist

    nodes, _ = topology(members)
    leaders = [ranks[0] for _, ranks in sorted(nodes.items())]
    group = dist.new_group(leaders) if len(leaders) < len(members) else None
    if len(leaders) < 2 or me not in leaders:
        return []
    count, i = len(leaders), leaders.index(me)
    numel = max(size // torch.empty((), dtype=dtype).element_size(), 1)
    send, recv = (torch.ones(numel, dtype=dtype, device=device) for _ in range(2))
    rows = []
    for d in range(1, count):
        dst, src = leaders[(i + d) % count], leaders[(i - d) % count]

        def exchange():
            ops = [dist.P2POp(dist.isend, send, dst, group), dist.P2POp(dist.irecv, recv, src, group)]
            for request in dist.batch_isend_irecv(ops):
                request.wait()

        exchange()
        sync(device)
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(ITERS):
            exchange()
        sync(device)
        seconds = (time.perf_counter() - start) / ITERS
        rows.append({"kind": "send_recv", "scope": "pair", "nodes": [members[me]["node"], members[dst]["node"]],
                     "ranks": [me, dst], "size_bytes": send.numel() * send.element_size(), "seconds": seconds,
                     "busbw_bytes_per_s": send.numel() * send.element_size() / seconds})
    return rows
