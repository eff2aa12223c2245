"""From the measured rows to findings: links below half their expected speed, the slowest node pair, stragglers.

Expected link speed (GPU runs only) is the step-time model's (`plan.time_model.hardware`: NVLink or PCIe per GPU inside a node,
the network per GPU across nodes), compared with the bus bandwidth at the largest size measured when that is
at least COMPARED_FROM (smaller messages never approach a link's speed). Without a
GPU nothing is expected; a group (or node pair) below half the median of its peers is still named when there
are at least three to compare (with two, neither is the odd one out).
"""
from __future__ import annotations

import statistics

SLOW_LINK = 0.5  # below half of the expected (or of the peers' median) bus bandwidth: a finding
MIN_PEERS = 3
COMPARED_FROM = 64 * 2 ** 20  # smaller messages are latency-bound: not held against a link's speed


def expected_links(gpu: str | None) -> dict | None:
    """{"intra", "inter", "source"} bytes/s per GPU, one direction, from the fit model's table; None on CPU."""
    if not gpu:
        return None
    from ..plan.time_model import hardware

    hw = hardware(gpu, "bf16", peak_tflops=0.0)  # only the link figures are read here
    return {"intra": hw.nvlink_bytes_per_s, "inter": hw.network_bytes_per_s, "pair": hw.network_bytes_per_s,
            "source": f"{hw.link_source or hw.gpu}; network {hw.network_bytes_per_s / 1e9:g} GB/s per GPU "
                      "(the fit model's assumption)"}


def gbps(value: float) -> str:
    return f"{value / 1e9:.3g} GB/s"


def largest(rows: list[dict]) -> list[dict]:
    """Rows at the largest size measured for their kind and scope."""
    top = {}
    for row in rows:
        key = (row["kind"], row["scope"])
        top[key] = max(top.get(key, 0), row["size_bytes"])
    return [row for row in rows if row["size_bytes"] == top[(row["kind"], row["scope"])]]


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


def exit_code(doc: dict) -> int:
    """0 when every member joined and nothing was found, else 1."""
    return 1 if doc["missing"] or doc["findings"] else 0
