"""Name the distributed strategy a run is using, with the same names as the shipped configs."""
from __future__ import annotations

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
    if kind == DistributedType.DEEPSPEED:
        return {"world_size": world_size, "mesh": _mesh(1, world_size, 1), **_deepspeed_details(state.deepspeed_plugin)}
    if kind == DistributedType.FSDP:
        details = _fsdp_details(state.fsdp_plugin, pc)
        replicate = 1
        if details["sharding_strategy"] == "HYBRID_SHARD":  # FSDP2: the mesh; FSDP1: shards within each node
            replicate = pc.dp_replicate_size if pc is not None and pc.dp_replicate_size > 1 else num_nodes()
        return {"world_size": world_size, "mesh": _mesh(replicate, world_size // replicate, 1), **details}
    if world_size > 1:
        return {"strategy": "ddp", "world_size": world_size, "mesh": _mesh(world_size, 1, 1),
                "distributed_type": str(kind.value)}
    return {"strategy": "single", "world_size": world_size, "mesh": _mesh(1, 1, 1)}


def tp_strategy(mesh: dict) -> str:
    """The shipped config name of a tensor-parallel mesh: replicas -> hsdp_tp, shards -> fsdp_tp, else tp."""
    return "hsdp_tp" if mesh["dp_replicate"] > 1 else "fsdp_tp" if mesh["dp_shard"] > 1 else "tp"


def num_nodes() -> int:
    """Nodes in the run, from the launcher's environment (world size / local world size)."""
    import os

    world, local = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_WORLD_SIZE", 0))
    return max(1, world // local) if local else 1


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
