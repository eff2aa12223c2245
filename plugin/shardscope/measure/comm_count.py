"""Every collective a rank issues during one optimizer step, counted by kind, with its size.

Mechanism: a `TorchDispatchMode` that sees each `c10d` operator on the way to the backend. Every
collective in torch reaches the dispatcher as one of these operators, whoever issues it: the Python
API (`dist.all_reduce`, ... as FSDP1, FSDP2 and DeepSpeed ZeRO use it), DDP's C++ reducer (its
`ProcessGroup::allreduce` calls `c10d::allreduce_` through the dispatcher; no Python wrapper or comm
hook is needed, and a comm hook could only be registered once, before the first backward), and
DTensor's functional collectives (`_c10d_functional.*`, tensor parallelism). Like torch's
`CommDebugMode`, the mode hands operators on DTensors back (`NotImplemented`) so DTensor
desugars them into the collectives it really issues; unlike it, it also records sizes and group sizes.
The profiler's record names were the alternative: they carry no dtype, and list arguments (every
`c10d::allreduce_`) have no shapes there. A Python dispatch mode slows every operator, so it runs on
one sampled step only (kept out of throughput and out of the timed step).

Per kind (`KINDS`): `calls`, `bytes` = the collective's full logical size (all_reduce, broadcast, reduce:
the tensor; all_gather and gather: the gathered output; reduce_scatter and scatter: the unscattered
input; all_to_all: the input), and `sent_bytes` = what this rank sends under the planner's convention,
ring algorithms averaged over the group of n ranks: all_reduce 2(n-1)/n of the bytes, all_gather,
reduce_scatter, all_to_all, broadcast, reduce, gather, scatter (n-1)/n, send all, recv and barrier
nothing. (gloo runs a reduce_scatter as an all-reduce, so it really moves twice that: the convention
is the algorithm's, not the backend's.) An operator the table does not know is counted as `other`
(bytes: its tensors; sent: none) with a one-time warning.
"""
from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from .guard import Instrument, WarnOnce

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "gather", "scatter",
         "send", "recv", "barrier", "other")
# "deepspeed": Ulysses sequence parallelism's all-to-all is the custom operator deepspeed::dim_zero_all_to_all
# (DeepSpeed 0.19, deepspeed/sequence/layer.py); running it under the mode hides the c10d call inside.
NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "_dtensor", "deepspeed")
KIND_OF = {
    **dict.fromkeys(("allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_", "all_reduce_coalesced",
                     "all_reduce_coalesced_"), "all_reduce"),
    **dict.fromkeys(("_allgather_base_", "allgather_", "allgather_coalesced_", "allgather_into_tensor_coalesced_",
                     "all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced"),
                    "all_gather"),
    **dict.fromkeys(("_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_",
                     "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"), "reduce_scatter"),
    **dict.fromkeys(("broadcast_", "broadcast"), "broadcast"),
    "reduce_": "reduce",
    **dict.fromkeys(("alltoall_", "alltoall_base_", "all_to_all_single", "shard_dim_alltoall", "dim_zero_all_to_all"),
                    "all_to_all"),
    "gather_": "gather", "scatter_": "scatter", "send": "send",
    **dict.fromkeys(("recv_", "recv_any_source_"), "recv"),
    **dict.fromkeys(("barrier", "monitored_barrier_"), "barrier"),
}
NOT_COLLECTIVES = {"wait_tensor", "wait", "_wrap_tensor_autograd"}  # waits and wrappers of collectives counted
FIELDS = ("calls", "bytes", "sent_bytes")
# Flat per-rank figures for the callback's one cross-rank all_gather (NaN where not counted).
RANK_FIELDS = (*(f"comm_{kind}_{field}" for kind in KINDS for field in FIELDS), "comm_sent_bytes_per_step",
               "comm_padded_tokens")


