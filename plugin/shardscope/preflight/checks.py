"""The two checks of `shardscope preflight` and what they share (arguments: cli/preflight.py).

The node check: one process per node, before any launcher (`srun --ntasks-per-node 1`, or by hand). Node 0 hosts a
TCPStore that waits for no one; each node connects, writes its fingerprint and waits for node 0's verdict. By the
deadline every joined node prints one line naming the nodes that never joined and exits 1. When all joined they
form one process group (NCCL on GPU 0 of each node, else gloo), time collectives across nodes and send/recv between
every two nodes, and node 0 prints the table and writes preflight.json.

The full check, launched exactly like training: `torchrun ... -m shardscope preflight`, `accelerate launch
--config_file CFG -m shardscope preflight`, `deepspeed --hostfile H --no_local_rank --module shardscope preflight`
(the launcher otherwise puts --local_rank before the subcommand). Every rank meets in the launcher's store
(torchrun's agent store where the launcher has one, else one hosted by rank 0 at MASTER_ADDR:MASTER_PORT), so a
rank that never arrives is named by the deadline; then all ranks time the collectives inside and across nodes,
send/recv between nodes, and their matmul FLOP/s. Rank 0 prints the table and writes preflight.json; every rank
exits with the same code.

Both form their process group over the meeting's store (NCCL on GPUs, gloo on CPU) and run the measurements in it.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from . import meet
from .measurements import fingerprint, matmul_flops, measure_collectives, measure_pairs
from .report import document, missing_line, table, write

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass(frozen=True)
class PreflightOptions:
    """What `shardscope preflight` was asked, checked (cli/preflight.py builds it): `check` "node" or "full", the
    node check's place (`nnodes`, `node_rank`, `master_addr`, `master_port`, `hosts`), the deadline (`started` on
    time.monotonic's clock + `timeout` seconds), the message sizes in bytes, the dtype asked (None: the device's),
    where preflight.json goes, and the tests' slowed rank."""

    check: str
    timeout: float
    started: float
    output_dir: Path
    sizes: tuple[int, ...]
    dtype: str | None = None
    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int = 29500
    hosts: tuple[str, ...] | None = None
    slow_rank: int | None = None

    @property
    def deadline(self) -> float:
        return self.started + self.timeout

    @property
    def compute(self) -> bool:
        """The full check measures each rank's matmul FLOP/s; the node check times links only."""
        return self.check == "full"


def run(options: PreflightOptions) -> int:
    return node_check(options) if options.check == "node" else full_check(options)


# --- what both checks share ------------------------------------------------------------------------------------
def device_for(local_rank: int):
    import torch

    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def dtype_name(name: str | None, device) -> str:
    """--dtype as torch names it, or bf16 on GPUs and fp32 on CPU (where bf16 matmuls are slow emulation)."""
    return DTYPES[name or ("bf16" if device.type == "cuda" else "fp32")]


def run_measurements(store, members: list[dict], me: int, options: PreflightOptions, device) -> tuple[list, list, list]:
    """(link rows, compute rows, findings) of every member, gathered on all; the group is formed and destroyed
    here. A collective that fails or times out (the options' timeout) is a `link-failed` finding, not a traceback."""
    import torch
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(backend, store=dist.PrefixStore(meet.key("pg"), store), rank=me,
                                world_size=len(members), timeout=timedelta(seconds=options.timeout),
                                device_id=device if device.type == "cuda" else None)
        dtype = getattr(torch, dtype_name(options.dtype, device))
        rows = measure_collectives(members, me, list(options.sizes), device, dtype)
        rows += measure_pairs(members, me, max(options.sizes), device, dtype)
        mine = []
        if options.compute:
            figure = matmul_flops(me, len(members), device, dtype, options.slow_rank)
            mine = [{"rank": me, "node": members[me]["node"], **figure}]
        gathered = [None] * len(members)
        dist.all_gather_object(gathered, (rows, mine))
        return [r for rows, _ in gathered for r in rows], [c for _, mine in gathered for c in mine], []
    except RuntimeError as error:  # torch's DistError and the backends' errors
        return [], [], [{"code": "link-failed", "key": backend, "message": f"the {backend} process group failed on "
                         f"member {me} after the meeting: {str(error).splitlines()[0]}; check NCCL_DEBUG=INFO "
                         "and the *_SOCKET_IFNAME variables"}]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# --- the node check -------------------------------------------------------------------------------------------
