"""preflight.json read back: what a preflight measured, in the shape a step-time model takes, and its figures.

`calibration_from_preflight(path)`: per collective kind and scope ("intra": inside a node, "inter": across nodes;
"send_recv"/"inter" from the node pairs), the bus bandwidth at the largest message size measured, of the slowest
group or pair (a collective over many groups finishes with its slowest one); per rank, the achieved matmul FLOP/s.
`preflight_figures(record)`: flops_per_s = the slowest rank's matmul FLOP/s; bus bandwidth per kind inside a node;
the slowest across-node bandwidth as the network. preflight/ writes the file with this module's name, schema
version and "largest size" rule.
"""
from __future__ import annotations

from ...errors import UsageError
from ...safe_io import load_json

PREFLIGHT_FILE = "preflight.json"
SCHEMA_VERSION = 1


def largest(rows: list[dict]) -> list[dict]:
    """Rows at the largest size measured for their kind and scope."""
    top = {}
    for row in rows:
        key = (row["kind"], row["scope"])
        top[key] = max(top.get(key, 0), row["size_bytes"])
    return [row for row in rows if row["size_bytes"] == top[(row["kind"], row["scope"])]]


def calibration_from_preflight(path) -> dict:
    """{"link_bytes_per_s": {kind: {scope: bytes/s}}, "matmul_flops_per_s": {rank: FLOP/s}, "dtype", "backend",
    "source"}; a file that is not a preflight.json is one UsageError line naming it."""
    doc = load_json(path, "preflight file")
    where = f"preflight file {path}"
    if not isinstance(doc, dict) or doc.get("schema_version") != SCHEMA_VERSION:
        raise UsageError(f"{where}: not a preflight.json of schema version {SCHEMA_VERSION} (key 'schema_version')")
    try:
        links = {}
        for row in largest(doc["links"]):
            scope = "inter" if row["scope"] == "pair" else row["scope"]
            kind = links.setdefault(row["kind"], {})
            kind[scope] = min(kind.get(scope, float("inf")), float(row["busbw_bytes_per_s"]))
        flops = {int(c["rank"]): float(c["flops_per_s"]) for c in doc["compute"]}
        return {"link_bytes_per_s": links, "matmul_flops_per_s": flops, "dtype": doc["dtype"],
                "backend": doc["backend"], "source": str(path)}
    except (KeyError, TypeError, ValueError) as error:
        raise UsageError(f"{where}: malformed 'links' or 'compute' entry ({type(error).__name__}: {error})") from None


def preflight_figures(record: dict) -> dict:
    """The step-time model's figures from a preflight's measurements (`calibration_from_preflight`'s record)."""
    out = {}
    if record["matmul_flops_per_s"]:
        out["flops_per_s"] = min(record["matmul_flops_per_s"].values())
    intra = {k: v["intra"] for k, v in record["link_bytes_per_s"].items() if "intra" in v}
    if intra:
        out["bus_bytes_per_s"] = intra
    inter = [v["inter"] for v in record["link_bytes_per_s"].values() if "inter" in v]
    if inter:
        out["network_bytes_per_s"] = min(inter)
    return out
