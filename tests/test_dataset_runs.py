"""`plan --dataset` against the recipe trained on a generated long-tail dataset (tests/recipe_runs.py DATA_RUNS: 2 CPU
ranks, ZeRO-3 and FSDP2, padded to the longest row and padding-free, in the recipes' shared launch): the callback
measures the step that holds the data's worst micro-batch, and the plan's peak there is within BOUND of it."""
from __future__ import annotations

import json

import pytest

from recipe_runs import DATA_BATCH, DATA_MAX_LENGTH, DATA_RUNS
from shardscope.cli.entry import main
from shardscope.plan.mesh import Setup
from shardscope.report.plan_vs_run import plan_vs_run
from shardscope.summary import read_summary

BOUND = 0.05  # the issue's: planned worst-step peak within 5% of the measured worst step
MODES = {"longest": ("pad_longest", "padded"), "free": ("padding_free", "packed")}  # run name's end -> mode, inputs
ROWS = {"zero3": "zero3", "fsdp": "fsdp_full_shard"}  # run name's start -> plan's row


@pytest.fixture(scope="module")
def planned(long_tail_data, sft_assets):
    """`plan --dataset --json` of the runs' data and setup (2 ranks, fp32, their micro-batch and limit)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["plan", "--model", str(sft_assets["model"]), "--dataset", str(long_tail_data), "--gpus", "2",
                     "--precision", "fp32", "--micro-batch", str(DATA_BATCH), "--max-length", str(DATA_MAX_LENGTH),
                     "--json"])
    assert code == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("name", list(DATA_RUNS))
def test_the_planned_worst_step_peak_is_the_measured_worst_steps(recipe_runs, planned, sft_assets, name):
    run = recipe_runs("data", name)
    path = run.output_dir / "shardscope_summary.json"
    ranks = read_summary(path)["ranks"]
    mode, inputs = MODES[name.split("_")[1]]
    worst = planned["data"]["batching"][mode]["worst_micro_batch"]
    measured = max((r["worst_step"] for r in ranks), key=lambda w: w["peak_tensor_bytes"])
    # the callback measured the step that holds the data's worst micro-batch (its tracker follows each new largest)
    assert measured["padded_tokens"] == worst["tokens"], [r["measured_steps"] for r in ranks]
    assert all(r["padding_waste"] == 0 for r in ranks) if mode == "padding_free" else \
        any(r["padding_waste"] > 0 for r in ranks)
    # the plan of that step: the run's own library settings (the summary's), at the plan's worst micro-batch
    beside = plan_vs_run(path, setup=Setup(batch_inputs=inputs), model=str(sft_assets["model"]))
    rank = next(r for r in beside["ranks"] if r["peak"]["measured"]["peak_tensor_bytes"] == measured["peak_tensor_bytes"])
    assert (rank["peak"]["step"]["micro_batch"], rank["peak"]["step"]["seq_len"]) == (worst["rows"], worst["seq_len"])
    assert abs(rank["peak"]["error"]) <= BOUND, rank["peak"]
    if name.startswith("fsdp"):  # plan --dataset's own row (its default FSDP2 settings are the run's)
        row = planned["data"]["worst_step_peak_bytes"][mode][ROWS["fsdp"]]
        assert row == rank["peak"]["planned"]["peak_bytes"]


def test_report_plots_each_measured_steps_peak_against_its_tokens(recipe_runs, tmp_path):
    from PIL import Image

    from shardscope.report.compare import write_report

    dirs = [recipe_runs("data", name).output_dir for name in DATA_RUNS]
    rows = write_report(dirs, tmp_path / "report")
    for row, folder in zip(rows, dirs):
        ranks = read_summary(folder / "shardscope_summary.json")["ranks"]
        assert [s["peak_tensor_bytes"] for s in row["measured_steps"]] == [
            s["peak_tensor_bytes"] for r in ranks for s in r["measured_steps"]]
        assert len(row["measured_steps"]) >= 2  # the memory step on each rank, and any later record
    assert Image.open(tmp_path / "report" / "steps.png").size[0] > 0
    assert "![steps.png](steps.png)" in (tmp_path / "report" / "report.md").read_text()
