"""`shardscope doctor`: the config mistakes that cost a GPU-hour, found before launch.

    shardscope doctor [--accelerate-config F] [--deepspeed F] [--fsdp-config F] [--model M]
                      [--gpus N --gpu NAME | --gpu-memory SIZE] [-- recipe.py --config r.yaml ... | -- TRAINER ARGS]

Every finding names the file, the key and the fix. Exit 0: clean; 1: findings; 2: unusable input.
Each file is first validated by `configs.validate_config` (the libraries' own loaders); the checks here
are the cross-file ones those loaders cannot make (see docs/doctor.md for the table):

| code            | finding                                                                              |
| ds-mismatch     | DeepSpeed value differs from the Trainer argument (batch, accumulation, lr, precision) |
| ds-string       | a DeepSpeed number/boolean written as a string                                       |
| ds-ignored      | a Trainer argument DeepSpeed silently ignores (its own optimizer/scheduler, no clipping) |
| zero3-save      | ZeRO-3 without stage3_gather_16bit_weights_on_model_save: save_model writes no weights |
| fsdp-key        | an FSDP key from another accelerate/transformers version, or FSDP1-only under FSDP2  |
| wrap-class      | a layer class to wrap that the model does not have                                   |
| default-config  | accelerate's default config would silently change a launch without --config_file     |
| no-fit          | the chosen strategy does not fit the GPUs (planner); DDP/NO_SHARD when nothing replicated fits |
| precision       | accelerate's mixed_precision differs from the Trainer's --bf16/--fp16                |
| offload         | offload asked for without what it needs                                              |
| tp-degree       | a tensor-parallel degree the model cannot take (heads, no TP plan, LoRA)             |
| config          | anything the library loaders reject (from `configs.validate_config`)                 |

Trainer arguments are only parsed (HfArgumentParser over `TrainingArguments`, or over a recipe's own
dataclasses), never constructed: constructing `TrainingArguments` starts the process group.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from .configs import ConfigProblems, strings_that_should_be_values, validate_config
from .errors import UsageError
from .mesh import tp_heads_problem, valid_tp_degrees
from .strategy import fsdp_settings, strategy_of_config, tp_mesh_of_config


@dataclass(frozen=True)
class Finding:
    code: str
    file: str
    key: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.file}: {self.key}: {self.problem}\n    fix: {self.fix}"


# FSDP keys by where they are read: old name -> (current name or None if removed, why / how to convert).
ACCELERATE_RENAMED = {
    "fsdp_backward_prefetch_policy": ("fsdp_backward_prefetch", "renamed in accelerate 0.21"),
    "backward_prefetch_policy": ("fsdp_backward_prefetch", "renamed in accelerate 0.21"),
    "sharding_strategy": ("fsdp_sharding_strategy", "accelerate reads fsdp_config keys with the fsdp_ prefix"),
    "offload_params": ("fsdp_offload_params", "accelerate reads fsdp_config keys with the fsdp_ prefix"),
    "min_num_params": ("fsdp_min_num_params", "accelerate reads fsdp_config keys with the fsdp_ prefix"),
    "transformer_layer_cls_to_wrap": ("fsdp_transformer_layer_cls_to_wrap",
                                      "accelerate reads fsdp_config keys with the fsdp_ prefix"),
}
FSDP1_ONLY = {  # accelerate yaml name (Trainer fsdp_config drops the fsdp_ prefix) -> FSDP2 replacement
    "fsdp_sharding_strategy": ("fsdp_reshard_after_forward",
                               "FSDP2 has no sharding strategy: FULL_SHARD -> true, SHARD_GRAD_OP -> false, "
                               "HYBRID_SHARD -> parallelism_config dp_replicate_size"),
    "fsdp_backward_prefetch": (None, "FSDP2 always prefetches; accelerate drops it"),
    "fsdp_forward_prefetch": (None, "not implemented in FSDP2; accelerate raises"),
    "fsdp_use_orig_params": (None, "FSDP2 always uses the original parameters"),
    "fsdp_sync_module_states": ("fsdp_cpu_ram_efficient_loading", "FSDP2 loads on rank 0 and broadcasts with it"),
    "fsdp_limit_all_gathers": (None, "FSDP1 only"),
}
TRAINER_RENAMED = {
    "fsdp_min_num_params": ("min_num_params", "transformers' fsdp_config keys have no fsdp_ prefix"),
    "fsdp_transformer_layer_cls_to_wrap": ("transformer_layer_cls_to_wrap",
                                           "transformers' fsdp_config keys have no fsdp_ prefix"),
    "fsdp_version": ("version", "transformers' fsdp_config calls it version"),
    "sharding_strategy": ("reshard_after_forward", "transformers 5 passes the strategy as reshard_after_forward"),
}
PRECISION_FLAGS = ("bf16", "fp16")


# ----------------------------------------------------------------------------- inputs


@dataclass
class Inputs:
    accelerate_config: Path | None = None
    deepspeed: Path | None = None
    fsdp_config: Path | None = None
    model: str | None = None
    model_from_args: bool = False   # taken from the recipe's model_name_or_path: an unloadable one is skipped
    trainer: dict | None = None     # parsed (not constructed) Trainer/recipe arguments
    trainer_source: str = "trainer arguments"
    gpus: int | None = None
    nodes: int = 1
    gpu_memory_bytes: int | None = None


def parse_trainer_args(argv: list[str]) -> tuple[dict, str]:
    """Parse `recipe.py ARGS` with the recipe's own dataclasses, or bare Trainer ARGS with TrainingArguments.
    Returns (values by field name, where they came from); nothing is constructed."""
    from transformers import TrainingArguments

    from .recipe_args import RecipeParser

    source = "trainer arguments"
    types, training_type = [], TrainingArguments
    if argv and argv[0].endswith(".py"):
        script = Path(argv[0])
        if not script.is_file():
            raise UsageError(f"recipe '{script}' does not exist")
        spec = importlib.util.spec_from_file_location(f"_shardscope_recipe_{script.stem}", script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # recipes keep main() behind `if __name__ == "__main__"`
        for value in vars(module).values():
            if isinstance(value, type) and dataclasses.is_dataclass(value):
                if issubclass(value, TrainingArguments) and issubclass(value, training_type):
                    training_type = value
                elif value.__module__ == module.__name__:
                    types.append(value)
        source, argv = str(script), argv[1:]
    parser = RecipeParser(*types, training_type=training_type)
    parser.parse(argv)
    config = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"), None)
    return dict(parser.namespace), config or source


# ----------------------------------------------------------------------------- checks


def _raw(path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) if path.suffix in (".yaml", ".yml") else json.loads(path.read_text())
    except Exception:
        return {}  # validate_config reports malformed files
    return data if isinstance(data, dict) else {}


def _validated(path: Path, kind: str, findings: list[Finding], world_size: int) -> None:
    try:
        validate_config(path, kind, world_size=world_size)
    except ConfigProblems as error:
        for line in error.problems:
            rest = line.removeprefix(f"{path}: ")
            if rest.startswith("ds ") and " vs hf " in rest:
                continue  # compared with default TrainingArguments; check_deepspeed compares with the real ones
            key, _, problem = rest.partition(": ")
            if " " in key or not problem:
                key, problem = "-", rest
            findings.append(Finding("config", str(path), key, problem, "see the message; the library rejects it"))


def check_deepspeed(path: Path, trainer: dict | None, world_size: int | None, source: str) -> list[Finding]:
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    raw, found, file = _raw(path), [], str(path)
    strings = set()
    for line in strings_that_should_be_values(raw):
        key, _, _ = line.partition(":")
        strings.add(key)
        value = _get(raw, key)
        found.append(Finding("ds-string", file, key, f"{value!r} is a string; DeepSpeed and the Trainer compare it as "
                             "text, so it never equals the Trainer's number",
                             f"write {value} without quotes, or \"auto\" to take the Trainer's value"))
    zero = raw.get("zero_optimization") or {}
    if _int(zero.get("stage")) == 3 and zero.get("stage3_gather_16bit_weights_on_model_save") is not True:
        found.append(Finding("zero3-save", file, "zero_optimization.stage3_gather_16bit_weights_on_model_save",
                             "unset under ZeRO-3: trainer.save_model() writes no real weights (only the sharded "
                             "checkpoint)", "set it to true, or export checkpoints with `shardscope export`"))
    found += _check_offload_ds(file, zero, "zero_optimization.offload_optimizer.device",
                               (zero.get("offload_optimizer") or {}).get("device"))
    if trainer is None:
        return found
    view = SimpleNamespace(**trainer, world_size=world_size or 1)
    filled = HfTrainerDeepSpeedConfig(json.loads(json.dumps(raw)))
    try:
        filled.trainer_config_process(view)
    finally:
        unset_hf_deepspeed_config()
    for line in filled.mismatches:  # "- ds KEY=VALUE vs hf FLAG=VALUE"
        ds, _, hf = line.removeprefix("- ds ").partition(" vs hf ")
        key, _, ds_value = ds.partition("=")
        flag, _, hf_value = hf.partition("=")
        if key in strings or (key == "train_batch_size" and world_size is None):
            continue
        flag = flag.split("|")[0].replace(" (calculated)", "")
        found.append(Finding("ds-mismatch", file, key, f"DeepSpeed has {ds_value} but {source} give "
                             f"{flag}={hf_value}; the Trainer stops with 'DeepSpeed config values that mismatch'",
                             f"set \"{key}\": \"auto\" (the Trainer fills it), or pass --{flag} {ds_value}"))
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


def _training_arguments():
    from transformers import TrainingArguments

    return TrainingArguments


def _get(config: dict, dotted: str):
    for part in dotted.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def _int(value):
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _check_offload_ds(file: str, zero: dict, key: str, device) -> list[Finding]:
    """ZeRO optimizer offload runs DeepSpeedCPUAdam: prebuilt, already JIT-built, or a compiler + ninja to build it."""
    if str(device).lower() not in ("cpu", "nvme"):
        return []
    if importlib.util.find_spec("deepspeed") is None:
        return [Finding("offload", file, key, "ZeRO offload needs DeepSpeed, which is not installed",
                        "pip install deepspeed")]
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


def check_fsdp_keys(path: Path, kind: str) -> list[Finding]:
    raw, found, file = _raw(path), [], str(path)
    section = dict(raw.get("fsdp_config") or {}) if kind == "accelerate" else raw
    prefix = "fsdp_config." if kind == "accelerate" else ""
    version = str(section.get("fsdp_version", section.get("version", 1 if kind == "accelerate" else 2)))
    renamed = ACCELERATE_RENAMED if kind == "accelerate" else TRAINER_RENAMED
    for key in section:
        if key in renamed:
            new, why = renamed[key]
            found.append(Finding("fsdp-key", file, prefix + key, f"old name ({why}); this version ignores it",
                                 f"rename it to {new}"))
            continue
        yaml_name = key if kind == "accelerate" else f"fsdp_{key}"
        if version == "2" and yaml_name in FSDP1_ONLY:
            new, why = FSDP1_ONLY[yaml_name]
            new = new if kind == "accelerate" or new is None else new.removeprefix("fsdp_")
            found.append(Finding("fsdp-key", file, prefix + key, f"an FSDP1 key under FSDP2 ({why})",
                                 f"use {new}" if new else "remove it"))
    return found


def wrap_classes(settings: dict) -> list[str]:
    value = settings.get("fsdp_transformer_layer_cls_to_wrap")
    if not value:
        return []
    return [c.strip() for c in (value.split(",") if isinstance(value, str) else value) if c.strip()]


def check_wrap_class(file: str, key: str, classes: list[str], auto_wrap: str | None, model) -> list[Finding]:
    """Every class to wrap must exist in the model (built on the meta device from its config)."""
    present = {type(m).__name__ for m in model.modules()}
    blocks = list(getattr(model, "_no_split_modules", None) or [])
    if not classes and str(auto_wrap or "").upper() == "TRANSFORMER_BASED_WRAP" and not blocks:
        return [Finding("wrap-class", file, key, f"{type(model).__name__} declares no _no_split_modules, so "
                        "TRANSFORMER_BASED_WRAP has nothing to wrap ('Could not find the transformer layer class')",
                        f"set {key} to one of: {', '.join(sorted(present))}")]
    wrong = [c for c in classes if c not in present]
    if not wrong:
        return []
    suggestion = ", ".join(c for c in blocks if c in present) or ", ".join(sorted(present))
    return [Finding("wrap-class", file, key, f"{type(model).__name__} has no {', '.join(wrong)} "
                    f"('Could not find the transformer layer class to wrap'); its classes: {', '.join(sorted(present))}",
                    f"wrap {suggestion}")]


def default_config_file() -> Path:
    """accelerate's default config location, from HF_HOME / XDG_CACHE_HOME as they are now."""
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(os.path.expanduser(home)) / "accelerate" / "default_config.yaml"


