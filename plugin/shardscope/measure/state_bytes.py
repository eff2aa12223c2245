"""Count the model-state bytes one rank really holds, from the live objects (never from formulas).

Every tensor is counted by its *storage*, once: a view into a flat buffer (FSDP1 flat parameters,
FSDP2 padded shards, DeepSpeed's flattened partitions) counts the buffer it lives in, which is the
memory the rank actually holds, padding included. Categories, in the order storages are claimed:

- params: the model's parameters as this rank stores them: plain tensors (DDP), FSDP1 flat-parameter
  shards, FSDP2 DTensor local shards, DeepSpeed ZeRO-3 `ds_tensor` partitions (plus the full `.data`
  of ZeRO-3's persistent small parameters, which every rank keeps).
- grads: every gradient storage held when the optimizer step begins (the Trainer frees gradients
  before any callback could see them, so the callback snapshots them from a step hook): the
  parameters' `.grad` (ZeRO-1 still holds full-size ones there), the optimizer's own parameters'
  `.grad`, and DeepSpeed ZeRO's gradient-partition buffers.
  A bitsandbytes-quantised weight (QLoRA: `Params4bit`, `Int8Params`) counts its packed data and its quantisation
  state (absmax, codes, offset, the nested state of double quantisation; LLM.int8's row scales `SCB`).
- optimizer: the base optimizer's state tensors (Adam moments, step counters) and the weight copies
  it updates that are not model parameters, i.e. fp32 master copies (DeepSpeed ZeRO partitions).

Bytes are also split by device type, so offloaded state shows up under "cpu".
"""
from __future__ import annotations

import weakref
from array import array
from collections import defaultdict
from contextlib import suppress
from dataclasses import dataclass, field
from functools import partial
from itertools import chain, compress, repeat
from operator import attrgetter, call, is_, is_not, itemgetter

import torch

CATEGORIES = ("params", "grads", "optimizer")
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensors that are their own local part (not DTensor & co)
_PLAIN_SET = frozenset(_PLAIN)

# DeepSpeed ZeRO optimizer attributes that hold gradients between reduction and step
# (runtime/zero/stage_1_and_2.py, runtime/zero/stage3.py).
ZERO_GRAD_BUFFERS = ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer")
# ... and the fp32 master partitions (ZeRO-3 empties the inner optimizer's param groups between steps).
ZERO_MASTER_WEIGHTS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")


@dataclass
class StateBytes:
    """Bytes per category, and per category per device type ("cpu", "cuda", ...)."""

    by_device: dict = field(default_factory=lambda: {c: defaultdict(int) for c in CATEGORIES})
    trainable_params: int = 0

    def total(self, category: str) -> int:
        return sum(self.by_device[category].values())

    def copy(self) -> "StateBytes":
        return StateBytes({c: held.copy() for c, held in self.by_device.items()}, self.trainable_params)


def local_tensor(tensor):
    """The part of `tensor` stored on this rank: a DTensor's local shard, or the tensor itself."""
    if hasattr(tensor, "to_local"):  # DTensor (FSDP2, tensor parallel)
        return tensor.to_local()
    return tensor


def storage_entry(tensor):
    """`(key, nbytes, device_type)` of the storage behind `tensor`'s local part, or None."""
    if type(tensor) not in _PLAIN:  # a DTensor's local shard; what is no tensor has no storage
        tensor = local_tensor(tensor)
        if not isinstance(tensor, torch.Tensor):
            return None
    if tensor.is_cpu:  # no device object to build
        return _cpu_entry(tensor)
    if tensor.is_meta:
        return None
    storage = tensor.untyped_storage()
    pointer = storage.data_ptr()
    if pointer == 0:
        return None
    device = tensor.device
    return (device, pointer), storage.nbytes(), _device_type(device)


def _cpu_entry(tensor):
    """`storage_entry` of a CPU tensor's local part (`storage_entries` calls it for plain ones directly)."""
    storage = tensor.untyped_storage()
    pointer = storage.data_ptr()
    return ((_CPU, pointer), storage.nbytes(), "cpu") if pointer else None


_CPU = torch.device("cpu")


_DEVICE_TYPES: dict = {}


def _device_type(device) -> str:
    """`device.type`, remembered: reading it builds a new string each time (~1 us, per gradient per measurement)."""
    known = _DEVICE_TYPES.get(device)
    return known if known is not None else _DEVICE_TYPES.setdefault(device, device.type)


# id(tensor) -> (weak reference, data pointer, entry) for tensors that live across steps (parameters, optimizer
# state): the same tensor at the same address still has the same storage (a storage that is resized or freed
# moves or drops its pointer), so its entry is reused; anything else is read afresh.
_ENTRIES: dict = {}


