"""What a bf16-mixed run holds, checked the same way for the strategy runs (test_precision_runs) and the
recipes' own runs (test_recipes)."""
from __future__ import annotations

import pytest

from shardscope import plan_vs_run

# Counted bytes against the planner: Adam's step counters and ZeRO-3's persistent tensors are the only
# bytes the planner's rows approximate, well under 1% on these models.
BYTES_REL = 0.01
BF16_OK = {"configured": "bf16-mixed", "effective": "bf16-mixed", "ok": True, "reason": None}


def assert_bf16_mixed_ranks(summary: dict, zero: bool) -> None:
    """Every rank computed in bf16; ZeRO holds 16-bit weights and grads beside an fp32 master partition,
    torch strategies keep fp32 weights that are their own master (accelerate upcasts FSDP's params:
    accelerate #3979 stays fixed)."""
    for rank in summary["ranks"]:
        assert rank["compute_dtype"] == "bf16"
        if zero:
            assert rank["dtypes"] == {"params": "bf16", "grads": "bf16", "optimizer": "fp32", "master_params": "fp32"}
            # master 4 of the 12 optimizer bytes per trainable parameter (plus Adam's few step counters)
            assert rank["master_params_bytes"] == pytest.approx(rank["optimizer_bytes"] / 3, rel=BYTES_REL)
        else:
            assert rank["dtypes"] == {"params": "fp32", "grads": "fp32", "optimizer": "fp32", "master_params": None}
            assert rank["master_params_bytes"] == 0


def assert_bytes_match_planner(path) -> None:
    """Each category's heaviest rank equals the planner's row for the run's precision (ZeRO-2's ranks
    differ by the whole gradients straddling their partition edges; the planner gives the heaviest)."""
    result = plan_vs_run(path)
    for component in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        rows = [c for r in result["ranks"] for c in r["components"] if c["component"] == component]
        measured = max(c["measured"] for c in rows)
        assert measured == pytest.approx(rows[0]["planned"], rel=BYTES_REL), (component, rows)
