"""What both checks share: the device and dtype of this process, the process group formed over the meeting's
store (NCCL on GPUs, gloo on CPU), the measurements run in it, and the document node 0 / rank 0 writes."""
from __future__ import annotations

import time
from datetime import timedelta

from . import compute, fingerprint, links, meet, verdict
from .output import SCHEMA_VERSION

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


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


def run_measurements(store, members: list[dict], me: int, args, device, timeout_s: float) -> tuple[list, list, list]:
    """(link rows, compute rows, findings) of every member, gathered on all; the group is formed and destroyed
    here. A collective that fails or times out (`timeout_s`) is a `link-failed` finding, not a traceback."""
    import torch
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(backend, store=dist.PrefixStore(meet.key("pg"), store), rank=me,
                                world_size=len(members), timeout=timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
        dtype = getattr(torch, dtype_name(args.dtype, device))
        rows = links.measure_collectives(members, me, args.sizes, device, dtype)
        rows += links.measure_pairs(members, me, max(args.sizes), device, dtype)
        mine = []
        if args.compute:
            figure = compute.measure(me, len(members), device, dtype, args.test_slow_rank)
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


def document(check: str, records: dict[int, dict], expected: int, missing: list[dict], measured: tuple,
             args, device) -> dict:
    """The preflight.json document (schema in output.py's docstring) with its findings and exit code."""
    rows, flops, failed = measured
    who = "node" if check == "node" else "rank"
    members = [records[m] for m in sorted(records)]
    gpu = members[0]["fingerprint"].get("gpu") if device.type == "cuda" and members else None
    expected_links = verdict.expected_links(gpu)
    where = None if check == "node" else (lambda rank: f" (node {records[rank]['node']})")
    findings = fingerprint.differences({m: records[m]["fingerprint"] for m in records}, who, where)
    findings += failed + verdict.link_findings(rows, expected_links)
    findings += compute.stragglers({c["rank"]: c["flops_per_s"] for c in flops},
                                   lambda rank: f" (node {records[rank]['node']})")
    doc = {"schema_version": SCHEMA_VERSION, "check": check, "backend": "nccl" if device.type == "cuda" else "gloo",
           "dtype": dtype_name(args.dtype, device),
           "sizes_bytes": sorted(args.sizes), "expected": expected, who + "s": members, "missing": missing,
           "links": rows, "slowest_pair": verdict.slowest_pair(rows), "expected_links": expected_links,
           "compute": flops, "findings": findings, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    doc["exit_code"] = verdict.exit_code(doc)
    return doc