def cached_entry(tensor):
    """`storage_entry(tensor)`, reused while the tensor object and its data pointer are unchanged."""
    if type(tensor) not in _PLAIN:  # DTensor & co: their local shard is a new object
        return storage_entry(tensor)
    hit = _ENTRIES.get(id(tensor))
    pointer = tensor.data_ptr()
    if hit is not None and hit[0]() is tensor and hit[1] == pointer:
        return hit[2]
    entry = storage_entry(tensor)
    if len(_ENTRIES) > 1_000_000:  # models are far smaller; a bound, not a policy
        _ENTRIES.clear()
    _ENTRIES[id(tensor)] = (weakref.ref(tensor), pointer, entry)
    return entry


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


class ByIdentity:
    """{object: value} kept in a plain dict by the key's id, each entry leaving as its key dies (a weak reference's
    callback, run before the id can be reused): a `WeakKeyDictionary` look-up is Python code that makes a weak
    reference, ~6 us once a training step has left it out of the cache, and a measuring step makes six. A key that
    takes no weak reference is not kept."""

    __slots__ = ("_data",)

    def __init__(self):
        self._data: dict = {}

    def get(self, key, default=None):
        held = self._data.get(id(key))  # an id in here is a live key's
        return default if held is None else held[1]

    def __getitem__(self, key):
        return self._data[id(key)][1]

    def __setitem__(self, key, value) -> None:
        ident, data = id(key), self._data
        with suppress(TypeError):
            data[ident] = (weakref.ref(key, lambda _, ident=ident: data.pop(ident, None)), value)

    def pop(self, key, default=None):
        held = self._data.pop(id(key), None)
        return default if held is None else held[1]


# model -> the modules that hold parameters: walking every module is most of a measurement's cost and the
# module tree does not change between steps (the parameters themselves may: FSDP swaps them, so they are read
# fresh from these modules each time). `forget(model)` drops the entry (the callback does at train begin).
_OWNERS = ByIdentity()


# model -> its last live-state count (`live_state`, `_LastCount`); kept by `forget`: every count checks it against
# all it was read from, so a new run whose tensors are unchanged (the next `train()` call) need not count afresh.
_LIVE = ByIdentity()


def forget(model) -> None:
    _OWNERS.pop(model, None)


def _owners(model) -> tuple:
    """(live views of the parameter dicts of the modules holding any, FSDP1 modules holding a flat parameter) of
    `model`, walked once."""
    owners = _OWNERS.get(model)
    if owners is None:
        modules = list(model.modules())
        owners = _OWNERS[model] = (tuple(m._parameters.values() for m in modules if m._parameters),
                                   tuple(m for m in modules if isinstance(getattr(m, "_flat_param", None), torch.Tensor)))
    return owners


def model_parameters(model):
    """Unique parameters of `model`, plus FSDP1 flat parameters hidden behind `use_orig_params=True`."""
    holders, fsdp1 = _owners(model)
    found = [*chain.from_iterable(holders)]
    params = dict(zip(map(id, found), found))  # C loops; a parameter registered as None is dropped below
    params.pop(id(None), None)
    for module in fsdp1:  # torch FSDP1 FullyShardedDataParallel
        flat = module._flat_param
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
    return _base_and_zero(optimizer)[0]


def zero_optimizer(optimizer):
    """The DeepSpeed ZeRO optimizer among `optimizer`'s layers, or None."""
    return _base_and_zero(optimizer)[1]


# optimizer -> (base, zero), held through weak references (the base is often the key itself: a strong one would keep
# the optimizer alive for ever): the layers of a built optimizer do not change (DeepSpeed sets its ZeRO buffers in
# __init__; the profiler hooks these layers at its start), and finding them costs failed attribute lookups per layer
_LAYERS = ByIdentity()


def _base_and_zero(optimizer) -> tuple:
    if optimizer is None:
        return None, None
    known = _LAYERS.get(optimizer)  # (read at every measurement: no generator)
    if known is not None:
        base, zero = known
        return None if base is None else base(), None if zero is None else zero()
    layers = optimizer_layers(optimizer)
    torch_optimizers = [o for o in layers if isinstance(o, torch.optim.Optimizer)]
    found = (torch_optimizers[-1] if torch_optimizers else None,
             next((layer for layer in layers if any(hasattr(layer, name) for name in ZERO_GRAD_BUFFERS)), None))
    with suppress(TypeError):  # no weak reference can point at a layer: not kept
        _LAYERS[optimizer] = tuple(None if layer is None else weakref.ref(layer) for layer in found)
    return found


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def master_weights(optimizer) -> list:
    """The optimizer's own copies of the weights it updates (DeepSpeed fp32 master partitions)."""
    copies = []
    base, zero = _base_and_zero(optimizer)
    if base is not None:
        copies += [p for group in base.param_groups for p in group["params"]]
    if zero is not None:
        copies += [t for name in ZERO_MASTER_WEIGHTS for t in _tensors(getattr(zero, name, None))]
    return copies