def check_default_config() -> list[Finding]:
    """`accelerate launch` without --config_file reads this file: a strategy in it applies silently."""
    path = default_config_file()
    if not path.is_file():
        return []
    raw = _raw(path)
    changes = [f"{k}: {raw[k]}" for k in ("distributed_type", "mixed_precision", "num_processes", "use_cpu")
               if k in raw and str(raw[k]).upper() not in ("NO", "FALSE", "1")]
    if not changes:
        return []
    return [Finding("default-config", str(path), changes[0].split(":")[0],
                    f"accelerate launch without --config_file applies it silently ({'; '.join(changes)})",
                    f"always pass --config_file, or delete {path}")]


def check_precision(file: str, raw: dict, trainer: dict, source: str) -> list[Finding]:
    if raw.get("distributed_type") == "DEEPSPEED":
        return []  # validate_config reports a yaml mixed_precision under DeepSpeed
    yaml_value = str(raw.get("mixed_precision") or "no").lower()
    args_value = next((f for f in PRECISION_FLAGS if trainer.get(f)), "no")
    if yaml_value == args_value:
        return []
    return [Finding("precision", file, "mixed_precision", f"{yaml_value} here but {args_value} in {source} "
                    f"(the Trainer's flag overrides the launcher's value at start-up)",
                    f"set mixed_precision: {args_value}, or pass --{yaml_value} to the script"
                    if yaml_value != "no" else f"set mixed_precision: {args_value}")]


