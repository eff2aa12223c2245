"""The recipes' launched runs, shared by test_recipes.py and test_resume_world_size.py (tests/conftest.py registers
the fixtures and keeps both files on one xdist worker): runs under the same shipped config and launcher flags train
one after another in one launch (tests/workers/several_runs.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from launch import QLORA_ENV, ROOT, Run, SharedLaunches, accelerate_launch, deepspeed_launch, launch_together

SFT = ROOT / "recipes" / "causal_lm_sft.py"
IMAGE = ROOT / "recipes" / "image_classification.py"
ACC = ROOT / "accelerate_configs"
STEPS, SAVE_AT = 12, 6


@pytest.fixture(scope="session")
def image_assets(tmp_path_factory):
    from shardscope.recipes.tiny import COLOURS, make_dinov2, make_image_folder

    root = tmp_path_factory.mktemp("image_assets")
    make_dinov2(root / "tiny-dinov2", num_labels=len(COLOURS))
    return {"data": make_image_folder(root / "images"), "model": root / "tiny-dinov2"}


def sft_args(assets, *extra):
    return ["--config", ROOT / "recipes/llama/demo_tiny.yaml", "--model_name_or_path", assets["model"],
            "--dataset", assets["data"], "--max_steps", STEPS, "--save_final_logits", "true", *extra]


SFT_RUNS = {  # name -> (launcher, config, extra args)
    "ddp": ("accelerate", "ddp", ["--save_strategy", "steps", "--save_steps", SAVE_AT]),
    "fsdp": ("accelerate", "fsdp_full_shard", ["--save_strategy", "steps", "--save_steps", SAVE_AT]),
    # in bf16 (MixedPrecision): the recipe's bf16 run for a torch strategy, resumed like the fp32 ones
    "fsdp1": ("accelerate", "fsdp1_full_shard", ["--save_strategy", "steps", "--save_steps", SAVE_AT,
                                                 "--bf16", "true"]),
    "zero2": ("accelerate", "zero2", ["--gradient_checkpointing", "true"]),
    "zero3": ("accelerate", "zero3", ["--save_strategy", "steps", "--save_steps", SAVE_AT]),
    "ds_zero3": ("deepspeed", "zero3", []),
    "lora_zero3": ("accelerate", "zero3", ["--use_lora", "true", "--learning_rate", "1e-2"]),
    "lora_fsdp": ("accelerate", "fsdp_full_shard", ["--use_lora", "true", "--learning_rate", "1e-2",
                                                    "--gradient_checkpointing", "true"]),
    # QLoRA: a 4-bit NF4 base (bitsandbytes' CPU backend, double quantisation, bf16 storage), LoRA adapters trained
    "qlora_ddp": ("accelerate", "ddp", ["--use_lora", "true", "--load_in_4bit", "true", "--dtype", "bfloat16",
                                        "--bnb_4bit_quant_storage", "bfloat16", "--learning_rate", "1e-2"]),
    "qlora_fsdp": ("accelerate", "fsdp_qlora", ["--use_lora", "true", "--load_in_4bit", "true", "--dtype",
                                                "bfloat16", "--bnb_4bit_quant_storage", "bfloat16",
                                                "--learning_rate", "1e-2"]),
    "qlora_zero3": ("accelerate", "zero3", ["--use_lora", "true", "--load_in_4bit", "true", "--dtype", "bfloat16",
                                            "--bnb_4bit_quant_storage", "bfloat16", "--learning_rate", "1e-2"]),
}
# The launcher's precision agrees with the recipe's --bf16 (the CPU overrides say "no"; the recipe's doctor
# check refuses a launcher and Trainer that disagree).
SFT_LAUNCHER_ARGS = {"fsdp1": ["--mixed_precision", "bf16"]}
# test_dataset_runs' runs: the SFT recipe on a generated long-tail dataset (DATA_SAMPLES records, a share DATA_CAPPED
# at the longest), micro-batch DATA_BATCH, under ZeRO-3 and FSDP2, padded to the longest row and padding-free; 12 steps
# on 2 ranks read each record once. ZeRO-3 through ds_configs/zero3.json (its "auto" buckets: the Trainer's hidden
# size squared): the shipped yaml's DeepSpeed default 5e8-element reduce bucket would be 99% of the peak.
DATA_SAMPLES, DATA_CAPPED, DATA_BATCH, DATA_MAX_LENGTH = 48, 0.25, 2, 512
DATA_RUNS = {  # name: (config, recipe args)
    "zero3_longest": ("zero3_json", []), "zero3_free": ("zero3_json", ["--padding_free", "true"]),
    "fsdp_longest": ("fsdp_full_shard", []), "fsdp_free": ("fsdp_full_shard", ["--padding_free", "true"]),
}
IMAGE_RUNS = {  # name: (config, its fsdp_config overrides, recipe args)
    "ddp": ("ddp", {}, []),
    # in bf16: ZeRO's 16-bit weights beside an fp32 master; it saves the 16-bit model it computes with
    "zero2": ("zero2", {}, ["--bf16", "true"]),
    # accelerate 1.15's FSDP2 auto-wrap from `_no_split_modules` wraps Dinov2Embeddings, then shards its
    # patch embeddings a second time ("value was None" in DeviceMesh): name the layer class instead.
    "fsdp": ("fsdp_full_shard", {"fsdp_transformer_layer_cls_to_wrap": "Dinov2Layer"}, []),
    "zero3_frozen": ("zero3", {}, ["--freeze_backbone", "true", "--learning_rate", "1e-2"]),
}


# test_resume_world_size's uninterrupted 2-rank runs (kind "world"): per-device batch WORLD_GLOBAL / 2 and a
# checkpoint at SAVE_AT, under the shipped yaml WORLD_CONFIGS names with its fsdp_config overrides (FSDP2 saving
# SHARDED_STATE_DICT, i.e. DCP); its resumes at other world sizes are launches of their own.
WORLD_GLOBAL = 8
WORLD_CONFIGS = {"zero2": ("zero2", {}), "zero3": ("zero3", {}),
                 "fsdp2": ("fsdp_full_shard", {"fsdp_state_dict_type": "SHARDED_STATE_DICT"})}


@pytest.fixture(scope="session")
def accelerate_yaml(tmp_path_factory):
    """`accelerate_yaml(config, overrides)`: the shipped accelerate yaml, or a copy with its fsdp_config `overrides`
    (what a launcher flag would set, in a file: a run with it can share a launch)."""
    folder = tmp_path_factory.mktemp("accelerate_yamls")

    def path(config: str, overrides: dict) -> Path:
        if not overrides:
            return ACC / f"{config}.yaml"
        data = yaml.safe_load((ACC / f"{config}.yaml").read_text())
        data["fsdp_config"].update(overrides)
        derived = folder / f"{config}-{'-'.join(f'{k}={v}' for k, v in sorted(overrides.items()))}.yaml"
        derived.write_text(yaml.safe_dump(data))
        return derived

    return path


def world_args(assets, ranks, *extra):
    """The SFT recipe's arguments at `ranks` ranks and the global batch WORLD_GLOBAL."""
    return ["--config", ROOT / "recipes/llama/demo_tiny.yaml", "--model_name_or_path", assets["model"],
            "--dataset", assets["data"], "--max_steps", STEPS, "--per_device_train_batch_size", WORLD_GLOBAL // ranks,
            *extra]


