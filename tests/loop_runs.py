"""The loop workers' launches, shared by test_profile_loops.py and test_loop_shapes.py (tests/conftest.py registers
the fixture and keeps both files on one xdist worker): per accelerate config, one launch runs
tests/workers/train_trl.py (folder `trl`), then tests/workers/loop_shapes.py (folder `shapes`), one after the other
(tests/workers/several_runs.py), so the launch's start-up is paid once for both.
"""
import pytest

from launch import ROOT, accelerate_launch

WORKERS = ROOT / "tests" / "workers"
TRL_STEPS = 12  # train_trl.py: 12 optimizer steps of 2 samples (pairs, for DPO) per rank
SHAPES = ("sft", "dpo", "dpo_lora", "grpo", "reward", "twice", "checkpointing_reentrant", "checkpointing",
          "compiled", "dinov2", "accelerate_loop", "fsdp2_loop")
SHAPE_CONFIGS = ("ddp", "zero2", "zero3")
# The raw FSDP2 loop is a strategy of its own (`fully_shard` over the launched process group): it runs in the DDP
# launch. Under a DeepSpeed launch transformers builds every model ZeRO-3-partitioned, which `fully_shard` cannot take.
SHAPES_OF = {config: SHAPES if config == "ddp" else SHAPES[:-1] for config in SHAPE_CONFIGS}
# The TRL runs (the Accelerate loop, SFT, DPO; LoRA-DPO under DDP) first: they time their Trainer's set-up.
TRL_CONFIGS = ("ddp", "zero3")


def runs_of(config: str, assets: dict) -> list:
    """The several_runs.py arguments of `config`'s launch: `--run NAME SCRIPT ARGS...` per worker."""
    trl = ["--steps", TRL_STEPS, "--loop", *(["--lora"] if config == "ddp" else [])]
    shapes = ["--shapes", *SHAPES_OF[config], "--model", assets["model"], "--dinov2", assets["dinov2"]]
    return [*(["--run", "trl", WORKERS / "train_trl.py", *trl] if config in TRL_CONFIGS else []),
            *(["--run", "shapes", WORKERS / "loop_shapes.py", *shapes] if config in SHAPE_CONFIGS else [])]


@pytest.fixture(scope="session")
def loop_runs(tmp_path_factory):
    """`loop_runs(config)`: the folder of the launch under accelerate_configs/<config>.yaml, launched once."""
    from shardscope.recipes.tiny import make_dinov2, make_sft_assets

    cache, root = {}, tmp_path_factory.mktemp("loop_assets")
    # loop_shapes.py's models: examples/trl_dpo.py's tiny Llama (its MLP wide enough for ZeRO-3 to shard), a DINOv2
    assets = {"model": make_sft_assets(root, "llama", n=64, intermediate_size=1600)["model"],
              "dinov2": root / "tiny-dinov2"}
    make_dinov2(assets["dinov2"], num_labels=4, intermediate_size=1600)

    def run(config):
        if config not in cache:
            out = tmp_path_factory.mktemp(f"loops-{config}")
            accelerate_launch(ROOT / "accelerate_configs" / f"{config}.yaml", WORKERS / "several_runs.py",
                              runs_of(config, assets), out).check()
            cache[config] = out
        return cache[config]

    return run
