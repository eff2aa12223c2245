"""The node check: one process per node, before any launcher (`srun --ntasks-per-node 1`, or by hand).

Node 0 hosts a TCPStore that waits for no one; each node connects, writes its fingerprint and waits for node
0's verdict. By the deadline every joined node prints one line naming the nodes that never joined and exits 1.
When all joined they form one process group (NCCL on GPU 0 of each node, else gloo), time collectives across
nodes and send/recv between every two nodes, and node 0 prints the table and writes preflight.json.
"""
from __future__ import annotations

import socket

from . import fingerprint, meet, output, session


def run(args) -> int:
    me, count = args.node_rank, args.nnodes
    deadline = args.started + args.timeout
    where = f"{args.master_addr}:{args.master_port}"
    try:
        store = meet.open_store(args.master_addr, args.master_port, me == 0, deadline)
    except meet.Unreachable as error:
        return say(me, 1, f"node 0 (the meeting point {where}) never answered within {args.timeout:g} s ({error}): "
                          "is it started, and is this address and port reachable from this node?")
    except RuntimeError as error:  # hosting: the port is taken, or the address is not this machine's
        return say(me, 1, f"cannot host the meeting point at {where}: {str(error).splitlines()[0]}")
    device = session.device_for(0)
    record = {"node": me, "host": socket.gethostname(), "fingerprint": fingerprint.collect(device)}
    try:
        joined, records = meet.meet(store, me, count, record, deadline)
    except meet.Unreachable as error:
        return say(me, 1, f"the meeting at {where} failed: {error}")
    if me not in joined:
        return say(me, 1, "joined after the deadline: node 0 closed the meeting without this node")
    hosts = dict(enumerate(args.hosts or []))
    missing = [{"node": m, "host": hosts.get(m)} for m in range(count) if m not in joined]
    measured = [], [], []
    if not missing and count > 1:
        args.compute = False  # the node check times links only; the full check measures compute
        measured = session.run_measurements(store, [records[m] for m in joined], me, args, device, args.timeout)
    outcome = None
    if me == 0:
        doc = session.document("node", records, count, missing, measured, args, device)
        path = output.write(doc, args.output_dir)
        print(output.table(doc), f"\nwrote {path}", flush=True)
        outcome = {"code": doc["exit_code"], "line": output.missing_line(doc)
                   + f"; {len(doc['findings'])} finding(s)" + (" (node 0 printed them)" if doc["findings"] else "")}
    elif missing:
        print(f"preflight node {me}: " + output.missing_line({"check": "node", "missing": missing, "expected": count}),
              flush=True)
    outcome = meet.finish(store, me, joined, outcome, wait_s=args.timeout)
    if outcome is None:
        return say(me, 1, "node 0 published no result (it stopped answering)")
    if me == 0 or missing:  # node 0 printed the table; a node with missing peers printed its line above
        return outcome["code"]
    return say(me, outcome["code"], outcome["line"])


def say(me: int, code: int, line: str) -> int:
    print(f"preflight node {me}: {line}", flush=True)
    return code
