"""Which strategy a live run uses, read from accelerate's state or the model's own wrapper (the profiler's
`detected`), and the buckets DeepSpeed's ZeRO optimizer was built with. measure/ is its only user: the planner
and the tools read a strategy from a config file or a summary (strategy.py)."""
from __future__ import annotations

import os

from ..strategy import Mesh, family, named, num_nodes, sequence_split, tp_strategy
from ..units import as_int


def visible_module(model):
    """The module whose parameters and forwards are counted: the model inside a known wrapper; for an object the
    profiler does not know, the module it holds (`module` / `model`)."""
    import torch

    from .step_counts import unwrap

    held = [model] + [getattr(model, a, None) for a in ("module", "model")]
    inner = next((m for m in held if isinstance(m, torch.nn.Module)), None)
    if inner is None:
        raise TypeError(f"the model is a {type(model).__name__}, not a torch module, and holds none")
    return unwrap(inner)


def live_strategy(model, module, warn_once) -> dict:
    """The profiler's `detected`: the wrapper the loop built around `module` (`visible_module(model)`), else
    accelerate's state; "unknown" (warned once) when neither says."""
    import torch
    from accelerate.state import PartialState

    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if isinstance(model, torch.nn.Module):
        wrapped = wrapper_strategy(model)
        if PartialState._shared_state:
            configured = detect_strategy(module)  # TP meshes (FSDP2 over TP shards too) are read there
            if wrapped is None or family(configured["strategy"]) in ("tp", family(wrapped["strategy"])):
                return configured
        if wrapped is not None:
            return wrapped
        if world == 1:
            return {"strategy": "single", "world_size": 1, "mesh": {"dp_replicate": 1, "dp_shard": 1, "tp": 1}}
    warn_once("unknown wrapper", f"the model ({type(model).__name__}) is wrapped in nothing shardscope knows (DDP, "
              "FSDP, fully_shard, DeepSpeed, accelerate): strategy 'unknown', bytes counted from the parameters it "
              "exposes")
    return {"strategy": "unknown", "world_size": world, "wrapper": type(model).__name__}


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
        return {"strategy": strategy_name("tp", mesh=mesh), "world_size": world_size, "mesh": mesh,
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
        return {"strategy": strategy_name("torch"), "world_size": world_size, "mesh": _mesh(world_size, 1, 1),
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
        details = {"strategy": strategy_name("deepspeed", zero_stage=stage, offload=offload != "none"),
                   "zero_stage": stage, "offload_optimizer": offload}
        if stage == 3:
            details["stage3_param_persistence_threshold"] = model.zero_param_persistence_threshold()
            details["stage3_max_reuse_distance"] = model.zero_max_reuse_distance()
        return {"world_size": world, "mesh": _mesh(1, world, 1), "wrapper": name, **details}
    if name == "DistributedDataParallel":
        return {"strategy": strategy_name("torch"), "world_size": world, "mesh": _mesh(world, 1, 1), "wrapper": name}
    if name == "FullyShardedDataParallel":
        sharding = model.sharding_strategy.name
        offload = bool(getattr(model.cpu_offload, "offload_params", False))
        return {"strategy": strategy_name("fsdp", sharding=sharding, offload=offload), "world_size": world,
                "mesh": _mesh(1, world, 1), "wrapper": name, "fsdp_version": 1, "sharding_strategy": sharding}
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)] if isinstance(model, torch.nn.Module) else []
    if units:  # a layer's unit says whether parameters are resharded after forward (the root never is)
        unit = next((m for m in units if m is not model), units[0])
        group = getattr(unit._get_fsdp_state(), "_fsdp_param_group", None)
        sharding = "SHARD_GRAD_OP" if group is not None and group.post_forward_mesh_info is None else "FULL_SHARD"
        return {"strategy": strategy_name("fsdp", sharding=sharding), "world_size": world, "mesh": _mesh(1, world, 1),
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


def _mesh(dp_replicate: int, dp_shard: int, tp: int) -> dict:
    return Mesh(int(dp_replicate), int(dp_shard), int(tp)).as_dict()


def strategy_name(library: str, *, zero_stage: int = 0, sharding: str = "", offload: bool = False,
                  mesh: dict | None = None) -> str | None:
    """The strategy a live run's library names (the registry's record, `strategy.named`): DeepSpeed's ZeRO stage and
    offload, FSDP's sharding and offload, the TP mesh, torch's DDP; the library's own spelling where no record
    matches (DeepSpeed without ZeRO: "zero0", FSDP1's NO_SHARD: "fsdp_no_shard"); None for a library not read here."""
    if library == "deepspeed":
        return named("deepspeed", zero_stage=zero_stage, offload=offload) or f"zero{zero_stage}"
    if library == "fsdp":
        return named("fsdp", sharding=sharding, offload=offload) or f"fsdp_{sharding.lower()}"
    if library == "tp":
        return tp_strategy(mesh)
    return named("torch") if library == "torch" else None


def _deepspeed_details(plugin) -> dict:
    zero = plugin.deepspeed_config.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    offload_optimizer = (zero.get("offload_optimizer") or {}).get("device", "none")
    offload_param = (zero.get("offload_param") or {}).get("device", "none")
    name = strategy_name("deepspeed", zero_stage=stage, offload=offload_optimizer not in ("none", None))
    details = {"strategy": name, "zero_stage": stage, "offload_optimizer": offload_optimizer,
               "offload_param": offload_param}
    if stage == 3:  # effective values, DeepSpeed's defaults included: what is not sharded, what stays gathered
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        settings = DeepSpeedZeroConfig(**zero)
        details["stage3_param_persistence_threshold"] = settings.param_persistence_threshold
        details["stage3_max_reuse_distance"] = settings.max_reuse_distance
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
    name = strategy_name("fsdp", sharding=sharding, offload=offload_params)
    return {"strategy": name, "fsdp_version": version, "sharding_strategy": sharding, "offload_params": offload_params}

