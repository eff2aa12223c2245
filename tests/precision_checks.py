"""What a bf16-mixed run holds, checked the same way for the strategy runs (test_precision_runs) and the
recipes' own runs (test_recipes)."""
from __future__ import annotations

import pytest

from shardscope import plan_vs_run

# Counted bytes against the planner: Adam's step counters and ZeRO-3's persistent tensors are the only
# bytes the planner's rows approximate, well under 1% on these models.
BYTES_REL = 0.01
BF16_OK = {"configured": "bf16-mixed", "effective": "bf16-mixed", "ok": True, "reason": None}

# test_precision_runs' runs: tests/workers/train_tiny.py for PRECISION_STEPS steps with a precision flag, each in the
# strategy_runs launch of its accelerate config (tests/strategy_runs.py, shared_launches).
PRECISION_STEPS = 4
BF16 = {  # config -> (strategy in the summary, ZeRO?)
    "ddp": ("ddp", False),
    "fsdp_full_shard": ("fsdp_full_shard", False),   # FSDP2: MixedPrecisionPolicy
    "fsdp1_full_shard": ("fsdp_full_shard", False),  # FSDP1: MixedPrecision
    "zero1": ("zero1", True),
    "zero2": ("zero2", True),
    "zero3": ("zero3", True),
}
# The DDP runs differ only in the script's own flags (the fp32 reference is DDP's --fp16 run: test_precision_runs).
PRECISION_RUNS = {**{config: [("--bf16",)] for config in BF16},
                  "ddp": [("--fp16",), ("--bf16",), ("--bf16", "--dtype", "bfloat16")]}


def precision_flags(*flags) -> tuple:
    """train_tiny.py's arguments for a precision run, after strategy_runs' own (a repeated one overrides)."""
    return ("--max_steps", PRECISION_STEPS, *flags)


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
