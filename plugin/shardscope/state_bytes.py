"""Count the model-state bytes one rank really holds, from the live objects (never from formulas).

Every tensor is counted by its *storage*, once: a view into a flat buffer (FSDP1 flat parameters,
FSDP2 padded shards, DeepSpeed's flattened partitions) counts the buffer it lives in, which is the
memory the rank actually holds, padding included. Categories, in the order storages are claimed:

- params: the model's parameters as this rank stores them: plain tensors (DDP), FSDP1 flat-parameter
  shards, FSDP2 DTensor local shards, DeepSpeed ZeRO-3 `ds_tensor` partitions.
- grads: gradients attached to the parameters the optimizer steps (model `.grad`, or the fp32 master
  partitions' `.grad` under DeepSpeed), captured right after the optimizer step (before the Trainer
  clears them), plus ZeRO's persistent gradient-partition buffers.
- optimizer: the base optimizer's state tensors (Adam moments, step counters) and its own parameter
  tensors that are not model parameters, i.e. fp32 master copies (DeepSpeed ZeRO partitions).

Bytes are also split by device type, so offloaded state shows up under "cpu".
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

CATEGORIES = ("params", "grads", "optimizer")

# DeepSpeed ZeRO optimizer attributes that hold gradient partitions between reduction and step.
ZERO_GRAD_BUFFERS = ("grads_in_partition", "grad_partitions_flat_buffer")


@dataclass
class StateBytes:
    """Bytes per category, and per category per device type ("cpu", "cuda", ...)."""

    by_device: dict = field(default_factory=lambda: {c: defaultdict(int) for c in CATEGORIES})
    trainable_params: int = 0

    def total(self, category: str) -> int:
        return sum(self.by_device[category].values())

    def as_dict(self) -> dict:
        out = {f"{c}_bytes": self.total(c) for c in CATEGORIES}
        out["trainable_params_bytes"] = self.trainable_params
        out["bytes_by_device"] = {c: dict(self.by_device[c]) for c in CATEGORIES}
        return out


def local_tensor(tensor):
    """The part of `tensor` stored on this rank: DTensor local shard, ZeRO-3 partition, or itself."""
    if tensor is None:
        return None
    if hasattr(tensor, "ds_tensor"):  # DeepSpeed ZeRO-3 parameter: `.data` is empty between uses
        return tensor.ds_tensor
    if hasattr(tensor, "to_local"):  # DTensor (FSDP2, tensor parallel)
        return tensor.to_local()
    return tensor


def storage_entry(tensor):
    """`(key, nbytes, device_type)` of the storage behind `tensor`'s local part, or None."""
    tensor = local_tensor(tensor)
    if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
        return None
    storage = tensor.untyped_storage()
    if storage.data_ptr() == 0:
        return None
    return (tensor.device, storage.data_ptr()), storage.nbytes(), tensor.device.type


class StorageTally:
    """Adds storages to categories of `result`, counting each storage once."""

    def __init__(self, result: StateBytes):
        self.seen: set = set()
        self.result = result

    def add(self, category: str, entry, trainable: bool = False) -> None:
        if entry is None or entry[0] in self.seen:
            return
        key, nbytes, device_type = entry
        self.seen.add(key)
        self.result.by_device[category][device_type] += nbytes
        if trainable:
            self.result.trainable_params += nbytes


def model_parameters(model):
    """Unique parameters of `model`, plus FSDP1 flat parameters hidden behind `use_orig_params=True`."""
    params = {id(p): p for p in model.parameters()}
    for module in model.modules():
        flat = getattr(module, "_flat_param", None)  # torch FSDP1 FullyShardedDataParallel
        if isinstance(flat, torch.Tensor):
            params.setdefault(id(flat), flat)
    return list(params.values())


def optimizer_layers(optimizer):
    """The optimizer and every optimizer it wraps (accelerate -> DeepSpeed ZeRO -> torch)."""
    layers = []
    while optimizer is not None and optimizer not in layers:
        layers.append(optimizer)
        optimizer = getattr(optimizer, "optimizer", None)
    return layers


def base_optimizer(optimizer):
    """The innermost `torch.optim.Optimizer` (the one whose `step` updates weights), or None."""
    torch_optimizers = [o for o in optimizer_layers(optimizer) if isinstance(o, torch.optim.Optimizer)]
    return torch_optimizers[-1] if torch_optimizers else None


def stepped_gradients(optimizer) -> list:
    """Storage entries of the gradients in `optimizer`'s param groups (call from its step hooks).

    Entries, not tensors: holding the tensors would keep memory alive that the optimizer frees.
    """
    return [storage_entry(p.grad) for group in optimizer.param_groups for p in group["params"]
            if p.grad is not None]


def zero_gradient_buffers(optimizer) -> list:
    """DeepSpeed ZeRO's persistent gradient-partition buffers, if `optimizer` wraps a ZeRO optimizer."""
    buffers = []
    for layer in optimizer_layers(optimizer):
        buffers += [getattr(layer, name) for name in ZERO_GRAD_BUFFERS if getattr(layer, name, None) is not None]
    return buffers


def count_state(model, optimizer=None, grad_entries=()) -> StateBytes:
    """Count params, grads and optimizer-state bytes held by this rank.

    `grad_entries` come from `stepped_gradients` at the optimizer step (gradients are usually freed
    by the time a callback runs); the model's current `.grad` tensors and ZeRO's gradient buffers
    are added to them. Gradients are de-duplicated among themselves only: a captured gradient may
    have been freed since, and its address reused by live state.
    """
    result = StateBytes()
    live = StorageTally(result)
    params = model_parameters(model)
    for p in params:
        live.add("params", storage_entry(p), trainable=p.requires_grad)
    base = base_optimizer(optimizer)
    if base is not None:
        for group in base.param_groups:
            for p in group["params"]:
                live.add("optimizer", storage_entry(p))  # master copies; model parameters already claimed
        for state in base.state.values():
            for value in state.values():
                live.add("optimizer", storage_entry(value))
    grads = StorageTally(result)
    current = [storage_entry(p.grad) for p in params] + [storage_entry(b) for b in zero_gradient_buffers(optimizer)]
    for entry in [*grad_entries, *current]:
        grads.add("grads", entry)
    return result
