"""The planner's formulas against what the profiler counted on the same real 2-rank runs (fp32, AdamW).

The ~50M Llama runs at gradient accumulation 2: model states do not depend on it, and the same runs hold the
planner's communication at accumulation 2 (test_comm_agreement.py)."""
import pytest

AGREEING = ["ddp", "zero1", "zero2", "zero3", "fsdp_full_shard", "fsdp_shard_grad_op"]


@pytest.mark.launch
@pytest.mark.parametrize("model, accum", [("shard_llama", 1), ("llama_50m", 2)])
@pytest.mark.parametrize("config", AGREEING)
def test_planner_model_states_match_measured_bytes(config, model, accum, strategy_plans):
    summary, result = strategy_plans(config, model, grad_accum=accum)
    assert result["strategy"] == summary["strategy"] and result["world_size"] == 2
    for rank in result["ranks"]:
        for row in rank["components"]:
            assert row["measured"] == pytest.approx(row["planned"], rel=0.01), (rank["rank"], row)