# Runs train one after another in one launched process (tests/workers/several_runs.py): one launch instead of one
# each, each run in its own config's launch environment (launch.launch_together). Resumes come after the
# runs they resume, in a launch of their own; runs with launcher flags of their own (a shared launch has one set of
# flags) and the `deepspeed` launcher's run are launches of their own.
SHARED_LAUNCHES = {  # launch -> the (kind, name) runs it trains, in order, under the first run's config
    # ZeRO-2 before ZeRO-3: after the ZeRO-3 runs in the same process, the ZeRO-2 bf16 image run's saved model
    # reloaded with other logits (seen once, cause not traced; one run per process, as users run, is not affected)
    "runs": [("sft", "ddp"), ("image", "ddp"), ("sft", "qlora_ddp"), ("sft", "fsdp"), ("sft", "qlora_fsdp"),
             ("sft", "lora_fsdp"), ("image", "fsdp"), ("world", "fsdp2"), ("sft", "zero2"), ("image", "zero2"),
             ("world", "zero2"), ("sft", "zero3"), ("sft", "lora_zero3"), ("sft", "qlora_zero3"),
             ("image", "zero3_frozen"), ("world", "zero3"),
             ("data", "fsdp_longest"), ("data", "fsdp_free"), ("data", "zero3_longest"), ("data", "zero3_free")],
    # each resume a fresh Trainer reading the checkpoint files; bf16 FSDP1's apart (its launcher flag)
    "resumes": [("resume", "ddp"), ("resume", "fsdp"), ("resume", "zero3")],
}


