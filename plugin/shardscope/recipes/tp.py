"""Tensor parallelism in a recipe: the mesh asked for (checked against the model and the launcher), the
`DistributedConfig` that shards the model while it loads, the `TrainingArguments` such a model needs,
and copying CPU shards that still hold the whole checkpoint tensor.
"""
from __future__ import annotations

import os

from ..errors import UsageError
from ..model.spec import attention_heads
from ..plan.mesh import tp_heads_problem

MESH_ENV = {"tp": "PARALLELISM_CONFIG_TP_SIZE", "dp_shard": "PARALLELISM_CONFIG_DP_SHARD_SIZE",
            "dp_replicate": "PARALLELISM_CONFIG_DP_REPLICATE_SIZE"}  # what `accelerate launch` exports


def tensor_parallel_mesh(config, name_or_path: str, tp_size: int | None = None) -> dict | None:
    """The `{"dp_replicate", "dp_shard", "tp"}` mesh of a tensor-parallel run, or None without TP.

    The degrees come from `--tp_size` or from the launcher config's `parallelism_config` (accelerate
    exports it as PARALLELISM_CONFIG_*); with `--tp_size` alone the remaining ranks shard (FSDP2).
    Checked against the model and WORLD_SIZE before any weight loads.
    """
    env = {key: int(os.environ[var]) for key, var in MESH_ENV.items() if os.environ.get(var)}
    if tp_size is not None and env.get("tp", tp_size) != tp_size and env.get("tp", 1) > 1:
        raise UsageError(f"--tp_size {tp_size} disagrees with the launcher config's parallelism_config_tp_size "
                         f"{env['tp']}; give one of them")
    tp = tp_size if tp_size is not None else env.get("tp", 1)
    if tp < 1:
        raise UsageError(f"--tp_size must be at least 1, got {tp}")
    if tp == 1:
        return None
    for flag, strategy in (("ACCELERATE_USE_FSDP", "an FSDP"), ("ACCELERATE_USE_DEEPSPEED", "a DeepSpeed")):
        if os.environ.get(flag, "false").lower() == "true":
            raise UsageError(f"tensor parallelism was asked for under {strategy} launcher config: transformers "
                             "shards the model while loading it, so launch with accelerate_configs/tp.yaml, "
                             "fsdp_tp.yaml or hsdp_tp.yaml (distributed_type MULTI_GPU) instead")
    world = int(os.environ.get("WORLD_SIZE", 1))
    replicate = env.get("dp_replicate", 1)
    if world % (tp * replicate):
        raise UsageError(f"tp_size {tp} x dp_replicate_size {replicate} does not divide the {world} processes")
    shard = world // (tp * replicate) if tp_size is not None or "dp_shard" not in env else env["dp_shard"]
    if replicate * shard * tp != world:
        raise UsageError(f"parallelism_config: dp_replicate_size {replicate} x dp_shard_size {shard} x tp_size {tp} "
                         f"= {replicate * shard * tp}, but the launcher started {world} processes")
    heads, kv_heads = attention_heads(config)
    if heads is None or tp_heads_problem(tp, heads, kv_heads):
        raise UsageError(f"tp_size {tp} must divide the attention heads of '{name_or_path}' "
                         f"(num_attention_heads {heads}, num_key_value_heads {kv_heads})")
    if not getattr(config, "base_model_tp_plan", None):
        raise UsageError(f"model '{name_or_path}' ({config.model_type}) has no tensor-parallel plan in transformers "
                         "(config.base_model_tp_plan); use FSDP or DeepSpeed instead")
    return {"dp_replicate": replicate, "dp_shard": shard, "tp": tp}


def distributed_config(mesh: dict):
    """transformers' `DistributedConfig` for `mesh`: TP (and FSDP2) applied while the weights load."""
    from transformers.distributed import DistributedConfig

    return DistributedConfig(tp_size=mesh["tp"], fsdp_size=mesh["dp_shard"], dp_replicate_size=mesh["dp_replicate"])


def tensor_parallel_training_args(training_args, mesh: dict) -> None:
    """Adjust `TrainingArguments` for a model sharded while loading (call before building the Trainer).

    - transformers cannot checkpoint the optimizer of such a model: checkpoints hold the model only.
    - transformers 5.23's Trainer sets accelerate's `ParallelismConfig(tp_size, dp_shard_size=all
      data-parallel ranks)` but leaves `dp_replicate_size` to the launcher's environment, so under
      HSDP x TP the replicas count twice ("Mesh should not be bigger than default world size"). We give
      accelerate one data-parallel dimension (it only splits batches with it); the model keeps its own
      replicate x shard x tp mesh.
    """
    from accelerate import ParallelismConfig

    if training_args.deepspeed:
        raise UsageError("--deepspeed with tensor parallelism: transformers shards the model while loading it, "
                         "DeepSpeed would partition it again; use accelerate_configs/fsdp_tp.yaml instead")
    if training_args.save_strategy != "no" and not training_args.save_only_model:
        training_args.save_only_model = True
        if training_args.process_index == 0:
            print("[shardscope] tensor parallel: checkpoints hold the model only (save_only_model)", flush=True)
    training_args.parallelism_config = ParallelismConfig(
        dp_replicate_size=1, dp_shard_size=mesh["dp_replicate"] * mesh["dp_shard"], tp_size=mesh["tp"])


def compact_tp_shards(model) -> int:
    """Copy tensor-parallel shards that are views of a whole checkpoint tensor; return the bytes freed.

    transformers 5.23 loads a TP shard as `full_tensor[rows].to(device)`: on a GPU that copies the
    slice, but on CPU `.to("cpu")` returns the view itself, so every column-parallel shard keeps the
    whole tensor alive (tp x the memory the mesh promises; the profiler shows it). Copying the slice
    once, in place (the same parameter objects, so ties and hooks stay), makes a CPU run hold what a
    GPU run holds. `_local_tensor` is the DTensor's shard itself (`to_local()` returns an alias).
    """
    import torch

    freed = 0
    with torch.no_grad():
        for param in model.parameters():
            local = getattr(param, "_local_tensor", None)
            if local is None or local.untyped_storage().nbytes() <= local.nbytes:
                continue
            freed += local.untyped_storage().nbytes() - local.nbytes
            local.set_(local.clone())
    return freed
