"""What precision a rank really trains in: the dtype of each model state, and a verdict against what was asked.

`classify(model, optimizer)` reads the live objects (through `state_bytes`' walkers) and returns

- `dtypes`: {"params", "grads", "optimizer" (Adam moments), "master_params" (a separate fp32 copy the
  optimizer steps, or None where the parameters are the master)}; a state holding several dtypes is
  written "bf16+fp32" (largest first), a dtype outside fp32/bf16/fp16 as "unknown: float8_e4m3fn";
- `master_params_bytes`: storage bytes of that separate copy (0 when there is none);
- `compute_dtype`: the dtype matmuls run in, before the first forward from what is installed (16-bit
  parameters, accelerate's autocast wrapper, an FSDP MixedPrecision policy), then as seen by `ForwardProbe`.

`verdict(...)` names the configured and effective mode in the planner's vocabulary (`strategy.PRECISIONS`)
and says, with a reason a user can act on, when they differ.
"""
from __future__ import annotations

import torch

from .guard import Instrument, WarnOnce
from .rank_gather import gather_objects
from ..strategy import REGISTRY, configured_precision, trainer_precision
from .state_bytes import (ZERO_MASTER_WEIGHTS, base_optimizer, local_tensor, master_weights, model_parameters,
                          storage_entry, zero_optimizer)

NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
HALF = ("bf16", "fp16")


def dtype_name(dtype) -> str:
    """"fp32" / "bf16" / "fp16", else "unknown: <torch name>" (never guessed)."""
    if dtype in NAMES:
        return NAMES[dtype]
    return f"unknown: {str(dtype).removeprefix('torch.')}"


def dtype_of(tensors) -> str | None:
    """The dtype(s) of `tensors` by storage bytes, largest first ("bf16+fp32"); None when there are none."""
    by_dtype, seen = {}, set()
    for tensor in tensors:
        entry = storage_entry(tensor)
        if entry is None or entry[0] in seen:
            continue
        seen.add(entry[0])
        name = dtype_name(local_tensor(tensor).dtype)
        by_dtype[name] = by_dtype.get(name, 0) + entry[1]
    return "+".join(sorted(by_dtype, key=by_dtype.get, reverse=True)) or None


def _stored_params(model) -> list:
    """What holds each parameter's values on this rank (ZeRO-3: the `ds_tensor` partition)."""
    return [getattr(p, "ds_tensor", None) if getattr(p, "ds_tensor", None) is not None else p
            for p in model_parameters(model)]


def master_copies(model, optimizer) -> list:
    """The weights the optimizer steps that are not the model's own storage (DeepSpeed fp32 partitions,
    a torch optimizer given fp32 copies); [] when the parameters are the master."""
    zero = zero_optimizer(optimizer)
    if zero is not None:
        return [t for name in ZERO_MASTER_WEIGHTS for t in _flat(getattr(zero, name, None))]
    own = {e[0] for e in map(storage_entry, _stored_params(model)) if e is not None}
    return [t for t in master_weights(optimizer) if (storage_entry(t) or (None,))[0] not in own]


def _flat(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _flat(item)]
    return []


