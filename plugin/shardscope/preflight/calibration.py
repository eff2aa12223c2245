"""`calibration_from_preflight(path)`: what a preflight measured, in the shape a step-time model takes.

Per collective kind and scope ("intra": inside a node, "inter": across nodes; "send_recv"/"inter" from the
node pairs), the bus bandwidth at the largest message size measured, of the slowest group or pair (a
collective over many groups finishes with its slowest one); per rank, the achieved matmul FLOP/s.
"""
from __future__ import annotations

from ..errors import UsageError
from ..safe_io import load_json
from .report import SCHEMA_VERSION, largest


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
