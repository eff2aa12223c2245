"""The strategy vocabulary, and which strategy a run, a summary or a config file is using.

One owner for the names every tool shares: the planner's rows, the shipped configs, the profiler
summary's `strategy`, doctor's findings. Nothing here imports torch or transformers at import time.
"""
from __future__ import annotations

import os

from .units import as_int

TP_STRATEGIES = ("tp", "fsdp_tp", "hsdp_tp")  # transformers DistributedConfig(tp_size, fsdp_size, dp_replicate_size)
STRATEGIES = ("ddp", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload",
              "fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_hybrid_shard", "fsdp_offload", *TP_STRATEGIES)
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-pure")
OPTIMIZERS = ("adamw", "adamw-8bit", "sgd", "sgd-momentum")
# How runs and configs spell a precision -> the planner's name (a summary's "bf16" -> "bf16-mixed").
PRECISION_ALIASES = {"no": "fp32", "fp32": "fp32", "float32": "fp32", "bf16": "bf16-mixed",
                     "fp16": "fp16-mixed", "bf16-mixed": "bf16-mixed", "fp16-mixed": "fp16-mixed",
                     "bf16-pure": "bf16-pure", "bf16-true": "bf16-pure"}


def trainer_precision(bf16: bool, fp16: bool) -> str:
    """The Trainer's flags (--bf16 / --fp16) as the profiler and its summary name them: "bf16", "fp16" or "fp32"
    (the one mapping of the flags; `configured_precision` is the planner's name for them)."""
    return "bf16" if bf16 else "fp16" if fp16 else "fp32"


def configured_precision(bf16: bool, fp16: bool) -> str:
    """The planner's name for the Trainer's flags (--bf16 / --fp16): "bf16-mixed", "fp16-mixed" or "fp32"."""
    return PRECISION_ALIASES[trainer_precision(bf16, fp16)]


def family(strategy: str) -> str:
    """Who owns the optimizer and the sharding: "torch" (DDP), "deepspeed", "fsdp" or "tp"."""
    if strategy in TP_STRATEGIES:
        return "tp"  # torch AdamW on DTensors, bytes per element as DDP / FSDP
    return "deepspeed" if strategy.startswith("zero") else "fsdp" if strategy.startswith("fsdp") else "torch"


def tp_strategy(mesh: dict) -> str:
    """The shipped config name of a tensor-parallel mesh: replicas -> hsdp_tp, shards -> fsdp_tp, else tp."""
    return "hsdp_tp" if mesh["dp_replicate"] > 1 else "fsdp_tp" if mesh["dp_shard"] > 1 else "tp"


def strategy_from_summary(summary: dict) -> str | None:
    """The planner's name for a profiler summary's `strategy` (+ `strategy_detail`), or None."""
    name = str(summary.get("strategy", "")).lower().replace("-", "_")
    if name in STRATEGIES:
        return name
    detail = summary.get("strategy_detail") or {}
    if name.startswith(("deepspeed", "zero")) and detail.get("stage") is not None:
        offload = detail.get("offload_optimizer") or detail.get("offload_param")
        return f"zero{int(detail['stage'])}" + ("_offload" if offload and int(detail["stage"]) in (2, 3) else "")
    if name.startswith("fsdp"):
        sharding = str(detail.get("sharding_strategy", "FULL_SHARD")).lower()
        if detail.get("cpu_offload") or detail.get("offload_params"):
            return "fsdp_offload"
        return "fsdp_" + sharding.split(".")[-1] if "fsdp_" + sharding.split(".")[-1] in STRATEGIES else None
    if name in ("single", "multi_gpu", "multi_cpu", "no"):
        return "ddp"
    return None


def fsdp_settings(kind: str, raw: dict) -> dict:
    """accelerate-yaml names for the FSDP settings of an accelerate yaml or a Trainer fsdp_config."""
    if kind == "accelerate":
        return dict(raw.get("fsdp_config") or {})
    settings = {k if k.startswith("fsdp_") else f"fsdp_{k}": v for k, v in raw.items()}
    settings["fsdp_version"] = raw.get("version", raw.get("fsdp_version", 2))  # transformers' default is 2
    return settings


def tp_mesh_of_config(raw: dict) -> dict | None:
    """The `{"dp_replicate", "dp_shard", "tp"}` degrees of an accelerate yaml with tp_size > 1, else None."""
    pc = raw.get("parallelism_config") or {}
    sizes = {k: as_int(pc.get(f"parallelism_config_{k}_size")) or 1 for k in ("dp_replicate", "dp_shard", "tp")}
    return sizes if sizes["tp"] > 1 else None