def check_fsdp_offload(file: str, settings: dict, prefix: str) -> list[Finding]:
    if str(settings.get("fsdp_offload_params", settings.get("fsdp_cpu_offload", False))).lower() != "true":
        return []
    version = str(settings.get("fsdp_version", 1))
    if version == "1" and str(settings.get("fsdp_use_orig_params", False)).lower() != "true":
        name = "fsdp_use_orig_params" if prefix else "use_orig_params"
        return [Finding("offload", file, prefix + name, "FSDP1 CPU offload with use_orig_params false: the "
                        "optimizer gets flat parameters, gradient clipping and frozen (LoRA) parameters break",
                        f"set {name}: true, or use fsdp_version 2")]
    return []


# --- strategy and planner


def check_tp_degree(file: str, tp: int, config, trainer: dict | None) -> list[Finding]:
    """Tensor parallelism splits attention by heads along the model's TP plan: both must allow `tp`."""
    key = "parallelism_config.parallelism_config_tp_size"
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    findings = []
    if not getattr(config, "base_model_tp_plan", None):
        findings.append(Finding("tp-degree", file, key, f"model type '{config.model_type}' has no tensor-parallel "
                                "plan in transformers (config.base_model_tp_plan)", "use fsdp_full_shard or zero3"))
    elif heads is None or tp_heads_problem(tp, heads, kv):
        fits = valid_tp_degrees(heads or 1, kv or 1)
        findings.append(Finding("tp-degree", file, key, f"{tp} does not divide the model's attention heads "
                                f"(num_attention_heads {heads}, num_key_value_heads {kv})",
                                f"use a tp_size in {', '.join(map(str, fits))}"))
    if trainer and str(trainer.get("use_lora", "")).lower() == "true":
        findings.append(Finding("tp-degree", file, key, "LoRA under tensor parallelism is refused by the recipe",
                                "train LoRA with ddp, fsdp_full_shard or zero2/zero3"))
    return findings


