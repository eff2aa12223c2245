"""doctor's DeepSpeed rules: a DeepSpeed JSON or an accelerate yaml's `deepspeed_config` section against
the Trainer's arguments, ZeRO-3 saving, offload (can it run here, and did the user mean it).

ZeRO settings are read with DeepSpeed's own `DeepSpeedZeroConfig`, so every alias and deprecated name
DeepSpeed accepts (`gather_16bit_weights_on_model_save` = `stage3_gather_16bit_weights_on_model_save`,
`cpu_offload`, ...) means what it means to DeepSpeed.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

from ..configs.files import strings_that_should_be_values
from .rules import Finding, get, is_true, read_raw

PRECISION_FLAGS = ("bf16", "fp16")
# accelerate yaml deepspeed_config key -> the DeepSpeed key DeepSpeedPlugin writes it to (no config file)
ACCELERATE_DS_KEYS = {"gradient_accumulation_steps": "gradient_accumulation_steps",
                      "gradient_clipping": "gradient_clipping", "zero_stage": "zero_optimization.stage",
                      "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
                      "offload_param_device": "zero_optimization.offload_param.device",
                      "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save"}
OFFLOAD_COST = {
    "offload_optimizer": "the fp32 master weights and Adam moments (12 bytes per parameter) live in CPU memory, "
                         "the optimizer step runs on the CPU (DeepSpeedCPUAdam) and every step copies gradients "
                         "and updated weights over PCIe",
    "offload_param": "parameters live in CPU memory and are copied to the GPU for every forward and backward",
}


def zero_settings(zero: dict):
    """`zero_optimization` as DeepSpeed reads it (aliases, deprecated names, defaults), or None if it
    cannot parse (the library loader reports why). "auto" values are left to their defaults."""
    if importlib.util.find_spec("deepspeed") is None or not isinstance(zero, dict):
        return None
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    def without_auto(d):
        return {k: without_auto(v) if isinstance(v, dict) else v for k, v in d.items() if v != "auto"}

    try:
        return DeepSpeedZeroConfig(**without_auto(zero))
    except Exception:
        return None


def planner_settings(zero: dict) -> dict:
    """The `LibraryKnobs` fields a `zero_optimization` section decides: what ZeRO-3 offloads, its sub-group size."""
    settings = zero_settings(zero)
    if settings is None:
        return {}
    moved = [s for s in ("offload_param", "offload_optimizer") if _device(getattr(settings, s)) in ("cpu", "nvme")]
    kind = {("offload_param",): "params", ("offload_optimizer",): "optimizer"}.get(tuple(moved), "all")
    return {"zero3_offload": kind, "zero_sub_group_size": int(settings.sub_group_size)}


def _device(offload) -> str:
    device = getattr(offload, "device", None)
    return str(getattr(device, "value", device) or "none").lower()


def check_zero(file: str, zero: dict, prefix: str, asked_offload: bool, keys: dict | None = None) -> list[Finding]:
    """ZeRO-3 saving and offload from a `zero_optimization` section; `keys` names the settings as the
    user wrote them (an accelerate yaml's deepspeed_config)."""
    keys = keys or {}
    settings = zero_settings(zero)
    if settings is None:
        return []
    found, stage = [], int(settings.stage)
    if stage == 3 and not settings.gather_16bit_weights_on_model_save:
        key = keys.get("gather", prefix + "stage3_gather_16bit_weights_on_model_save")
        found.append(Finding("zero3-save", file, key, "unset under ZeRO-3: trainer.save_model() writes no real "
                             "weights (only the sharded checkpoint)",
                             "set it to true, or export checkpoints with `shardscope export`"))
    for section in ("offload_optimizer", "offload_param"):
        device = _device(getattr(settings, section))
        if device not in ("cpu", "nvme") or (section == "offload_param" and stage != 3):
            continue
        key = keys.get(section, f"{prefix}{section}.device")
        if section == "offload_optimizer":
            found += _cpu_adam(file, key)
        if not asked_offload:
            found.append(Finding("silent-offload", file, key, f"offloads to {device} although nothing in the file's "
                                 f"name says offload: {OFFLOAD_COST[section]}; expect each step to be several "
                                 "times slower than without offload",
                                 f"set device none if the model fits without it (`shardscope plan` shows "
                                 f"zero{stage} beside zero{stage}_offload), or keep it knowingly"))
    return found


def asked_for_offload(*paths) -> bool:
    """The user chose offload when the file they pass says so in its name (zero3_offload.json)."""
    return any(p is not None and "offload" in Path(p).stem.lower() for p in paths)


def _cpu_adam(file: str, key: str) -> list[Finding]:
    """ZeRO optimizer offload runs DeepSpeedCPUAdam: prebuilt, already JIT-built, or a compiler + ninja to build it."""
    missing = cpu_adam_missing()
    if missing:
        return [Finding("offload", file, key, f"ZeRO optimizer offload runs DeepSpeedCPUAdam, which cannot be built "
                        f"here: {missing}", "install a C++ compiler and ninja, or prebuild it: "
                        "DS_BUILD_CPU_ADAM=1 pip install deepspeed")]
    return []


def cpu_adam_missing() -> str | None:
    """Why DeepSpeedCPUAdam cannot be loaded or JIT-built here, or None."""
    from deepspeed.git_version_info import installed_ops

    if installed_ops.get("cpu_adam"):
        return None
    from torch.utils.cpp_extension import _get_build_directory

    if list(Path(_get_build_directory("cpu_adam", verbose=False)).glob("cpu_adam*.so")):
        return None  # JIT-built earlier on this machine
    compiler = os.environ.get("CXX", "c++")
    problems = [] if shutil.which(compiler) else [f"no C++ compiler ({compiler} is not on PATH)"]
    if not shutil.which("ninja") and importlib.util.find_spec("ninja") is None:
        problems.append("ninja is not installed")
    return ", ".join(problems) or None


def check_deepspeed(path: Path, trainer: dict | None, world_size: int | None, source: str,
                    asked_offload: bool = False) -> list[Finding]:
    raw, found, file = read_raw(path), [], str(path)
    strings = set()
    for line in strings_that_should_be_values(raw):
        key, _, _ = line.partition(":")
        strings.add(key)
        value = get(raw, key)
        found.append(Finding("ds-string", file, key, f"{value!r} is a string; DeepSpeed and the Trainer compare it as "
                             "text, so it never equals the Trainer's number",
                             f"write {value} without quotes, or \"auto\" to take the Trainer's value"))
    if "zero_optimization" in raw:
        found += check_zero(file, raw["zero_optimization"], "zero_optimization.",
                            asked_offload or asked_for_offload(path))
    if trainer is None:
        return found
    found += trainer_mismatches(file, raw, trainer, world_size, source, skip=strings)
    defaults = {f.name: f.default for f in dataclasses.fields(_training_arguments())}
    for section, flag in (("optimizer", "optim"), ("scheduler", "lr_scheduler_type")):
        if section in raw and str(trainer.get(flag)) != str(defaults[flag]):
            found.append(Finding("ds-ignored", file, section, f"DeepSpeed's {section} section wins: --{flag} "
                                 f"{trainer.get(flag)} is silently ignored",
                                 f"remove the {section} section, or drop --{flag}"))
    if "gradient_clipping" not in raw and (trainer.get("max_grad_norm") or 0) > 0:
        found.append(Finding("ds-ignored", file, "gradient_clipping", f"absent: DeepSpeed does not clip, and "
                             f"--max_grad_norm {trainer.get('max_grad_norm')} is silently ignored",
                             "add \"gradient_clipping\": \"auto\""))
    return found


def trainer_mismatches(file: str, config: dict, trainer: dict, world_size: int | None, source: str,
                       skip=(), names: dict | None = None) -> list[Finding]:
    """The Trainer's own comparison (`HfTrainerDeepSpeedConfig.trainer_config_process`): every value it
    would stop on. `names` maps a DeepSpeed key to the key the user wrote (an accelerate yaml)."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    view = SimpleNamespace(**trainer, world_size=world_size or 1)
    filled = HfTrainerDeepSpeedConfig(json.loads(json.dumps(config)))
    try:
        filled.trainer_config_process(view)
    finally:
        unset_hf_deepspeed_config()
    found = []
    for line in filled.mismatches:  # "- ds KEY=VALUE vs hf FLAG=VALUE"
        ds, _, hf = line.removeprefix("- ds ").partition(" vs hf ")
        key, _, ds_value = ds.partition("=")
        flag, _, hf_value = hf.partition("=")
        if key in skip or (key == "train_batch_size" and world_size is None):
            continue
        flag = flag.split("|")[0].replace(" (calculated)", "")
        shown = (names or {}).get(key, key)
        fix = f"remove {shown} (accelerate then takes the Trainer's value)" if shown != key else \
            f"set \"{key}\": \"auto\" (the Trainer fills it)"
        found.append(Finding("ds-mismatch", file, shown, f"DeepSpeed gets {ds_value} but {source} give "
                             f"{flag}={hf_value}; the Trainer stops with 'DeepSpeed config values that mismatch'",
                             f"{fix}, or pass --{flag} {ds_value}"))
    return found


def check_accelerate_deepspeed(file: str, acc: dict, trainer: dict | None, world_size: int | None,
                               source: str) -> list[Finding]:
    """An accelerate yaml with `distributed_type: DEEPSPEED` and no DeepSpeed file: the config
    accelerate's `DeepSpeedPlugin.__post_init__` builds from its `deepspeed_config` section."""
    ds = acc.get("deepspeed_config") or {}
    if ds.get("deepspeed_config_file"):
        return []
    config: dict = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}
    for yaml_key, ds_key in ACCELERATE_DS_KEYS.items():
        value = ds.get(yaml_key)
        if value is None or str(value).lower() == "none":
            continue
        *parents, last = ds_key.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = is_true(value) if yaml_key == "zero3_save_16bit_model" else value
    config.setdefault("zero_optimization", {}).setdefault("stage", 2)  # DeepSpeedPlugin's default
    keys = {"gather": "deepspeed_config.zero3_save_16bit_model",
            "offload_optimizer": "deepspeed_config.offload_optimizer_device",
            "offload_param": "deepspeed_config.offload_param_device"}
    found = check_zero(file, config["zero_optimization"], "deepspeed_config.", asked_for_offload(file), keys)
    if trainer is not None:
        names = {v: f"deepspeed_config.{k}" for k, v in ACCELERATE_DS_KEYS.items()}
        found += trainer_mismatches(file, config, trainer, world_size, source, names=names)
    return found


def check_deepspeed_precision(file: str, acc: dict, ds_raw: dict, trainer: dict | None) -> list[Finding]:
    """accelerate refuses a mixed precision (the yaml's, or the Trainer's flag, which overrides it) other
    than the dtype the DeepSpeed file enables (`DeepSpeedPlugin.set_mixed_precision`)."""
    flag = next((f for f in PRECISION_FLAGS if (trainer or {}).get(f)), None)
    chosen = flag or str(acc.get("mixed_precision") or "no").lower()
    enabled = [d for d in PRECISION_FLAGS if is_true(get(ds_raw, f"{d}.enabled"))]
    if chosen == "no" or not enabled or chosen in enabled:
        return []
    where = f"the Trainer's --{chosen}" if flag else f"{chosen} here"
    return [Finding("precision", file, "mixed_precision", f"{where}, but the DeepSpeed file enables {enabled[0]}: "
                    f"accelerate stops ('--mixed_precision arg cannot be set to {chosen} when {enabled[0]} is set in "
                    "the DeepSpeed config file')",
                    f"use {enabled[0]} everywhere, or write \"{enabled[0]}\": {{\"enabled\": \"auto\"}}")]


def _training_arguments():
    from transformers import TrainingArguments

    return TrainingArguments
