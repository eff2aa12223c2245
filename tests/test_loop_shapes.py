"""Never breaks training, whatever the loop: every shape of tests/workers/loop_shapes.py (TRL SFT, DPO full and LoRA,
GRPO, a reward model, two forwards per step, both checkpointing modes, torch.compile, DINOv2, the Accelerate and raw
FSDP2 loops) trained on 2 CPU ranks with and without the profiler, every instrument on at an early step. One launch
per strategy trains every shape one after another in one process group.
"""
import json

import pytest
from launch import ROOT, accelerate_launch

from shardscope.measure.peak import BREAKDOWN

WORKER = ROOT / "tests" / "workers" / "loop_shapes.py"
STEPS = 4  # loop_shapes.STEPS
SHAPES = ("sft", "dpo", "dpo_lora", "grpo", "reward", "twice", "checkpointing_reentrant", "checkpointing",
          "compiled", "dinov2", "accelerate_loop", "fsdp2_loop")
STRATEGIES = ("ddp", "zero2", "zero3")
# The raw FSDP2 loop is a strategy of its own (`fully_shard` over the launched process group): it runs in the DDP
# launch. Under a DeepSpeed launch transformers builds every model ZeRO-3-partitioned, which `fully_shard` cannot take.
SHAPES_OF = {config: SHAPES if config == "ddp" else SHAPES[:-1] for config in STRATEGIES}
# What each instrument fills in every rank's summary entry (None there only with a reason in `instruments`).
FIELDS = {"memory": ("peak_tensor_bytes", "peak_breakdown", "peak_phase", "peak_step"),
          "collectives": ("comm", "comm_sent_bytes_per_step"), "step_time": ("time_breakdown",)}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """`shapes(config)`: the folder of one launch of the worker under accelerate_configs/<config>.yaml."""
    cache = {}

    def run(config):
        if config not in cache:
            out = tmp_path_factory.mktemp(f"shapes-{config}")
            accelerate_launch(ROOT / "accelerate_configs" / f"{config}.yaml", WORKER, ["--shapes", *SHAPES_OF[config]],
                              out).check()
            cache[config] = out
        return cache[config]

    return run


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
        statuses = summary["instruments"]
        assert statuses == dict.fromkeys(statuses, "ok"), (shape, statuses)
        for rank in summary["ranks"]:
            assert all(rank[field] is not None for fields in FIELDS.values() for field in fields), (shape, rank)
            assert sum(rank["peak_breakdown"][part] for part in BREAKDOWN) == rank["peak_tensor_bytes"] > 0, shape
            assert rank["throughput"]["samples"] > 0 and rank["time_breakdown"]["step_s"] > 0, shape
            assert rank["comm_sent_bytes_per_step"] > 0, shape  # 2 ranks always exchange gradients
            # steps 1-3 carry the instruments: step 4 alone is timed as a plain step
            assert rank["step_time_s"]["steps"] == 1 and rank["step_time_s"]["median"] > 0, shape