def check_fit(file: str, strategy: str, spec, inputs: Inputs, mesh: dict | None = None) -> list[Finding]:
    """`mesh`: a TP yaml's degrees, which then decide the planner's setup instead of --gpus/--nodes."""
    from .mesh import Setup, setup_for_mesh
    from .planner import estimate
    from .units import gb

    trainer = inputs.trainer or {}
    precision = "bf16-mixed" if trainer.get("bf16") else "fp16-mixed" if trainer.get("fp16") else (
        "fp32" if inputs.trainer is not None else "bf16-mixed")
    lora = int(trainer.get("lora_r") or 0) if trainer.get("use_lora") or trainer.get("lora_r") and "use_lora" not in trainer else 0
    setup = Setup(gpus_per_node=inputs.gpus, nodes=inputs.nodes, gpu_memory_bytes=inputs.gpu_memory_bytes,
                  precision=precision, micro_batch=int(trainer.get("per_device_train_batch_size") or 1),
                  seq_len=int(trainer.get("max_seq_length") or 2048),
                  activation_checkpointing=bool(trainer.get("gradient_checkpointing")),
                  lora_rank=lora, lora_targets=("all-linear",) if lora else ("q_proj", "v_proj"),
                  grad_accum_steps=int(trainer.get("gradient_accumulation_steps") or 1))
    if mesh:
        strategy, setup = setup_for_mesh(setup, mesh)
    result = estimate(spec, setup)
    rows = {r["strategy"]: r for r in result["rows"]}
    if strategy not in rows:  # a TP yaml with a model that has no TP plan: the tp-degree finding says so
        return []
    row, best = rows[strategy], result["recommendation"]
    if row["fits"]:
        return []
    usable = gb(inputs.gpu_memory_bytes * (1 - setup.headroom))
    fix = f"use {best['strategy']} ({best['reason']})" if best["strategy"] else best["reason"]
    what = f"{strategy} needs {gb(row['total_bytes'])} GB per GPU of {usable} GB usable"
    if strategy == "ddp":
        what += f" (DDP/NO_SHARD keeps all {gb(row['model_states_bytes'])} GB of model states on every GPU)"
    return [Finding("no-fit", file, "strategy", f"{what} ({spec.name}, {setup.world_size} GPUs, {precision}, "
                    f"micro-batch {setup.micro_batch}, seq {setup.seq_len})", fix)]


