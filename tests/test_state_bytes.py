"""state_bytes, in process: each storage counted once and by device, optimizer wrappers walked once; and what it
caches between steps (the module walk, long-lived tensors' storage entries): the counts must still follow every change
a strategy makes to the live tensors. Launched: test_strategies.py (the profiler's bytes against an independent
count on every shipped config)."""
import torch

from shardscope.measure import state_bytes
from shardscope.measure.state_bytes import count_state


def test_state_counting_counts_each_storage_once_and_by_device():
    base = torch.zeros(10, 4)
    view = base[2:5]  # a view shares the storage: counted once, at the storage's full size
    other = torch.zeros(3, dtype=torch.bfloat16)
    result = state_bytes.StateBytes()
    tally = state_bytes.StorageTally(result)
    for category, tensor, trainable in (("params", base, True), ("params", view, True), ("grads", other, False),
                                        ("optimizer", base, False)):
        tally.add(category, state_bytes.storage_entry(tensor), trainable)
    assert result.total("params") == 40 * 4 and result.trainable_params == 40 * 4
    assert result.total("grads") == 3 * 2 and result.total("optimizer") == 0  # already counted as params
    assert dict(result.by_device["params"]) == {"cpu": 160}
    assert state_bytes.storage_entry(torch.empty(3, device="meta")) is None


def test_optimizer_layers_walk_wrappers_once():
    inner = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    outer = type("Wrapper", (), {})()
    outer.optimizer = inner
    assert state_bytes.optimizer_layers(outer) == [outer, inner]
    assert state_bytes.base_optimizer(outer) is inner


def test_counts_follow_swapped_resized_and_added_tensors():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    first = count_state(model, optimizer)
    assert first.total("params") == 4 * (8 * 8 + 8 + 8 * 4 + 4)
    assert count_state(model, optimizer).by_device == first.by_device  # cached: same answer

    # FSDP swaps a module's parameter object (sharded <-> unsharded): the new one is counted
    model[1].weight = torch.nn.Parameter(torch.ones(4, 16))
    assert count_state(model, optimizer).total("params") == first.total("params") + 4 * 4 * 8
    # `.data` replaced on the same object (ZeRO-3 gathering, offload): a new pointer, counted afresh
    model[0].bias.data = torch.ones(100)
    assert count_state(model, optimizer).total("params") == first.total("params") + 4 * 4 * 8 + 4 * (100 - 8)
    # an optimizer state tensor replaced (a reloaded checkpoint): counted afresh
    before = count_state(model, optimizer).total("optimizer")
    optimizer.state[model[0].weight]["exp_avg"] = torch.zeros(3)
    assert count_state(model, optimizer).total("optimizer") == before - 4 * (64 - 3)
    # a parameter frozen between steps (same tensor, same address): no longer trainable
    trainable = count_state(model, optimizer).trainable_params
    model[1].weight.requires_grad_(False)
    assert count_state(model, optimizer).trainable_params == trainable - 4 * 4 * 16
    # the cached count is a copy: gradients added to one result never leak into the next
    grads = count_state(model, optimizer, grad_entries=[((torch.device("cpu"), 1), 1000, "cpu")]).total("grads")
    assert grads == 1000 and count_state(model, optimizer, grad_entries=[]).total("grads") == 0


def test_a_new_module_is_seen_after_forget():
    """The module tree is cached per model until `forget` (the callback calls it at each train begin)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    before = count_state(model).total("params")
    model.append(torch.nn.Linear(4, 4))  # e.g. adapters added between two train() calls
    state_bytes.forget(model)
    assert count_state(model).total("params") == 2 * before


def test_a_dead_tensor_is_never_mistaken_for_a_new_one_at_its_id():
    """The cached count knows its tensors by id: when one dies (its id free for a new tensor) the count is stale
    at once. Numbers in the optimizer state are no tensors: left out."""
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    assert count_state(model, optimizer).total("optimizer") == 4 * (16 + 4)  # momentum buffers
    for state in optimizer.state.values():
        state["momentum_buffer"] = torch.zeros(1)  # the old buffers die: their ids may come back
        state["note"] = 1.5
    assert state_bytes._LIVE[model].stale
    assert count_state(model, optimizer).total("optimizer") == 4 * 2


def test_caches_by_identity_keep_no_entry_past_its_key():
    """state_bytes' per-model and per-optimizer caches are found by the key's id: an entry must leave as its key
    dies (before the id can name a new object), and a key no weak reference can point at is not kept."""
    cache = state_bytes.ByIdentity()
    model, twin = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    twin.load_state_dict(model.state_dict())  # equal, not the same object
    cache[model] = "walk"
    assert cache.get(model) == "walk" and cache[model] == "walk" and cache.get(twin) is None
    del model
    assert cache._data == {}
    cache[7] = "not kept"
    assert cache.get(7) is None and cache.pop(twin, "none") == "none"


def test_a_state_tensor_swapped_for_a_live_one_is_counted_afresh():
    """The cached count compares the objects it read by identity, not only whether one died: a state tensor replaced
    by another live one (the weight's buffer, shared) is counted afresh."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 8)).sum().backward()
    optimizer.step()
    before = count_state(model, optimizer).total("optimizer")
    small, large = optimizer.state[model[1].bias], optimizer.state[model[0].weight]
    kept = small["momentum_buffer"]  # still alive, no longer in the state
    small["momentum_buffer"] = large["momentum_buffer"]
    assert not state_bytes._LIVE[model].stale  # every counted tensor still lives: no death marks the count stale
    assert count_state(model, optimizer).total("optimizer") == before - kept.nbytes  # one storage, counted once
