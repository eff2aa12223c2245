"""`preflight.json` (its schema: docs/cluster.md, "Before the first multi-node run") and the table on stdout.

Top-level keys: `schema_version`, `check` ("node" or "full"), `backend`, `dtype`, `sizes_bytes`, `expected`
(members expected), `nodes` (node check) or `ranks` (full check) with each member's fingerprint, `missing`,
`links` (one row per collective x scope x group x size, and per ordered node pair), `slowest_pair`,
`expected_links`, `compute` (one row per rank), `findings`, `exit_code`.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..safe_io import atomic_write_text
from .verdict import gbps, largest

FILE = "preflight.json"
SCHEMA_VERSION = 1


def write(doc: dict, output_dir: Path) -> Path:
    return atomic_write_text(Path(output_dir) / FILE, json.dumps(doc, indent=1, sort_keys=False) + "\n",
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
