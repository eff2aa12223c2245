"""The full check, launched exactly like training: `torchrun ... -m shardscope preflight`, `accelerate launch
--config_file CFG -m shardscope preflight`, `deepspeed --hostfile H --no_local_rank
--module shardscope preflight` (the launcher otherwise puts --local_rank before the subcommand).

Every rank meets in the launcher's store (torchrun's agent store where the launcher has one, else one hosted
by rank 0 at MASTER_ADDR:MASTER_PORT), so a rank that never arrives is named by the deadline; then all ranks
time the collectives inside and across nodes, send/recv between nodes, and their matmul FLOP/s. Rank 0 prints
the table and writes preflight.json; every rank exits with the same code.
"""
from __future__ import annotations

import os
import socket

from . import fingerprint, meet, output, session


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


def run(args) -> int:
    place = launched()
    me, world = place["rank"], place["world"]
    if world > 1 and not place["addr"]:
        return say(me, 1, f"WORLD_SIZE={world} but no MASTER_ADDR: start it with torchrun, accelerate launch or "
                          "deepspeed")
    deadline = args.started + args.timeout
    try:
        store = open_store(place, deadline)
        device = session.device_for(place["local_rank"])
        record = {"rank": me, "node": place["node"], "local_rank": place["local_rank"],
                  "host": socket.gethostname(), "fingerprint": fingerprint.collect(device)}
        joined, records = meet.meet(store, me, world, record, deadline)
    except (meet.Unreachable, RuntimeError) as error:
        return say(me, 1, f"the launcher's store at {place['addr']}:{place['port']} did not answer "
                          f"({str(error).splitlines()[0]})")
    if me not in joined:
        return say(me, 1, "arrived after the deadline: rank 0 closed the meeting without this rank")
    missing = [{"rank": r, "node": r // place["per_node"], "host": None} for r in range(world) if r not in joined]
    measured = [], [], []
    if not missing:
        args.compute = True
        measured = session.run_measurements(store, [records[r] for r in range(world)], me, args, device,
                                            args.timeout)
    outcome = None
    if me == 0:
        doc = session.document("full", records, world, missing, measured, args, device)
        path = output.write(doc, args.output_dir)
        print(output.table(doc), f"\nwrote {path}", flush=True)
        outcome = {"code": doc["exit_code"]}
    outcome = meet.finish(store, me, joined, outcome, wait_s=args.timeout)
    return 1 if outcome is None else outcome["code"]


def say(me: int, code: int, line: str) -> int:
    print(f"preflight rank {me}: {line}", flush=True)
    return code