def zero3_partitions(model) -> list:
    """DeepSpeed ZeRO-3's parameter partitions (`ds_tensor`, views of its flat partitioned groups): what a ZeRO-3 rank
    holds of its parameters outside their `.data`, which stays empty until a module gathers it (none elsewhere)."""
    return [t for t in (getattr(p, "ds_tensor", None) for p in model_parameters(model)) if isinstance(t, torch.Tensor)]


def zero_grad_buffers(optimizer) -> list:
    """DeepSpeed ZeRO's gradient partition buffers (empty for other optimizers)."""
    zero = zero_optimizer(optimizer)
    return [t for name in ZERO_GRAD_BUFFERS for t in _tensors(getattr(zero, name, None))] if zero is not None else []


def state_walk(model, optimizer=None) -> tuple:
    """(the model's parameters, the optimizer's weight copies): what the gradient snapshot and the state count both
    read, so that a measuring step can walk them once (they do not change within an optimizer step)."""
    return model_parameters(model), master_weights(optimizer)


def held_gradients(model, optimizer=None, walk=None) -> list:
    """Storage entries of every gradient this rank holds right now (call it as the step begins); `walk`: this
    moment's `state_walk` (None: read now).

    Entries, not tensors: holding the tensors would keep alive memory the optimizer frees.
    """
    params, masters = walk or state_walk(model, optimizer)
    found = [*params, *masters]
    owners = dict(zip(map(id, found), found))
    return storage_entries([*filter(_present, chain(map(_grad, owners.values()), zero_grad_buffers(optimizer)))])


def storage_entries(tensors: list) -> list:
    """`[storage_entry(t) for t in tensors]`, plain CPU tensors read without its checks (a measuring step reads every
    gradient)."""
    return [_cpu_entry(t) if type(t) in _PLAIN and t.is_cpu else storage_entry(t) for t in tensors]


def _live_objects(model, optimizer, walk=None) -> tuple:
    """What `live_tensors` reads: (parameters, each one's ZeRO-3 partition or `_NO_PARTITION`, the optimizer's
    weight copies, its state tensors); `walk`: the first and third, already read (`state_walk`)."""
    params, masters = walk or state_walk(model, optimizer)
    base = base_optimizer(optimizer)
    state = [value for held in base.state.values() for value in held.values()] if base is not None else []
    if not set(map(type, state)) <= _PLAIN_SET:  # numbers, None: left out (a C loop decides it, most often)
        state = [v for v in state if isinstance(v, torch.Tensor)]
    shards = list(map(getattr, params, repeat("ds_tensor"), repeat(_NO_PARTITION)))
    return params, shards, masters, state


def live_tensors(model, optimizer=None, objects=None) -> list:
    """(category, tensor, trainable) for every long-lived state tensor, in the order storages are claimed:
    parameters (and ZeRO-3 partitions), then the optimizer's weight copies and state."""
    params, shards, masters, state = objects or _live_objects(model, optimizer)
    items = [("params", stored, p.requires_grad) for p, shard in zip(params, shards)
             for stored in (p, shard) if isinstance(stored, torch.Tensor)]
    claimed = {id(p) for p in params}  # model parameters were claimed first
    items += [("optimizer", copy, False) for copy in masters
              if id(copy) not in claimed and isinstance(copy, torch.Tensor)]
    items += [("optimizer", value, False) for value in state]
    return items


class _LastCount:
    """A model's last live-state count and what it was counted from (`live_state`). Its objects are held by weak
    references, whose callback marks the count stale as soon as one of them dies. Pointers are kept in an array:
    comparing them reads one block of memory, not an int object per tensor (which a training step has long
    evicted)."""

    def __init__(self, objects: tuple, sizes: tuple, trainable: list, copies: list, pointers: array,
                 counted: StateBytes):
        self.sizes, self.trainable, self.copies, self.pointers, self.counted = \
            sizes, trainable, copies, pointers, counted
        self._died = died = []  # the callback holds this list, not the count: no reference cycle
        self._refs = [weakref.ref(t, died.append) for t in chain.from_iterable(objects)]

    @property
    def stale(self) -> bool:
        return bool(self._died)

    def same_objects(self, objects: tuple) -> bool:
        """`objects` (as many as counted: `sizes` checked first) are the very objects counted, in order (each
        reference called and compared by identity in C loops: no int object made per tensor, as ids would)."""
        return all(map(is_, map(call, self._refs), chain.from_iterable(objects)))