# ----------------------------------------------------------------------------- the doctor


def diagnose(inputs: Inputs, validate: bool = True) -> tuple[list[Finding], list[str]]:
    """All findings for `inputs`, and notes (checks skipped and why). `validate=False` skips the library
    loaders (they construct TrainingArguments, which inside a launched process starts the process group)."""
    findings, notes = [], []
    trainer, source = inputs.trainer, inputs.trainer_source
    deepspeed, fsdp = inputs.deepspeed, inputs.fsdp_config
    if trainer is not None:  # files named in the Trainer arguments
        if deepspeed is None and isinstance(trainer.get("deepspeed"), str) and trainer["deepspeed"]:
            deepspeed = Path(trainer["deepspeed"])
        if fsdp is None and isinstance(trainer.get("fsdp_config"), str) and trainer["fsdp_config"]:
            fsdp = Path(trainer["fsdp_config"])
    for path in (inputs.accelerate_config, deepspeed, fsdp):
        if path is not None and not Path(path).is_file():
            raise UsageError(f"config file '{path}' does not exist")
    acc = _raw(inputs.accelerate_config) if inputs.accelerate_config else None
    acc_mesh = tp_mesh_of_config(acc) if acc is not None else None
    world = None
    if inputs.gpus:
        world = inputs.gpus * inputs.nodes
    elif acc and acc.get("num_processes"):
        world = _int(acc["num_processes"])
    if acc and deepspeed is None and (acc.get("deepspeed_config") or {}).get("deepspeed_config_file"):
        deepspeed = Path(acc["deepspeed_config"]["deepspeed_config_file"])

    if inputs.accelerate_config is None:
        findings += check_default_config()
    if acc is not None:
        file = str(inputs.accelerate_config)
        if validate:
            _validated(inputs.accelerate_config, "accelerate", findings, world or 8)
        if acc.get("distributed_type") == "FSDP":
            findings += check_fsdp_keys(inputs.accelerate_config, "accelerate")
            findings += check_fsdp_offload(file, acc.get("fsdp_config") or {}, "fsdp_config.")
        ds = acc.get("deepspeed_config") or {}
        if acc.get("distributed_type") == "DEEPSPEED":
            findings += _check_offload_ds(file, {}, "deepspeed_config.offload_optimizer_device",
                                          ds.get("offload_optimizer_device"))
            if _int(ds.get("zero_stage")) == 3 and str(ds.get("zero3_save_16bit_model", "")).lower() != "true" \
                    and not ds.get("deepspeed_config_file"):
                findings.append(Finding("zero3-save", file, "deepspeed_config.zero3_save_16bit_model",
                                        "unset under ZeRO-3: trainer.save_model() writes no real weights",
                                        "set it to true, or export checkpoints with `shardscope export`"))
        if trainer is not None:
            findings += check_precision(file, acc, trainer, source)
    if deepspeed is not None:
        if validate:
            _validated(deepspeed, "deepspeed", findings, world or 8)
        findings += check_deepspeed(deepspeed, trainer, world, source)
    if fsdp is not None:
        if validate:
            _validated(fsdp, "fsdp", findings, world or 8)
        findings += check_fsdp_keys(fsdp, "fsdp")
        findings += check_fsdp_offload(str(fsdp), fsdp_settings("fsdp", _raw(fsdp)), "")

    model = _model(inputs, notes)
    if model is not None:
        if acc_mesh:
            findings += check_tp_degree(str(inputs.accelerate_config), acc_mesh["tp"], model[1].config, trainer)
        for path, kind in ((inputs.accelerate_config, "accelerate"), (fsdp, "fsdp")):
            raw = _raw(path) if path else {}
            if not raw or (kind == "accelerate" and raw.get("distributed_type") != "FSDP"):
                continue
            settings = fsdp_settings(kind, raw)
            key = "fsdp_config.fsdp_transformer_layer_cls_to_wrap" if kind == "accelerate" else "transformer_layer_cls_to_wrap"
            findings += check_wrap_class(str(path), key, wrap_classes(settings),
                                         settings.get("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP"), model[1])
        if inputs.gpus and inputs.gpu_memory_bytes:
            chosen = [(str(p), strategy_of_config(k, _raw(p), read=lambda f: _raw(Path(f)))) for p, k in
                      ((deepspeed, "deepspeed"), (fsdp, "fsdp"), (inputs.accelerate_config, "accelerate")) if p]
            file, strategy = chosen[0] if chosen else ("(no config: plain DDP)", "ddp")
            mesh = acc_mesh if file == str(inputs.accelerate_config) else None
            findings += check_fit(file, strategy or "ddp", model[0], inputs, mesh)
    elif inputs.gpus and inputs.gpu_memory_bytes:
        notes.append("fit check skipped: no model (--model)")
    return _dedupe(findings), notes


