"""A preflight's findings and its document: `preflight.json` (the schema: docs/cluster.md, "Before the first
multi-node run") and the table on stdout.

Findings: a fingerprint key whose value is not the same everywhere; links below half their expected speed (GPU
runs only: the step-time model's `plan.calibration.figures.hardware`, NVLink or PCIe per GPU inside a node, the
network per GPU across nodes), compared with the bus bandwidth at the largest size measured (`largest`, the reader's
rule: plan/calibration/preflight_json.py) when that is at least COMPARED_FROM (smaller messages never approach a
link's speed); without a GPU nothing is expected, and a group (or node pair) below half the median of its peers is
still named when there are at least three to compare (with two, neither is the odd one out); a rank whose matmul
FLOP/s is below STRAGGLER of the median (a straggler).

The document's top-level keys: `schema_version`, `check` ("node" or "full"), `backend`, `dtype`, `sizes_bytes`,
`expected` (members expected), `nodes` (node check) or `ranks` (full check) with each member's fingerprint,
`missing`, `links` (one row per collective x scope x group x size, and per ordered node pair), `slowest_pair`,
`expected_links`, `compute` (one row per rank), `findings`, `exit_code`.
"""
from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from pathlib import Path

from ..plan.calibration.preflight_json import PREFLIGHT_FILE, SCHEMA_VERSION, largest
from ..safe_io import atomic_write_text

SLOW_LINK = 0.5  # below half of the expected (or of the peers' median) bus bandwidth: a finding
MIN_PEERS = 3
COMPARED_FROM = 64 * 2 ** 20  # smaller messages are latency-bound: not held against a link's speed
STRAGGLER = 0.8   # a rank below 80% of the median matmul FLOP/s is named
UNSET = "(unset)"
NOT_COMPARED = ("host",)  # differs on every node by design


# --- findings ------------------------------------------------------------------------------------------------------
def fingerprint_findings(prints: dict[int, dict[str, str]], who: str = "node", where=None) -> list[dict]:
    """One finding per key whose value is not the same everywhere: the key, the odd members, the majority value
    (on a tie, the value of the lowest-numbered member). `where(member)` adds e.g. a rank's node to its name."""
    found = []
    keys = sorted({k for values in prints.values() for k in values} - set(NOT_COMPARED))
    for key in keys:
        seen = {member: values.get(key, UNSET) for member, values in sorted(prints.items())}
        if len(set(seen.values())) < 2:
            continue
        counts = Counter(seen.values())
        order = list(dict.fromkeys(seen.values()))  # first seen first: the tie-break
        majority = max(order, key=lambda value: (counts[value], -order.index(value)))
        odd = [member for member, value in seen.items() if value != majority]
        named = ", ".join(f"{who} {m}{where(m) if where else ''} has {seen[m]!r}" for m in odd)
        found.append({"code": "fingerprint", "key": key, who + "s": odd,
                      "values": {str(m): seen[m] for m in odd}, "majority": majority,
                      "message": f"{key} differs: {named}; the majority ({counts[majority]} of {len(seen)}) has "
                                 f"{majority!r}"})
    return found


def expected_links(gpu: str | None) -> dict | None:
    """{"intra", "inter", "source"} bytes/s per GPU, one direction, from the fit model's table; None on CPU."""
    if not gpu:
        return None
    from ..plan.calibration.figures import hardware

    hw = hardware(gpu, "bf16", peak_tflops=0.0)  # only the link figures are read here
    return {"intra": hw.nvlink_bytes_per_s, "inter": hw.network_bytes_per_s, "pair": hw.network_bytes_per_s,
            "source": f"{hw.link_source or hw.gpu}; network {hw.network_bytes_per_s / 1e9:g} GB/s per GPU "
                      "(the fit model's assumption)"}


def gbps(value: float) -> str:
    return f"{value / 1e9:.3g} GB/s"


def pairs(rows: list[dict]) -> dict[tuple[int, int], float]:
    """Unordered node pair -> the slower of its two directions (bytes/s)."""
    found = {}
    for row in rows:
        if row["scope"] == "pair":
            pair = tuple(sorted(row["nodes"]))
            found[pair] = min(found.get(pair, float("inf")), row["busbw_bytes_per_s"])
    return found


def slowest_pair(rows: list[dict]) -> dict | None:
    measured = pairs(largest(rows))
    if not measured:
        return None
    pair = min(measured, key=measured.get)
    return {"nodes": list(pair), "busbw_bytes_per_s": measured[pair], "pairs_measured": len(measured)}


def link_findings(rows: list[dict], expected: dict | None) -> list[dict]:
    """Links below SLOW_LINK of the expected speed, or of their peers' median (module docstring)."""
    found, top = [], largest(rows)
    size = max((row["size_bytes"] for row in top), default=0)
    measured = [(f"nodes {a} and {b}", "pair", "send_recv", value) for (a, b), value in pairs(top).items()]
    measured += [(f"node {row['nodes'][0]}" if row["scope"] == "intra" else f"ranks {row['ranks']}", row["scope"],
                  row["kind"], row["busbw_bytes_per_s"]) for row in top if row["scope"] != "pair"]
    for kind, scope in dict.fromkeys((k, s) for _, s, k, _ in measured):
        peers = [(who, value) for who, s, k, value in measured if (k, s) == (kind, scope)]
        median = statistics.median(v for _, v in peers)
        for who, value in peers:
            if expected and size >= COMPARED_FROM and value < SLOW_LINK * expected[scope]:
                than = f"under half the expected {gbps(expected[scope])} ({expected['source']})"
            elif len(peers) >= MIN_PEERS and value < SLOW_LINK * median:
                than = f"under half the median {gbps(median)} of the {len(peers)} measured"
            else:
                continue
            found.append({"code": "slow-link", "key": f"{kind}/{scope}", "who": who, "value": value,
                          "message": f"{kind} {scope} ({who}): bus bandwidth {gbps(value)}, {than}; check the "
                                     "interface NCCL uses (NCCL_DEBUG=INFO, NCCL_SOCKET_IFNAME, InfiniBand/RoCE "
                                     "status: ibstat)"})
    return found


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


