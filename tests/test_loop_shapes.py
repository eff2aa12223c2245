"""Never breaks training, whatever the loop: every shape of tests/workers/loop_shapes.py (TRL SFT, DPO full and LoRA,
GRPO, a reward model, two forwards per step, both checkpointing modes, torch.compile, DINOv2, the Accelerate and raw
FSDP2 loops) trained on 2 CPU ranks with and without the profiler, every instrument on at an early step. One launch
per strategy trains every shape one after another in one process group (after test_profile_loops' TRL runs, in the
same launch: tests/loop_runs.py).
"""
import json

import pytest
from loop_runs import SHAPE_CONFIGS as STRATEGIES
from loop_runs import SHAPES_OF

from shardscope.measure.peak import BREAKDOWN

STEPS = 4  # loop_shapes.STEPS
# What each instrument fills in every rank's summary entry (None there only with a reason in `instruments`).
FIELDS = {"memory": ("peak_tensor_bytes", "peak_breakdown", "peak_phase", "peak_step"),
          "collectives": ("comm", "comm_sent_bytes_per_step"), "step_time": ("time_breakdown",)}


@pytest.fixture(scope="module")
def shapes(loop_runs):
    """`shapes(config)`: the worker's folder in the launch under accelerate_configs/<config>.yaml
    (tests/loop_runs.py)."""
    return lambda config: loop_runs(config) / "shapes"


def results(folder):
    return [json.loads((folder / f"result_rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("config", STRATEGIES)
def test_every_step_finishes_and_the_profiler_changes_no_numerics(shapes, config):
    """The loss of every step and the trained weights are those of the same run without the profiler, bit for bit:
    the profiler only observes."""
    out = shapes(config)
    for shape in SHAPES_OF[config]:
        plain, profiled = results(out / shape / "plain"), results(out / shape / "profiled")
        for rank in range(2):
            assert len(profiled[rank]["losses"]) == STEPS, (shape, rank)
            assert profiled[rank] == plain[rank], (shape, rank)


@pytest.mark.parametrize("config", STRATEGIES)
def test_each_summary_is_complete_or_says_why_not(shapes, config):
    out = shapes(config)
    for shape in SHAPES_OF[config]:
        summary = json.loads((out / shape / "profiled" / "shardscope_summary.json").read_text())
        assert summary["global_step"] == STEPS and summary["world_size"] == 2, shape
        assert not (out / shape / "profiled" / "shardscope_hang").exists(), shape  # no hang record in a normal run
        assert (summary["straggler"] or {}).get("rank") is None, shape
        statuses = summary["instruments"]
        assert statuses == dict.fromkeys(statuses, "ok"), (shape, statuses)
        for rank in summary["ranks"]:
            assert all(rank[field] is not None for fields in FIELDS.values() for field in fields), (shape, rank)
            assert sum(rank["peak_breakdown"][part] for part in BREAKDOWN) == rank["peak_tensor_bytes"] > 0, shape
            assert rank["throughput"]["samples"] > 0 and rank["time_breakdown"]["step_s"] > 0, shape
            assert rank["comm_sent_bytes_per_step"] > 0, shape  # 2 ranks always exchange gradients
            # steps 1-3 carry the instruments: step 4 alone is timed as a plain step
            assert rank["step_seconds"]["steps"] == 1 and rank["step_seconds"]["median"] > 0, shape