def _model(inputs: Inputs, notes: list[str]):
    """(planner spec, meta-device model) or None; an unloadable explicit --model is unusable input."""
    name = inputs.model
    if name is None:
        return None
    from .model_spec import load_model_config, meta_model, spec_from_config

    try:
        config = load_model_config(name)
        return spec_from_config(config, name=name), meta_model(config)
    except UsageError as error:
        if not inputs.model_from_args:
            raise
        notes.append(f"model checks skipped: {error}")
        return None


def _dedupe(findings: list[Finding]) -> list[Finding]:
    """Drop a loader's generic message where a specific finding names the same file and key."""
    specific = {(f.file, f.key.split(".")[-1]) for f in findings if f.code != "config"}
    seen, out = set(), []
    for f in findings:
        if f.code == "config" and (f.file, f.key.split(".")[-1]) in specific:
            continue
        if (f.code, f.file, f.key, f.problem) not in seen:
            seen.add((f.code, f.file, f.key, f.problem))
            out.append(f)
    return out


# ----------------------------------------------------------------------------- recipes


def preflight(namespace: dict, model: str | None = None) -> None:
    """The doctor's checks inside a launched recipe, before `TrainingArguments` exists: the DeepSpeed and
    fsdp_config files its arguments name (or accelerate's launcher passed on), the layer classes to wrap
    and mixed precision against accelerate's environment. Raises `UsageError` listing every finding."""
    env = os.environ
    inputs = Inputs(model=model, model_from_args=True, trainer=namespace, trainer_source="the recipe arguments",
                    deepspeed=Path(env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]) if not namespace.get("deepspeed")
                    and env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") else None)
    world = _int(env.get("WORLD_SIZE"))
    inputs.gpus = world  # batch-size arithmetic only: no memory given, so no fit check
    findings, _ = diagnose(inputs, validate=False)
    if env.get("ACCELERATE_USE_FSDP", "").lower() == "true" and model:
        launched = {"fsdp_transformer_layer_cls_to_wrap": env.get("FSDP_TRANSFORMER_CLS_TO_WRAP")}
        spec_model = _model(Inputs(model=model, model_from_args=True), [])
        if spec_model is not None:
            findings += check_wrap_class("accelerate config", "fsdp_transformer_layer_cls_to_wrap",
                                         wrap_classes(launched), env.get("FSDP_AUTO_WRAP_POLICY"), spec_model[1])
    mixed = env.get("ACCELERATE_MIXED_PRECISION")
    if mixed and env.get("ACCELERATE_USE_DEEPSPEED", "").lower() != "true":
        findings += check_precision("accelerate config", {"mixed_precision": mixed}, namespace, "the recipe arguments")
    if findings:
        raise UsageError("shardscope doctor found problems, refusing to start: "
                         + " | ".join(str(f).replace("\n    ", " ") for f in findings))