def _moments(model, optimizer) -> list:
    """Adam-style state tensors (not scalar step counters); before the first step, the tensors they will be
    made like (torch optimizers allocate `zeros_like(param)`; ZeRO-3 empties its inner param groups)."""
    base = base_optimizer(optimizer)
    if base is None:
        return []
    state = [v for s in base.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return state or [p for group in base.param_groups for p in group["params"]] or master_copies(model, optimizer)


def _grads_dtype(model, optimizer) -> str | None:
    """Gradients: DeepSpeed ZeRO reduces and keeps them in its accumulation dtype (default: the model's);
    autograd gives every other parameter a gradient of its own dtype."""
    zero = zero_optimizer(optimizer)
    for attr in ("gradient_accumulation_dtype", "dtype"):
        if zero is not None and isinstance(getattr(zero, attr, None), torch.dtype):
            return dtype_name(getattr(zero, attr))
    return dtype_of(p for p in _stored_params(model) if p.requires_grad or getattr(p, "ds_tensor", None) is not None)


def policy_dtype(model) -> str | None:
    """The compute dtype an FSDP MixedPrecision policy casts parameters to (FSDP2 or FSDP1), or None."""
    for module in model.modules():
        if hasattr(module, "_get_fsdp_state"):  # FSDP2 (torch.distributed.fsdp.fully_shard)
            policy = getattr(module._get_fsdp_state(), "_mp_policy", None)
            if policy is not None and policy.param_dtype is not None:
                return dtype_name(policy.param_dtype)
        policy = getattr(module, "mixed_precision", None)  # FSDP1 FullyShardedDataParallel
        if policy is not None and getattr(policy, "param_dtype", None) is not None:
            return dtype_name(policy.param_dtype)
    return None


def installed_compute_dtype(model, autocast: str | None) -> str:
    """Compute dtype before any forward: an FSDP policy's param dtype, accelerate's autocast wrapper
    (`autocast`: the dtype it was asked for, when `model._original_forward` shows the wrapper is there),
    else the parameters' own dtype."""
    inner = getattr(model, "module", model)
    if autocast and any(hasattr(m, "_original_forward") for m in (model, inner)):
        return autocast
    return policy_dtype(model) or (dtype_of(_stored_params(model)) or "fp32").split("+")[0]


def classify(model, optimizer=None, autocast: str | None = None) -> dict:
    """Per-rank dtypes, master copy bytes and compute dtype (see the module docstring)."""
    masters = master_copies(model, optimizer)
    seen, master_bytes = set(), 0
    for entry in map(storage_entry, masters):
        if entry is not None and entry[0] not in seen:
            seen.add(entry[0])
            master_bytes += entry[1]
    return {"dtypes": {"params": dtype_of(_stored_params(model)), "grads": _grads_dtype(model, optimizer),
                       "optimizer": dtype_of(_moments(model, optimizer)), "master_params": dtype_of(masters)},
            "master_params_bytes": master_bytes, "compute_dtype": installed_compute_dtype(model, autocast)}


class ForwardProbe:
    """Records the dtype the first Linear of a training forward outputs: the compute dtype really used
    (autocast, an FSDP policy's cast, or 16-bit weights). Its hook runs under `instrument`; `remove()` detaches it."""

    def __init__(self, model, instrument: Instrument | None = None):
        self.seen: str | None = None
        self.instrument = instrument or Instrument("precision", WarnOnce())
        linear = next((m for m in model.modules() if isinstance(m, torch.nn.Linear)), None)
        if linear is not None:
            self.instrument.hook(linear.register_forward_hook, self._record)

    def _record(self, module, args, output):
        if self.seen is None and module.training and torch.is_tensor(output):
            self.seen = dtype_name(output.dtype)

    def remove(self):
        self.instrument.remove()


def effective_precision(facts: dict) -> str:
    """The mode the tensors are in: 16-bit weights with an fp32 master -> "<x>-mixed", without -> "bf16-pure"
    ("fp16-pure" is no planner mode); fp32 weights computed in 16 bits -> mixed; else fp32; an unknown
    dtype is reported as is."""
    params = (facts["dtypes"]["params"] or "fp32").split("+")[0]
    master = (facts["dtypes"]["master_params"] or "").split("+")[0]
    compute = (facts.get("compute_dtype") or params).split("+")[0]
    for name in (params, compute):
        if name.startswith("unknown"):
            return name
    if params in HALF:
        return f"{params}-mixed" if master == "fp32" else f"{params}-pure"
    return f"{compute}-mixed" if compute in HALF else "fp32"


def verdict(configured: str, facts: dict, strategy: str | None = None, loaded_dtype: str | None = None) -> dict:
    """`{"configured", "effective", "ok", "reason"}`; `loaded_dtype`: the dtype the model's config says
    its weights were saved/loaded in ("bf16", ...), `strategy` the detected strategy name."""
    effective = effective_precision(facts)
    zero_stage = REGISTRY[strategy].zero_stage if strategy in REGISTRY else 0  # DeepSpeed's, by the record
    ok, reason = effective == configured, None
    if effective.startswith("unknown"):
        ok, reason = False, f"parameters or compute in {effective.removeprefix('unknown: ')}, which shardscope " \
                            "cannot classify; byte counts are still exact"
    elif configured == "fp16-mixed" and effective == "fp32":
        reason = ("fp16 was asked but this run trains in plain fp32: accelerate turns fp16 autocast off on CPU "
                  "(no autocast, no loss scaler); use --bf16 on CPU, or run fp16 on a GPU")
    elif configured.endswith("-mixed") and effective.endswith("-pure"):
        reason = (f"the parameters are {effective[:4]} and the optimizer steps them with no fp32 master copy "
                  f"(the model was loaded in {effective[:4]}): load it in float32 (from_pretrained(..., dtype=torch.float32)) "
                  f"so autocast computes in {effective[:4]} over fp32 weights, or accept {effective} on purpose")
    elif zero_stage == 3 and loaded_dtype in HALF and effective == "fp32":
        ok, reason = False, (f"the checkpoint is {loaded_dtype} but DeepSpeed ZeRO-3 built fp32 parameters "
                             f"(neither --{loaded_dtype} nor the JSON's {loaded_dtype} section is on): twice the "
                             f"parameter memory; pass --{loaded_dtype}")
    elif not ok and zero_stage:
        reason = (f"the Trainer's flags ask for {configured} but DeepSpeed trains {effective}: the DeepSpeed "
                  "config's fp16/bf16 section disagrees with them; set it to \"auto\"")
    elif not ok:
        reason = f"{configured} was asked but the tensors are {effective}"
    return {"configured": configured, "effective": effective, "ok": ok, "reason": reason}


def loaded_dtype(model) -> str | None:
    """The dtype the model's config records for its weights (`dtype` / `torch_dtype`), or None."""
    config = getattr(getattr(model, "module", model), "config", None)
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return dtype_name(value) if isinstance(value, torch.dtype) else None


class PrecisionWatch:
    """One rank's precision facts for a Trainer run: installed at train begin, read at train end."""

    def __init__(self, model, optimizer, args, strategy: str | None, instrument: Instrument | None = None):
        self.model, self.optimizer, self.strategy = model, optimizer, strategy
        self.configured = configured_precision(args.bf16, args.fp16)
        self.autocast = trainer_precision(args.bf16, args.fp16) if args.bf16 or args.fp16 else None
        self.loaded = loaded_dtype(model)
        self.probe = ForwardProbe(getattr(model, "module", model), instrument)

    def report(self) -> dict:
        """`{dtypes, master_params_bytes, compute_dtype, precision_verdict}` for this rank, now."""
        facts = classify(self.model, self.optimizer, self.autocast)
        facts["compute_dtype"] = self.probe.seen or facts["compute_dtype"]
        return {**facts, "precision_verdict": verdict(self.configured, facts, self.strategy, self.loaded)}

    def remove(self):
        self.probe.remove()


def gather_reports(watch: PrecisionWatch | None) -> list[dict]:
    """Every rank's `watch.report()` (one all_gather_object, reached on every rank even where the local
    report failed: that rank gives {"error": ...}); just ours when not distributed."""
    try:
        mine = watch.report() if watch is not None else {"error": "not installed"}
    except Exception as error:  # reported, never raised: the collective below must run on every rank
        mine = {"error": f"{type(error).__name__}: {error}"}
    return gather_objects(mine)


def run_verdict(reports: list[dict]) -> dict | None:
    """The run's verdict: the first rank's that is not ok, else rank 0's."""
    verdicts = [r["precision_verdict"] for r in reports if "precision_verdict" in r]
    return next((v for v in verdicts if not v["ok"]), verdicts[0] if verdicts else None)
