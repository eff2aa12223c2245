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
# How runs and configs spell a precision -> the planner's name.
PRECISION_ALIASES = {"no": "fp32", "fp32": "fp32", "float32": "fp32", "bf16": "bf16-mixed",
                     "fp16": "fp16-mixed", "bf16-mixed": "bf16-mixed", "fp16-mixed": "fp16-mixed",
                     "bf16-pure": "bf16-pure", "bf16-true": "bf16-pure"}


def configured_precision(bf16: bool, fp16: bool) -> str:
    """The planner's name for the Trainer's flags (--bf16 / --fp16)."""
    return "bf16-mixed" if bf16 else "fp16-mixed" if fp16 else "fp32"


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


def detect_strategy(model=None) -> dict:
    """Read accelerate's live state (and the model's own mesh): `{"strategy": NAME, "world_size": N,
    "mesh": {"dp_replicate": R, "dp_shard": S, "tp": T}, ...details}`.

    Call it after the Trainer has built its Accelerator. The name says what was configured; the
    per-rank byte counts in the profiler summary show whether it really sharded. `mesh` gives the
    degrees the ranks are split into: data-parallel replicas x data-parallel shards x tensor-parallel.
    A model sharded while loading (transformers `DistributedConfig`) carries its mesh in its config.
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    if not PartialState._shared_state:
        return {"strategy": "single", "world_size": 1, "mesh": _mesh(1, 1, 1)}
    state = AcceleratorState()
    world_size = state.num_processes
    kind = state.distributed_type
    loaded = getattr(getattr(model, "config", None), "distributed_config", None)
    pc = state.parallelism_config
    if loaded is not None and loaded.tp_size > 1:
        mesh = _mesh(loaded.dp_replicate_size, loaded.fsdp_size, loaded.tp_size)
    elif pc is not None and pc.tp_size > 1:
        mesh = _mesh(pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size)
    else:
        mesh = None
    if mesh is not None:
        return {"strategy": tp_strategy(mesh), "world_size": world_size, "mesh": mesh,
                "sharded_by": "transformers DistributedConfig" if loaded is not None else "accelerate"}
    split = sequence_split(pc)
    if kind == DistributedType.DEEPSPEED:
        return {"world_size": world_size, "mesh": {**_mesh(1, world_size // split.get("degree", 1), 1),
                                                   **split.get("mesh", {})},
                **_deepspeed_details(state.deepspeed_plugin), **split.get("details", {})}
    if kind == DistributedType.FSDP:
        details = _fsdp_details(state.fsdp_plugin, pc)
        replicate = 1
        if details["sharding_strategy"] == "HYBRID_SHARD":  # FSDP2: the mesh; FSDP1: shards within each node
            replicate = pc.dp_replicate_size if pc is not None and pc.dp_replicate_size > 1 else num_nodes()
        return {"world_size": world_size, "mesh": {**_mesh(replicate, world_size // replicate // split.get("degree", 1),
                                                         1), **split.get("mesh", {})},
                **details, **split.get("details", {})}
    if world_size > 1:
        return {"strategy": "ddp", "world_size": world_size, "mesh": _mesh(world_size, 1, 1),
                "distributed_type": str(kind.value)}
    launched = as_int(os.environ.get("WORLD_SIZE")) or 1
    if launched > 1:  # e.g. torchrun on CPU without use_cpu: transformers runs every process on its own
        return {"strategy": "independent_copies", "world_size": world_size, "launched_world_size": launched,
                "mesh": _mesh(1, 1, 1), "problem": f"launched with WORLD_SIZE={launched} but accelerate runs this "
                f"process alone (distributed_type {state.distributed_type.value}): {launched} unsynchronized copies "
                "of the same training, no gradient exchange; on CPU pass --use_cpu (TrainingArguments(use_cpu="
                "True)) or launch with accelerate launch --cpu"}
    return {"strategy": "single", "world_size": world_size, "mesh": _mesh(1, 1, 1)}


def wrapper_strategy(model) -> dict | None:
    """What the model's own wrapper says (a loop that wrapped it itself, without accelerate): DeepSpeed's engine,
    torch DDP, FSDP1, or FSDP2 `fully_shard` modules; None for a bare module (no wrapper to read)."""
    import torch

    name = type(model).__name__
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if name == "DeepSpeedEngine":
        stage = int(model.zero_optimization_stage())
        offload = getattr(model.zero_offload_optimizer(), "device", None)
        offload = getattr(offload, "value", offload) or "none"
        details = {"strategy": f"zero{stage}" + ("_offload" if offload != "none" else ""), "zero_stage": stage,
                   "offload_optimizer": offload}
        if stage == 3:
            details["stage3_param_persistence_threshold"] = model.zero_param_persistence_threshold()
        return {"world_size": world, "mesh": _mesh(1, world, 1), "wrapper": name, **details}
    if name == "DistributedDataParallel":
        return {"strategy": "ddp", "world_size": world, "mesh": _mesh(world, 1, 1), "wrapper": name}
    if name == "FullyShardedDataParallel":
        sharding = model.sharding_strategy.name
        offload = bool(getattr(model.cpu_offload, "offload_params", False))
        return {"strategy": "fsdp_offload" if offload else f"fsdp_{sharding.lower()}", "world_size": world,
                "mesh": _mesh(1, world, 1), "wrapper": name, "fsdp_version": 1, "sharding_strategy": sharding}
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)] if isinstance(model, torch.nn.Module) else []
    if units:  # a layer's unit says whether parameters are resharded after forward (the root never is)
        unit = next((m for m in units if m is not model), units[0])
        group = getattr(unit._get_fsdp_state(), "_fsdp_param_group", None)
        sharding = "SHARD_GRAD_OP" if group is not None and group.post_forward_mesh_info is None else "FULL_SHARD"
        return {"strategy": f"fsdp_{sharding.lower()}", "world_size": world, "mesh": _mesh(1, world, 1),
                "wrapper": "fully_shard", "fsdp_version": 2, "sharding_strategy": sharding}
    return None


def zero_buckets(optimizer) -> dict:
    """What DeepSpeed's ZeRO optimizer among `optimizer`'s layers was built with: `reduce_bucket_size`
    (elements: the engine passes it its config's `zero_reduce_bucket_size()`, DeepSpeed's 5e8 default where
    the config sets none, the Trainer's hidden^2 for "auto"), for ZeRO-1/2 `overlap_comm` (ZeRO-3 keeps that
    only as a stream) and `allgather_bucket_size` (elements), for ZeRO-3 `prefetch_bucket_size` (elements) and
    `stage3_param_persistence_threshold` (the live value: an inline accelerate yaml's "auto" resolved); {} for any
    other optimizer."""
    from .state_bytes import zero_optimizer

    zero = zero_optimizer(optimizer)
    if zero is None or not isinstance(getattr(zero, "reduce_bucket_size", None), int):
        return {}
    out = {"reduce_bucket_size": zero.reduce_bucket_size}
    if isinstance(getattr(zero, "overlap_comm", None), bool):
        out["overlap_comm"] = zero.overlap_comm
    if isinstance(getattr(zero, "allgather_bucket_size", None), int):  # ZeRO-1/2
        out["allgather_bucket_size"] = zero.allgather_bucket_size
    if isinstance(getattr(zero, "prefetch_elements", None), int):  # ZeRO-3
        out["prefetch_bucket_size"] = zero.prefetch_elements
    threshold = getattr(getattr(zero, "parameter_offload", None), "param_numel_persistence_threshold", None)
    if isinstance(threshold, int):
        out["stage3_param_persistence_threshold"] = threshold
    return out


def num_nodes() -> int:
    """Nodes in the run, from the launcher's environment: world size / local world size (torchrun and
    accelerate set LOCAL_WORLD_SIZE; the `deepspeed` launcher sets LOCAL_SIZE instead)."""
    import os

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


def _mesh(dp_replicate: int, dp_shard: int, tp: int) -> dict:
    return {"dp_replicate": int(dp_replicate), "dp_shard": int(dp_shard), "tp": int(tp)}


def _deepspeed_details(plugin) -> dict:
    zero = plugin.deepspeed_config.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    offload_optimizer = (zero.get("offload_optimizer") or {}).get("device", "none")
    offload_param = (zero.get("offload_param") or {}).get("device", "none")
    name = f"zero{stage}" + ("_offload" if offload_optimizer not in ("none", None) else "")
    details = {"strategy": name, "zero_stage": stage, "offload_optimizer": offload_optimizer,
               "offload_param": offload_param}
    if stage == 3:  # the effective value, DeepSpeed's default included: it decides what is not sharded
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        details["stage3_param_persistence_threshold"] = DeepSpeedZeroConfig(**zero).param_persistence_threshold
    return details


def _fsdp_details(plugin, parallelism_config) -> dict:
    version = getattr(plugin, "fsdp_version", 1)
    offload = plugin.cpu_offload
    offload_params = bool(getattr(offload, "offload_params", False)) or type(offload).__name__ == "CPUOffloadPolicy"
    if version == 2:
        replicate = getattr(parallelism_config, "dp_replicate_size", 1) if parallelism_config else 1
        sharding = "HYBRID_SHARD" if replicate > 1 else ("FULL_SHARD" if plugin.reshard_after_forward else "SHARD_GRAD_OP")
    else:
        sharding = getattr(plugin.sharding_strategy or plugin.reshard_after_forward, "name", "FULL_SHARD")
        sharding = "HYBRID_SHARD" if "HYBRID" in sharding else sharding
    name = "fsdp_offload" if offload_params else f"fsdp_{sharding.lower()}"
    return {"strategy": name, "fsdp_version": version, "sharding_strategy": sharding, "offload_params": offload_params}