# ----------------------------------------------------------------------------- command line


def register(subparsers) -> None:
    p = subparsers.add_parser("doctor", help="find config mistakes before launch",
                              description="Check accelerate/DeepSpeed/FSDP configs against each other, the model, "
                                          "the GPUs and the Trainer/recipe arguments given after --.")
    p.add_argument("--accelerate-config", type=Path, help="accelerate launch --config_file yaml")
    p.add_argument("--deepspeed", type=Path, help="DeepSpeed JSON (TrainingArguments(deepspeed=...))")
    p.add_argument("--fsdp-config", type=Path, help="fsdp_config JSON (TrainingArguments(fsdp_config=...))")
    p.add_argument("--model", help="shipped name, local folder or hub id (default: the recipe's model_name_or_path)")
    p.add_argument("--gpus", type=int, help="GPUs per node, for the fit check")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu", help="GPU name (see shardscope plan --help)")
    p.add_argument("--gpu-memory", help="memory per GPU: 80GB, 80GiB")
    p.add_argument("args", nargs=argparse.REMAINDER, help="-- recipe.py ARGS, or -- Trainer ARGS")
    p.set_defaults(func=doctor_command)


def doctor_command(args) -> int:
    from .units import gpu_memory, parse_size

    rest = args.args[1:] if args.args[:1] == ["--"] else args.args
    inputs = Inputs(accelerate_config=args.accelerate_config, deepspeed=args.deepspeed, fsdp_config=args.fsdp_config,
                    model=args.model, gpus=args.gpus, nodes=args.nodes)
    if args.gpu_memory or args.gpu:
        inputs.gpu_memory_bytes = parse_size(args.gpu_memory) if args.gpu_memory else gpu_memory(args.gpu)
    if rest:
        inputs.trainer, inputs.trainer_source = parse_trainer_args(rest)
        if inputs.model is None and inputs.trainer.get("model_name_or_path"):
            inputs.model, inputs.model_from_args = inputs.trainer["model_name_or_path"], True
    findings, notes = diagnose(inputs)
    for note in notes:
        print(f"note: {note}")
    for finding in findings:
        print(f"[{finding.code}] {finding}")
    print(f"{len(findings)} problem(s) found" if findings else "no problems found")
    return 1 if findings else 0
