"""Stragglers, in process: the summary's `straggler` from per-rank compute and wall time (measure/stragglers.py) and
the report's section naming it; the busiest rank from each rank's timed step breakdown (measure/time_breakdown.py).
Launched: test_hang_runs.py (a rank busy every step, named from the run itself); preflight's straggler finding:
test_preflight.py."""
import json

import pytest

from shardscope.measure import stragglers, time_breakdown
from shardscope.report import time_section
from shardscope.summary import SUMMARY_FILE, read_summary


# --- the summary's `straggler` from per-rank compute and wall time (measure/stragglers.py) --------------------------
def rank_entry(compute, wall=1.0):
    return {"throughput": {"compute_seconds": compute, "seconds": wall}, "time_breakdown": None}


def windows_of(*per_window):
    windows = stragglers.Windows()
    for values in per_window:
        windows.add([{"compute_seconds": v} for v in values])
    return windows


def test_a_rank_slower_than_the_median_in_most_windows_is_the_straggler_with_the_others_waiting_share():
    ranks = [rank_entry(0.4), rank_entry(0.4), rank_entry(0.9), rank_entry(0.42)]
    windows = windows_of([1, 1, 2, 1], [1, 1, 2, 1], [1, 1, 1.1, 1], [1, 1.05, 2, 1])
    result = stragglers.verdict(ranks, windows)
    assert result["straggler_rank"] == 2 and result["slow_windows"] == [0, 0, 3, 0] and result["windows"] == 4
    assert result["waiting_share"] == pytest.approx({"0": 0.5, "1": 0.5, "3": 0.48})  # (0.9 - compute) / wall
    assert stragglers.line(result).startswith("rank 2 is a straggler: 0.9 s computing vs the median 0.41 s")


@pytest.mark.parametrize("per_window", [
    ([1, 1.1], [1.1, 1], [1, 1.19]),  # within 20% of the median in every window
    ([1, 2], [1, 2]),  # slow, but over fewer than MIN_WINDOWS windows
    ([1, 2], [2, 1], [1, 2], [2, 1]),  # slow in half the windows only: not "most"
])
def test_no_straggler_without_a_persistent_slow_rank(per_window):
    result = stragglers.verdict([rank_entry(1.0), rank_entry(1.0)], windows_of(*per_window))
    assert result["straggler_rank"] is None and result["waiting_share"] is None and stragglers.line(result) is None


def test_without_every_ranks_compute_the_straggler_is_the_timed_steps_alone():
    timed = {"step_s": 1.0, "exposed_comm_s": 0.5}
    ranks = [{"throughput": {"compute_seconds": None, "seconds": 1.0}, "time_breakdown": timed}] * 2  # a GPU run
    assert set(stragglers.verdict(ranks, stragglers.Windows())) == {"busiest_rank", "step_s", "busy_s", "spread"}
    assert stragglers.verdict([rank_entry(1.0)], stragglers.Windows()) is None  # one rank: nobody to wait


def test_report_names_the_straggler_of_a_run():
    result = stragglers.verdict([rank_entry(0.2), rank_entry(0.6)], windows_of(*[[1, 2]] * 3))
    lines = time_section.markdown_lines([{"run": "ddp", "straggler": result}, {"run": "zero3", "straggler": None}],
                                        str)
    assert lines[0] == "## Stragglers" and lines[2].startswith("- ddp: rank 1 is a straggler") and len(lines) == 4


def test_a_summary_written_with_the_earlier_names_is_read_under_todays(tmp_path):
    """Earlier versions wrote `preflight_plan`, per rank `step_time_s` (the measured steps, a float in plan's rows), and
    in `straggler` `slowest_rank` (the timed step's busiest rank) and `rank` (the verdict's straggler), which can
    differ: `read_summary`, every reader's, gives them today's names,
    and the report names the verdict's straggler from such a summary."""
    old = {"schema_version": 1, "strategy": "ddp", "world_size": 2,
           "preflight_plan": {"strategy": "ddp", "peak_bytes": 123, "fits": True},
           "ranks": [{"params_bytes": 8, "grads_bytes": 8, "optimizer_bytes": 16,
                      "step_time_s": {"median": 1.1, "p10": 1.0, "p90": 1.2, "steps": 4}}] * 2,
           "straggler": {"slowest_rank": 0, "step_s": [1.0, 1.2], "busy_s": [0.9, 0.5], "spread": 0.18,
                         "compute_s": [0.2, 0.6], "wall_s": [1.0, 1.0], "windows": 3, "slow_windows": [0, 3],
                         "rank": 1, "waiting_share": {"0": 0.4}}}
    (tmp_path / SUMMARY_FILE).write_text(json.dumps(old))
    summary = read_summary(tmp_path / SUMMARY_FILE)
    assert summary["live_plan"] == old["preflight_plan"] and "preflight_plan" not in summary
    assert (summary["straggler"]["busiest_rank"], summary["straggler"]["straggler_rank"]) == (0, 1)
    assert not {"slowest_rank", "rank"} & set(summary["straggler"])
    assert [r["step_seconds"]["median"] for r in summary["ranks"]] == [1.1, 1.1]  # measured steps, not a prediction
    assert not any("step_time_s" in r for r in summary["ranks"])
    lines = time_section.straggler_lines([{"run": "old", **time_section.row_facts(summary)}])
    assert lines[2].startswith("- old: rank 1 is a straggler: 0.6 s computing")


# --- the busiest rank of the timed steps (measure/time_breakdown.py) ---------------------------------------------
def test_the_busiest_rank_of_the_timed_step_is_the_rank_that_waits_least():
    fast = dict.fromkeys(time_breakdown.BREAKDOWN, 0.0) | {"step_s": 1.0, "exposed_comm_s": 0.4}
    slow = fast | {"step_s": 1.1, "exposed_comm_s": 0.05}
    result = time_breakdown.across_ranks([fast, slow])
    assert result["busiest_rank"] == 1 and result["step_s"] == [1.0, 1.1]
    assert result["spread"] == pytest.approx(0.1 / 1.05)
    assert time_breakdown.across_ranks([fast, None]) is None