def sent_share(kind: str, n: int) -> float:
    """Bytes a rank sends per logical byte of a `kind` collective over n ranks (ring, averaged over ranks)."""
    if kind == "send":
        return 1.0
    if kind in ("recv", "barrier", "other") or n <= 1:
        return 0.0
    return (2 if kind == "all_reduce" else 1) * (n - 1) / n


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _group_size(bound: dict) -> int:
    """Ranks in the collective's group: the ProcessGroup argument, a functional op's group, or the world."""
    if isinstance(bound.get("group_size"), int):
        return bound["group_size"]
    group = bound.get("process_group")
    if group is None and isinstance(bound.get("group_name"), str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(bound["group_name"])
    if group is not None and hasattr(group, "size"):
        return int(group.size())
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def collective_size(kind: str, func, args, kwargs) -> tuple[int, int]:
    """(logical bytes, group size) of one collective call, from its schema's argument names."""
    bound = {**dict(zip((a.name for a in func._schema.arguments), args)), **kwargs}
    n = _group_size(bound)
    if kind == "other":
        return _nbytes(list(bound.values())), n
    if kind == "barrier":  # its tensor is a placeholder
        return 0, n
    outputs = [v for k, v in bound.items() if k.startswith("output")]
    inputs = [v for k, v in bound.items() if k.startswith(("input", "tensor", "self"))]
    if kind == "all_gather" and outputs:
        return _nbytes(outputs), n
    if kind in ("all_gather", "gather"):  # functional all-gathers name only their input; gather's output is the root's
        return _nbytes(inputs) * n, n
    if kind == "scatter":  # the input exists on the root only
        return _nbytes(outputs) * n, n
    return _nbytes(inputs), n


class CollectiveCounter(TorchDispatchMode):
    """`with CollectiveCounter() as counter: <one optimizer step>`, then `counter.result()`. Counting runs under
    `instrument` (a failure disables it; every operator still runs, once)."""

    def __init__(self, instrument: Instrument | None = None):
        super().__init__()
        self.totals = {kind: dict.fromkeys(FIELDS, 0) for kind in KINDS}
        self.instrument = instrument or Instrument("collectives", WarnOnce())
        self._count = self.instrument.wrap(self._record)
        self.unknown: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            # DTensor desugars into the collectives it issues. Only DTensor, as torch's CommDebugMode: handed back,
            # the FakeTensors of DTensor's sharding propagation (FSDP2's clip_grad_norm_) find no handler at all.
            return NotImplemented
        if func.namespace in NAMESPACES:
            self._count(func, args, kwargs)
        return func(*args, **kwargs)

    def _record(self, func, args, kwargs):
        name = func._schema.name.split("::")[-1]
        if name in NOT_COLLECTIVES or (func.namespace in ("_dtensor", "deepspeed") and name not in KIND_OF):
            return
        kind = KIND_OF.get(name, "other")
        if kind == "other" and name not in self.unknown:
            self.unknown.add(name)
            self.instrument.warn(f"collective {name}", f"collective {func.namespace}.{name} is not in shardscope's table: "
                                             "counted as 'other' (its tensors' bytes, nothing sent)")
        nbytes, n = collective_size(kind, func, args, kwargs)
        total = self.totals[kind]
        total["calls"] += 1
        total["bytes"] += nbytes
        total["sent_bytes"] += int(round(nbytes * sent_share(kind, n)))

    def result(self) -> dict:
        """{"comm": {kind: {calls, bytes, sent_bytes}} (kinds seen), "comm_sent_bytes_per_step": int}."""
        comm = {kind: dict(t) for kind, t in self.totals.items() if t["calls"]}
        return {"comm": comm, "comm_sent_bytes_per_step": sum(t["sent_bytes"] for t in comm.values())}


def to_fields(counted: dict | None) -> dict:
    """A `result()` as flat `RANK_FIELDS` floats (NaN everywhere when nothing was counted)."""
    if not counted:
        return dict.fromkeys(RANK_FIELDS, math.nan)
    out = {f"comm_{k}_{f}": float(counted["comm"].get(k, {}).get(f, 0)) for k in KINDS for f in FIELDS}
    out["comm_sent_bytes_per_step"] = float(counted["comm_sent_bytes_per_step"])
    out["comm_padded_tokens"] = float(counted.get("comm_padded_tokens", math.nan))
    return out


def from_fields(rank: dict) -> dict:
    """The summary keys `comm`, `comm_sent_bytes_per_step` and `comm_padded_tokens` (the counted step's batch x
    padded length, summed over micro-batches: what tensor-parallel traffic scales with) from one rank's
    gathered fields (None: not counted)."""
    total = rank.get("comm_sent_bytes_per_step", math.nan)
    if total is None or math.isnan(total):
        return {"comm": None, "comm_sent_bytes_per_step": None, "comm_padded_tokens": None}
    comm = {k: {f: int(rank[f"comm_{k}_{f}"]) for f in FIELDS} for k in KINDS if rank.get(f"comm_{k}_calls")}
    tokens = rank.get("comm_padded_tokens", math.nan)
    return {"comm": comm, "comm_sent_bytes_per_step": int(total),
            "comm_padded_tokens": None if tokens is None or math.isnan(tokens) else int(tokens)}

