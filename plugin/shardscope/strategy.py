"""Name the distributed strategy a run is using, with the same names as the shipped configs."""
from __future__ import annotations


def detect_strategy() -> dict:
    """Read accelerate's live state: `{"strategy": NAME, "world_size": N, ...details}`.

    Call it after the Trainer has built its Accelerator. The name says what was configured; the
    per-rank byte counts in the profiler summary show whether it really sharded.
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    if not PartialState._shared_state:
        return {"strategy": "single", "world_size": 1}
    state = AcceleratorState()
    world_size = state.num_processes
    kind = state.distributed_type
    if kind == DistributedType.DEEPSPEED:
        return {"world_size": world_size, **_deepspeed_details(state.deepspeed_plugin)}
    if kind == DistributedType.FSDP:
        return {"world_size": world_size, **_fsdp_details(state.fsdp_plugin, state.parallelism_config)}
    if world_size > 1:
        return {"strategy": "ddp", "world_size": world_size, "distributed_type": str(kind.value)}
    return {"strategy": "single", "world_size": world_size}


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