def strategy_of_config(kind: str, raw: dict, read=None) -> str | None:
    """The planner's strategy name for an accelerate yaml / DeepSpeed JSON / Trainer fsdp_config (`kind`:
    "accelerate", "deepspeed", "fsdp"); `read(path) -> dict` loads a DeepSpeed file an accelerate yaml names."""
    if kind == "deepspeed":
        zero = raw.get("zero_optimization") or {}
        zero = zero if isinstance(zero, dict) else {}
        stage = as_int(zero.get("stage")) or 0
        offload = any(str((zero.get(k) or {}).get("device", "none")).lower() != "none"
                      for k in ("offload_optimizer", "offload_param"))
        return {0: "ddp", 1: "zero1", 2: "zero2_offload" if offload else "zero2",
                3: "zero3_offload" if offload else "zero3"}.get(stage)
    if kind == "accelerate":
        mesh = tp_mesh_of_config(raw)
        if mesh:
            return tp_strategy(mesh)
        dtype = raw.get("distributed_type", "NO")
        if dtype == "DEEPSPEED":
            ds = raw.get("deepspeed_config") or {}
            if ds.get("deepspeed_config_file") and read is not None:
                return strategy_of_config("deepspeed", read(ds["deepspeed_config_file"]))
            zero = {"stage": ds.get("zero_stage", 2), "offload_optimizer": {"device": ds.get("offload_optimizer_device")},
                    "offload_param": {"device": ds.get("offload_param_device")}}
            return strategy_of_config("deepspeed", {"zero_optimization": zero})
        if dtype != "FSDP":
            return "ddp"
    settings = fsdp_settings(kind, raw)
    if str(settings.get("fsdp_offload_params", settings.get("fsdp_cpu_offload", False))).lower() == "true":
        return "fsdp_offload"
    mode = str(settings.get("fsdp_sharding_strategy", settings.get("fsdp_reshard_after_forward", "true"))).upper()
    return {"TRUE": "fsdp_full_shard", "FULL_SHARD": "fsdp_full_shard", "1": "fsdp_full_shard",
            "FALSE": "fsdp_shard_grad_op", "SHARD_GRAD_OP": "fsdp_shard_grad_op", "2": "fsdp_shard_grad_op",
            "NO_SHARD": "ddp", "3": "ddp", "HYBRID_SHARD": "fsdp_hybrid_shard", "4": "fsdp_hybrid_shard",
            "HYBRID_SHARD_ZERO2": "fsdp_hybrid_shard"}.get(mode, "fsdp_full_shard")


def num_nodes() -> int:
    """Nodes in the run, from the launcher's environment: world size / local world size (torchrun and
    accelerate set LOCAL_WORLD_SIZE; the `deepspeed` launcher sets LOCAL_SIZE instead)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 0)
    return max(1, int(os.environ.get("WORLD_SIZE", 1)) // local) if local else 1


def sequence_split(pc) -> dict:
    """A run's context (cp) or sequence (sp) split from accelerate's ParallelismConfig: {"mesh": {kind: degree},
    "degree", "details": {"sequence_parallel": {kind, degree, backend, group}}}, {} without one (the mesh's
    dp_shard is then the data-parallel shards: dp_replicate x dp_shard x tp x degree = world, as accelerate's).
    The group is the ranks that share this rank's sequences: DeepSpeed's sequence-parallel group (sp),
    accelerate's mesh order (cp)."""
    import torch

    kind = "sp" if pc is not None and pc.sp_size > 1 else "cp" if pc is not None and pc.cp_size > 1 else None
    if kind is None:
        return {}
    degree = pc.sp_size if kind == "sp" else pc.cp_size
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    group = None
    if kind == "sp":
        from deepspeed.utils import groups

        try:  # (what accelerate's deepspeed_ulysses_dl_adapter reads; KeyError before DeepSpeed set it up)
            group = torch.distributed.get_process_group_ranks(groups._get_sequence_parallel_group())
        except (KeyError, ValueError, RuntimeError):
            group = None
    if group is None:  # accelerate's mesh: (dp_replicate, dp_shard, cp/sp, tp), cp inside the data-parallel dims
        stride = pc.tp_size
        start = rank - rank % (degree * stride) + rank % stride
        group = [start + i * stride for i in range(degree)]
    backend = pc.sp_backend if kind == "sp" else pc.cp_backend
    return {"mesh": {kind: degree}, "degree": degree,
            "details": {"sequence_parallel": {"kind": kind, "degree": degree, "backend": backend, "group": group}}}