def exit_code(doc: dict) -> int:
    """0 when every member joined and nothing was found, else 1."""
    return 1 if doc["missing"] or doc["findings"] else 0


# --- the document and the table ---------------------------------------------------------------------------------
def document(check: str, records: dict[int, dict], expected: int, missing: list[dict], measured: tuple,
             dtype: str, sizes: list[int], device) -> dict:
    """The preflight.json document (schema in the module docstring) with its findings and exit code; `dtype` as
    torch names it, `sizes` the message sizes timed."""
    rows, flops, failed = measured
    who = "node" if check == "node" else "rank"
    members = [records[m] for m in sorted(records)]
    gpu = members[0]["fingerprint"].get("gpu") if device.type == "cuda" and members else None
    links_expected = expected_links(gpu)
    where = None if check == "node" else (lambda rank: f" (node {records[rank]['node']})")
    findings = fingerprint_findings({m: records[m]["fingerprint"] for m in records}, who, where)
    findings += failed + link_findings(rows, links_expected)
    findings += stragglers({c["rank"]: c["flops_per_s"] for c in flops}, lambda rank: f" (node {records[rank]['node']})")
    doc = {"schema_version": SCHEMA_VERSION, "check": check, "backend": "nccl" if device.type == "cuda" else "gloo",
           "dtype": dtype, "sizes_bytes": sorted(sizes), "expected": expected, who + "s": members,
           "missing": missing,
           "links": rows, "slowest_pair": slowest_pair(rows), "expected_links": links_expected,
           "compute": flops, "findings": findings, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    doc["exit_code"] = exit_code(doc)
    return doc


def write(doc: dict, output_dir: Path) -> Path:
    return atomic_write_text(Path(output_dir) / PREFLIGHT_FILE, json.dumps(doc, indent=1, sort_keys=False) + "\n",
                             "preflight output")


def flops_text(value: float) -> str:
    return f"{value / 1e12:.3g} TFLOP/s" if value >= 1e12 else f"{value / 1e9:.3g} GFLOP/s"


def missing_line(doc: dict) -> str:
    who = "node" if doc["check"] == "node" else "rank"
    if not doc["missing"]:
        return f"all {doc['expected']} {who}s joined"
    named = ", ".join(f"{who} {m[who]}" + (f" ({m['host']})" if m.get("host") else "") for m in doc["missing"])
    return f"{len(doc['missing'])} of {doc['expected']} {who}s never joined by the deadline: {named}"


def link_table(doc: dict) -> list[str]:
    rows = [r for r in doc["links"] if r["scope"] != "pair"]
    if not rows:
        return []
    sizes = sorted({r["size_bytes"] for r in rows})
    lines = ["links: bus bandwidth of the slowest group (nccl-tests' convention), by message size",
             f"  {'collective':<15}{'scope':<7}{'groups':>7}" + "".join(f"{s / 2 ** 20:>10.3g}MiB" for s in sizes)]
    for kind, scope in dict.fromkeys((r["kind"], r["scope"]) for r in rows):
        mine = [r for r in rows if (r["kind"], r["scope"]) == (kind, scope)]
        cells = []
        for size in sizes:
            values = [r["busbw_bytes_per_s"] for r in mine if r["size_bytes"] == size]
            cells.append(f"{gbps(min(values)):>13}" if values else f"{'-':>13}")
        lines.append(f"  {kind:<15}{scope:<7}{len({r['group'] for r in mine}):>7}" + "".join(cells))
    return lines


def table(doc: dict) -> str:
    """The report node 0 / rank 0 prints."""
    members = doc.get("nodes") or doc.get("ranks") or []
    nodes = len({m["node"] for m in members})
    shape = (f"{nodes} node(s)" if doc["check"] == "node" else f"{len(members)} rank(s) on {nodes} node(s)")
    lines = [f"shardscope preflight ({doc['check']} check): {shape}, {doc['backend']}, {doc['dtype']}; "
             + missing_line(doc)]
    if not any(f["code"] == "fingerprint" for f in doc["findings"]) and members:
        fp = members[0]["fingerprint"]
        lines.append("fingerprints equal everywhere: " + ", ".join(
            f"{k} {fp[k]}" for k in ("python", "torch", "cuda", "nccl", "gpu", "driver") if k in fp))
    lines += link_table(doc)
    if doc["slowest_pair"]:
        pair = doc["slowest_pair"]
        size = max(r["size_bytes"] for r in largest(doc["links"]) if r["scope"] == "pair")
        lines.append(f"node pairs (send/recv, {size / 2 ** 20:.3g} MiB each way): slowest nodes {pair['nodes'][0]} "
                     f"and {pair['nodes'][1]} at {gbps(pair['busbw_bytes_per_s'])} "
                     f"({pair['pairs_measured']} pair(s) measured)")
    if doc["compute"]:
        first = doc["compute"][0]
        lines.append(f"compute: matmul {first['side']}x{first['side']} {first['dtype']}, per rank: " + ", ".join(
            f"{c['rank']}: {flops_text(c['flops_per_s'])}" for c in doc["compute"]))
    lines.append(f"findings: {len(doc['findings'])}" if doc["findings"] else "findings: none")
    lines += [f"  - {f['code']}: {f['message']}" for f in doc["findings"]]
    return "\n".join(lines)