def zero3_json_yaml(folder: Path) -> Path:
    """accelerate_configs/zero3.yaml reading its DeepSpeed settings from ds_configs/zero3.json (accelerate refuses
    any other deepspeed_config key beside the file)."""
    data = yaml.safe_load((ACC / "zero3.yaml").read_text())
    data["deepspeed_config"] = {"deepspeed_config_file": str(ROOT / "ds_configs" / "zero3.json")}
    path = Path(folder) / "zero3_json.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="session")
def long_tail_data(tmp_path_factory):
    """The data runs' generated long-tail dataset (jsonl, Alpaca columns; the sft model's words)."""
    from shardscope.recipes.tiny import make_long_tail_json

    return make_long_tail_json(tmp_path_factory.mktemp("long_tail") / "tail.jsonl", DATA_SAMPLES,
                               at_longest=DATA_CAPPED)


@pytest.fixture(scope="session")
def recipe_runs(tmp_path_factory, sft_assets, image_assets, accelerate_yaml, long_tail_data):
    """`recipe_runs(kind, name)` launches a run (with the others of its SHARED_LAUNCHES entry) the first time it is
    asked for and returns the cached `Run`; a resume starts from the sft run's step-SAVE_AT checkpoint."""

    def data_yaml(config: str) -> Path:
        return zero3_json_yaml(tmp_path_factory.mktemp("zero3_json")) if config == "zero3_json" else \
            ACC / f"{config}.yaml"

    def command(kind: str, name: str) -> tuple[Path, Path, list, list]:
        """(accelerate yaml, recipe, recipe arguments, launcher flags) of an sft, resume, image or world run."""
        if kind == "world":
            return accelerate_yaml(*WORLD_CONFIGS[name]), SFT, world_args(
                sft_assets, 2, "--save_strategy", "steps", "--save_steps", SAVE_AT), []
        if kind == "data":
            config, extra = DATA_RUNS[name]
            return data_yaml(config), SFT, [
                "--config", ROOT / "recipes/llama/demo_tiny.yaml", "--model_name_or_path", sft_assets["model"],
                "--dataset", long_tail_data, "--max_steps", STEPS, "--max_seq_length", DATA_MAX_LENGTH,
                "--per_device_train_batch_size", DATA_BATCH, *extra], []
        if kind in ("sft", "resume"):
            _, config, extra = SFT_RUNS[name]
            if kind == "resume":
                extra = [*extra, "--resume_from_checkpoint", get("sft", name).output_dir / f"checkpoint-{SAVE_AT}"]
            return ACC / f"{config}.yaml", SFT, sft_args(sft_assets, *extra), SFT_LAUNCHER_ARGS.get(name, [])
        config, overrides, extra = IMAGE_RUNS[name]
        return accelerate_yaml(config, overrides), IMAGE, [
            "--config", ROOT / "recipes/dinov2/demo_tiny.yaml", "--model_name_or_path", image_assets["model"],
            "--dataset", image_assets["data"], "--save_final_logits", "true", *extra], []

    def launch(keys: tuple) -> dict[tuple[str, str], Run]:
        out = tmp_path_factory.mktemp("_".join(keys[0]) if len(keys) == 1 else "shared")
        if len(keys) > 1:
            runs = []
            for k, n in keys:
                config, script, args, launcher_args = command(k, n)
                assert not launcher_args, f"{k} {n}: launcher flags of its own, not in a shared launch"
                runs.append((f"{k}_{n}", config, script, args))
            quantises = any("--load_in_4bit" in args for *_, args in runs)
            launched = launch_together(runs, out, env=QLORA_ENV if quantises else None)
            return {(k, n): launched[f"{k}_{n}"] for k, n in keys}
        (kind, name), = keys
        if kind == "sft" and SFT_RUNS[name][0] == "deepspeed":
            return {keys[0]: deepspeed_launch(SFT, sft_args(
                sft_assets, "--deepspeed", ROOT / "ds_configs/zero3.json", *SFT_RUNS[name][2]), out)}
        config, script, args, launcher_args = command(kind, name)  # a launch of its own
        return {keys[0]: accelerate_launch(config, script, args, out, launcher_args=launcher_args)}

    launches = SharedLaunches(SHARED_LAUNCHES.values(), launch)

    def get(kind: str, name: str) -> Run:
        return launches((kind, name)).check()

    return get