class _NoPartition:
    """Stands for a parameter's missing ZeRO-3 partition (a weak reference can point at it, unlike None)."""


_NO_PARTITION = _NoPartition()


def live_state(model, optimizer=None, walk=None) -> StateBytes:
    """Parameter and optimizer-state bytes (no gradients). The last count is reused while every object read is the
    same plain tensor at the same address (the `cached_entry` rule applied to the whole list) and the same
    parameters are trainable: a measurement then only compares objects, flags and pointers (in C loops). `walk`: as
    in `_live_objects`."""
    objects = params, shards, masters, state = _live_objects(model, optimizer, walk)
    sizes, trainable = (len(params), len(masters), len(state)), list(map(_requires_grad, params))
    last = _LIVE.get(model)
    if (last is not None and not last.stale and last.sizes == sizes and last.trainable == trainable
            and last.same_objects(objects) and last.pointers == _pointers(*objects, last.copies)):
        return last.counted.copy()
    result = StateBytes()
    tally = StorageTally(result)
    for category, tensor, trainable_tensor in live_tensors(model, optimizer, objects):
        tally.add(category, cached_entry(tensor), trainable_tensor)
    # DTensor & co: counted afresh each time
    if all(type(t) in _PLAIN for t in chain(params, filter(_partition, shards), masters, state)):
        claimed = set(map(id, params))
        copies = [id(copy) not in claimed for copy in masters]  # a torch optimizer's copies are the parameters
        _LIVE[model] = _LastCount(objects, sizes, trainable, copies, _pointers(*objects, copies), result.copy())
    return result


_requires_grad, _grad, _data_ptr = attrgetter("requires_grad"), attrgetter("grad"), torch.Tensor.data_ptr
_present, _partition = partial(is_not, None), partial(is_not, _NO_PARTITION)


def _pointers(params, shards, masters, state, copies) -> array:
    """Data pointers of the live objects, each once: `copies` selects the weight copies that are no parameter."""
    return array("Q", map(_data_ptr, chain(params, filter(_partition, shards), compress(masters, copies), state)))


def gradient_bytes(entries) -> dict:
    """{device type: bytes} of `held_gradients` entries, each storage once. Gradients are de-duplicated among
    themselves only: a snapshot's storage may have been freed since, and its address reused by live state."""
    return distinct_bytes(entries)


def distinct_bytes(entries) -> dict:
    """{device type: bytes} of `storage_entries`, each storage once."""
    entries = list(filter(None, entries))
    held = {}
    for _, nbytes, device_type in dict(zip(map(_storage_key, entries), entries)).values():
        held[device_type] = held.get(device_type, 0) + nbytes
    return held


def count_state(model, optimizer=None, grad_entries=None, walk=None, grad_bytes=None) -> StateBytes:
    """Count params, grads and optimizer-state bytes held by this rank.

    `grad_entries` is a `held_gradients` snapshot taken as the optimizer step began (None: now), `grad_bytes` its
    `gradient_bytes` (the profiler reduces it in the step hook, while the entries are still in cache); `walk` the
    `state_walk` it read, when no parameter or weight copy can have changed since (None: read now).
    """
    result = live_state(model, optimizer, walk)
    for device_type, nbytes in distinct_bytes(storage_entries(quantization_state(model))).items():
        result.by_device["params"][device_type] += nbytes
    if grad_bytes is None:
        grad_bytes = gradient_bytes(held_gradients(model, optimizer, walk) if grad_entries is None else grad_entries)
    held = result.by_device["grads"]
    for device_type, nbytes in grad_bytes.items():
        held[device_type] += nbytes
    return result


def quantization_state(model) -> list:
    """The tensors of the quantisation state bitsandbytes keeps beside each quantised weight (absent elsewhere):
    4-bit `quant_state` (absmax, code, offset; double quantisation's `state2` absmax and code), 8-bit `SCB`. A
    4-bit layer keeps its state on the module too (`Linear4bit.quant_state`), where it stays when FSDP replaces
    the parameter: whole on every rank."""
    tensors = []
    for owner in (*model.parameters(), *model.modules()):
        state = getattr(owner, "quant_state", None)
        nested = getattr(state, "state2", None)
        parts = (getattr(state, "absmax", None), getattr(state, "code", None), getattr(state, "offset", None),
                 getattr(nested, "absmax", None), getattr(nested, "code", None), getattr(owner, "SCB", None))
        tensors += [t for t in parts if isinstance(t, torch.Tensor)]
    return tensors


_storage_key = itemgetter(0)