def node_check(options: PreflightOptions) -> int:
    me, count, deadline = options.node_rank, options.nnodes, options.deadline
    where = f"{options.master_addr}:{options.master_port}"
    try:
        store = meet.open_store(options.master_addr, options.master_port, me == 0, deadline)
    except meet.Unreachable as error:
        return say_node(me, 1, f"node 0 (the meeting point {where}) never answered within {options.timeout:g} s ({error}): "
                          "is it started, and is this address and port reachable from this node?")
    except RuntimeError as error:  # hosting: the port is taken, or the address is not this machine's
        return say_node(me, 1, f"cannot host the meeting point at {where}: {str(error).splitlines()[0]}")
    device = device_for(0)
    record = {"node": me, "host": socket.gethostname(), "fingerprint": fingerprint(device)}
    try:
        joined, records = meet.meet(store, me, count, record, deadline)
    except meet.Unreachable as error:
        return say_node(me, 1, f"the meeting at {where} failed: {error}")
    if me not in joined:
        return say_node(me, 1, "joined after the deadline: node 0 closed the meeting without this node")
    hosts = dict(enumerate(options.hosts or []))
    missing = [{"node": m, "host": hosts.get(m)} for m in range(count) if m not in joined]
    measured = [], [], []
    if not missing and count > 1:
        measured = run_measurements(store, [records[m] for m in joined], me, options, device)
    outcome = None
    if me == 0:
        doc = document("node", records, count, missing, measured, dtype_name(options.dtype, device), options.sizes,
                       device)
        path = write(doc, options.output_dir)
        print(table(doc), f"\nwrote {path}", flush=True)
        outcome = {"code": doc["exit_code"], "line": missing_line(doc)
                   + f"; {len(doc['findings'])} finding(s)" + (" (node 0 printed them)" if doc["findings"] else "")}
    elif missing:
        print(f"preflight node {me}: " + missing_line({"check": "node", "missing": missing, "expected": count}),
              flush=True)
    outcome = meet.finish(store, me, joined, outcome, wait_s=options.timeout)
    if outcome is None:
        return say_node(me, 1, "node 0 published no result (it stopped answering)")
    if me == 0 or missing:  # node 0 printed the table; a node with missing peers printed its line above
        return outcome["code"]
    return say_node(me, outcome["code"], outcome["line"])


# --- the full check -------------------------------------------------------------------------------------------
def launched(env=os.environ) -> dict:
    """This process's place, from the launcher's variables (torchrun/accelerate: GROUP_RANK, LOCAL_WORLD_SIZE;
    the deepspeed launcher: CROSS_RANK, LOCAL_SIZE); no launcher: one rank alone."""
    rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    per_node = int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or world)
    node = env.get("GROUP_RANK") or env.get("CROSS_RANK")
    return {"rank": rank, "world": world, "local_rank": int(env.get("LOCAL_RANK", 0)), "per_node": per_node,
            "node": int(node) if node is not None else rank // per_node,
            "addr": env.get("MASTER_ADDR"), "port": int(env.get("MASTER_PORT", 0) or 0),
            "agent_store": env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"}


def open_store(place: dict, deadline: float):
    import torch.distributed as dist

    if place["world"] == 1 and not place["addr"]:
        return dist.HashStore()
    hosting = place["rank"] == 0 and not place["agent_store"]
    return meet.open_store(place["addr"], place["port"], hosting, deadline)


def full_check(options: PreflightOptions) -> int:
    place = launched()
    me, world = place["rank"], place["world"]
    if world > 1 and not place["addr"]:
        return say(me, 1, f"WORLD_SIZE={world} but no MASTER_ADDR: start it with torchrun, accelerate launch or "
                          "deepspeed")
    deadline = options.deadline
    try:
        store = open_store(place, deadline)
        device = device_for(place["local_rank"])
        record = {"rank": me, "node": place["node"], "local_rank": place["local_rank"],
                  "host": socket.gethostname(), "fingerprint": fingerprint(device)}
        joined, records = meet.meet(store, me, world, record, deadline)
    except (meet.Unreachable, RuntimeError) as error:
        return say(me, 1, f"the launcher's store at {place['addr']}:{place['port']} did not answer "
                          f"({str(error).splitlines()[0]})")
    if me not in joined:
        return say(me, 1, "arrived after the deadline: rank 0 closed the meeting without this rank")
    missing = [{"rank": r, "node": r // place["per_node"], "host": None} for r in range(world) if r not in joined]
    measured = [], [], []
    if not missing:
        measured = run_measurements(store, [records[r] for r in range(world)], me, options, device)
    outcome = None
    if me == 0:
        doc = document("full", records, world, missing, measured, dtype_name(options.dtype, device), options.sizes,
                       device)
        path = write(doc, options.output_dir)
        print(table(doc), f"\nwrote {path}", flush=True)
        outcome = {"code": doc["exit_code"]}
    outcome = meet.finish(store, me, joined, outcome, wait_s=options.timeout)
    return 1 if outcome is None else outcome["code"]


def say(me: int, code: int, line: str, who: str = "rank") -> int:
    print(f"preflight {who} {me}: {line}", flush=True)
    return code


def say_node(me: int, code: int, line: str) -> int:
    return say(me, code, line, "node")
