"""Timing the links: collectives inside each node and across nodes, and send/recv between every pair of nodes.

Bus bandwidth and one collective's timing: `measure.collective_timing` (nccl-tests' convention). Pairs: in round
d = 1..N-1 every node sends to node k+d and receives from node k-d at once (N-1 rounds cover every ordered pair);
a pair's figure is bytes/s one way.
"""
from __future__ import annotations

import time

from ..measure.collective_timing import ITERS, KINDS, buffers_for, bus_bandwidth, slowest, sync, time_collective


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
                    seconds, real = time_collective(kind, buffers_for(size, len(ranks), device, dtype), group, device)
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
