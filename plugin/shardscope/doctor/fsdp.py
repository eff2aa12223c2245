"""doctor's FSDP rules: keys from another accelerate/transformers/FSDP version, layer classes to wrap,
FSDP1 CPU offload. Sources: accelerate `FullyShardedDataParallelPlugin`, transformers `TrainingArguments`."""
from __future__ import annotations

from pathlib import Path

from .rules import Finding, read_raw

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


def check_fsdp_keys(path: Path, kind: str) -> list[Finding]:
    raw, found, file = read_raw(path), [], str(path)
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

