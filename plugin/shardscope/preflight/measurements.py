"""What each member of a preflight measures: its fingerprint, the links' bus bandwidth, its matmul FLOP/s.

Fingerprint: the machine facts a calibration depends on (`plan/calibration/calibration_json.py`'s `this_machine`:
host, GPU and count, backend, CUDA, library versions), doctor's cluster fingerprint (`doctor/cluster.py`'s
`fingerprint_values`: the variables and library versions that must be equal on every node) and what only a process
on the node can see: Python, peft, NCCL, the GPU's memory and the driver, and every `*_SOCKET_IFNAME` variable.

Links: collectives inside each node and across nodes, and send/recv between every pair of nodes. Bus bandwidth
and one collective's timing: `measure.collective_timing` (nccl-tests' convention). Pairs: in round d = 1..N-1 every
node sends to node k+d and receives from node k-d at once (N-1 rounds cover every ordered pair); a pair's figure
is bytes/s one way.

Compute: a square matmul of side n costs 2·n³ FLOPs. The figure is the best of MATMUL_REPEATS windows of
MATMUL_ITERS matmuls (the best, because anything else running on the machine only ever slows a timing down). GPU
ranks are timed at once (each has its own GPU), in wall time after a synchronize. CPU ranks share the node's cores:
they take turns, and a window is timed in the process's CPU time, so that a rank descheduled by other load does not
read as a slow rank (on CPU the figure is FLOPs per CPU-second of the rank). `slow_rank` is for tests only
(`--test-slow-rank`): that rank computes every matmul SLOW_FACTOR times and counts it once, so it is really
SLOW_FACTOR times slower, in wall and CPU time alike.
"""
from __future__ import annotations

import os
import platform
import time
from importlib import metadata
from pathlib import Path

from ..doctor.cluster import fingerprint_values
from ..measure.collective_timing import ITERS, KINDS, buffers_for, bus_bandwidth, slowest, sync, time_collective
from ..plan.calibration.calibration_json import this_machine

DRIVER_FILE = Path("/proc/driver/nvidia/version")
SIDE = {"cuda": 8192, "cpu": 512}
MATMUL_ITERS, MATMUL_REPEATS = 5, 10
SLOW_FACTOR = 4


# --- the fingerprint ---------------------------------------------------------------------------------------------
def fingerprint(device=None, env=os.environ) -> dict[str, str]:
    """This process's fingerprint, every value a string; `device` is the GPU this process uses (None: the first)."""
    import torch

    values = {**this_machine(device), "python": platform.python_version(), **fingerprint_values(env)}
    values.update({name: env[name] for name in env if name.endswith("_SOCKET_IFNAME")})
    try:
        values["peft"] = metadata.version("peft")
    except metadata.PackageNotFoundError:
        pass
    if torch.cuda.is_available():
        index = torch.cuda.current_device() if device is None else torch.device(device).index or 0
        values.update({"nccl": ".".join(map(str, torch.cuda.nccl.version())), "driver": driver_version(),
                       "gpu_memory": f"{torch.cuda.get_device_properties(index).total_memory / 2 ** 30:.1f} GiB"})
    return values


def driver_version() -> str:
    """The NVIDIA kernel driver's version from /proc (no nvidia-smi needed), or 'unknown'."""
    try:
        words = DRIVER_FILE.read_text().split()
    except OSError:
        return "unknown"
    return next((w for w in words if w.count(".") >= 1 and w.replace(".", "").isdigit()), "unknown")


# --- links --------------------------------------------------------------------------------------------------------
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


# --- compute ------------------------------------------------------------------------------------------------------
def matmul_flops(me: int, world: int, device, dtype, slow_rank: int | None) -> dict:
    """This rank's {"flops_per_s", "side", "dtype", "clock"}: the best of MATMUL_REPEATS windows of MATMUL_ITERS
    matmuls. GPU
    ranks time at once; CPU ranks take turns window by window, with a barrier on the whole world after each
    turn. Every rank calls this."""
    import torch
    import torch.distributed as dist

    side = SIDE.get(device.type, SIDE["cuda"])
    a, b = (torch.randn(side, side, device=device).to(dtype) for _ in range(2))
    torch.matmul(a, b)  # warm-up: kernels chosen, memory allocated
    sync(device)
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    calls = MATMUL_ITERS * (SLOW_FACTOR if me == slow_rank else 1)

    def window() -> float:
        start = clock()
        for _ in range(calls):
            torch.matmul(a, b)
        sync(device)
        return clock() - start

    best = float("inf")
    for _ in range(MATMUL_REPEATS):
        for turn in range(world) if device.type != "cuda" else [me]:
            if turn == me:
                best = min(best, window())
            if device.type != "cuda":
                dist.barrier()
    return {"flops_per_s": 2 * side ** 3 * MATMUL_ITERS / best, "side": side, "dtype": str(dtype).removeprefix("torch."),
            "clock": "wall" if device.type == "cuda" else "cpu"}
