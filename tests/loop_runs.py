"""The loop workers' launches, shared by test_profile_loops.py and test_loop_shapes.py (tests/conftest.py registers
the fixture and keeps both files on one xdist worker): per accelerate config, tests/workers/train_trl.py (folder
`CONFIG/trl`), then tests/workers/loop_shapes.py (folder `CONFIG/shapes`), one after the other in one launch
(tests/workers/several_runs.py), so the launch's start-up is paid once for both; the DeepSpeed configs share one
launch, each run in its config's launch environment (several_runs.py --launch_config).
"""
import pytest

from launch import ROOT, SharedLaunches, launch_together

WORKERS = ROOT / "tests" / "workers"
ACCELERATE = ROOT / "accelerate_configs"
TRL_STEPS = 12  # train_trl.py: 12 optimizer steps of 2 samples (pairs, for DPO) per rank
SHAPES = ("sft", "dpo", "dpo_lora", "grpo", "reward", "twice", "checkpointing_reentrant", "checkpointing",
          "compiled", "dinov2", "accelerate_loop", "fsdp2_loop")
SHAPE_CONFIGS = ("ddp", "zero2", "zero3")
# The raw FSDP2 loop is a strategy of its own (`fully_shard` over the launched process group): it runs in the DDP
# launch. Under a DeepSpeed launch transformers builds every model ZeRO-3-partitioned, which `fully_shard` cannot take.
SHAPES_OF = {config: SHAPES if config == "ddp" else SHAPES[:-1] for config in SHAPE_CONFIGS}
# The TRL runs (the Accelerate loop, SFT, DPO; LoRA-DPO under DDP) first: they time their Trainer's set-up.
TRL_CONFIGS = ("ddp", "zero3")
# One launch (under the first): ZeRO-3's TRL runs time their Trainer's set-up first. Not DDP's launch: after DDP's
# shapes (a raw fully_shard loop, a compiled model) in one process, ZeRO-3's TRL run lost a rank (seen, not traced).
DEEPSPEED = ("zero3", "zero2")


def runs_of(config: str, assets: dict) -> list[tuple]:
    """`config`'s runs (launch.launch_together): its TRL run (folder `CONFIG/trl`), then its shapes (`CONFIG/shapes`)"""
    yaml = ACCELERATE / f"{config}.yaml"
    trl = ["--steps", TRL_STEPS, "--loop", *(["--lora"] if config == "ddp" else [])]
    shapes = ["--shapes", *SHAPES_OF[config], "--model", assets["model"], "--dinov2", assets["dinov2"]]
    return [*([(f"{config}/trl", yaml, WORKERS / "train_trl.py", trl)] if config in TRL_CONFIGS else []),
            *([(f"{config}/shapes", yaml, WORKERS / "loop_shapes.py", shapes)] if config in SHAPE_CONFIGS else [])]


@pytest.fixture(scope="session")
def loop_runs(tmp_path_factory):
    """`loop_runs(config)`: the folder of `config`'s runs (accelerate_configs/<config>.yaml), launched once."""
    from shardscope.recipes.tiny import make_dinov2, make_sft_assets

    root = tmp_path_factory.mktemp("loop_assets")
    # loop_shapes.py's models: examples/trl_dpo.py's tiny Llama (its MLP wide enough for ZeRO-3 to shard), a DINOv2
    assets = {"model": make_sft_assets(root, "llama", n=64, intermediate_size=1600)["model"],
              "dinov2": root / "tiny-dinov2"}
    make_dinov2(assets["dinov2"], num_labels=4, intermediate_size=1600)

    def launch(configs):
        out = tmp_path_factory.mktemp(f"loops-{configs[0]}")
        for run in launch_together([run for c in configs for run in runs_of(c, assets)], out).values():
            run.check()
        return {c: out / c for c in configs}

    return SharedLaunches([DEEPSPEED], launch)
