"""Peak tensor memory of one training step, by category, on any device (CPU included).

torch's `MemTracker` (torch.distributed._tools.mem_tracker) follows every tensor allocated while it is
active and categorises it: parameters and buffers, gradients, activations (saved in forward and in
recomputation), temporaries (what backward and the loss allocate and free), optimizer state. The
model and optimizer are registered before the step, so what they already hold counts too; a
strategy's own long-lived buffers allocated at set-up and not reachable from the model or optimizer
are not seen. DDP's reducer buckets, which its C++ reducer allocates when DDP wraps the model (and again when
it rebuilds them after the first step) and holds at every moment, are a part of their own (`buffers`): MemTracker
would see each only from the reducer's first write into it in backward, as a temporary, so it is kept out of the
tracker and counted whole at every moment (`ddp_buckets`); DeepSpeed's reduce buckets are not counted.

`StepPeak` reports:
- `peak_tensor_bytes`: the largest total of live tensors during the step;
- `peak_breakdown`: {parameters (module buffers and ZeRO-3's `ds_tensor` partitions included: no module holds those
  as parameters, and MemTracker saw none of them until they were registered), gradients, optimizer, activations,
  temporaries, buffers}
  at that moment (optimizer includes tensors it owns outside its state dict: fp32 master copies, ZeRO partitions;
  buffers: DDP's reducer buckets);
- `peak_phase`: forward, backward or optimizer step: where the peak was first reached;
- `peak_step`: the shape of the step's first training forward (`STEP_SHAPE`: rows, sequence length of the
  token ids or image size of the pixels, activation checkpointing on), what a plan of the same step needs.
Instrumenting costs several times a plain step: use it for one warm step. MemTracker hooks the gradient of
every parameter it meets and torch refuses a hook on a frozen one, so `tracker()` hooks only parameters that
train: frozen base weights under LoRA and a frozen reference model run in the step are tracked without one.
FSDP1's flat parameters are refused: torch refuses the same hook on the non-leaf views FSDP1 puts in place
during forward.
"""
from __future__ import annotations

import math

import torch

from ..mem_tracker import tracker
from .state_bytes import master_weights, optimizer_layers, zero3_partitions, zero_grad_buffers
from .guard import Instrument, WarnOnce

BREAKDOWN = ("parameters", "gradients", "optimizer", "activations", "temporaries", "buffers")
PHASES = ("forward", "backward", "optimizer step")
STEP_SHAPE = ("micro_batch", "seq_len", "image_size", "gradient_checkpointing")
# What one rank sends in the profiler's gather for `peak_breakdown` and `peak_step` (metrics.py's rows; NaN: not
# measured there): `*_fields` of a `StepPeak.result()` -> the gather -> `*_of` the gathered fields.
BREAKDOWN_FIELDS = tuple(f"peak_{part}_bytes" for part in BREAKDOWN)
STEP_FIELDS = tuple(f"peak_step_{k}" for k in STEP_SHAPE)
# MemTracker's categories -> ours. "Other" holds what `track_external` registered beside the model and
# the optimizer's state dict: master copies and ZeRO's flat partitions, all owned by the optimizer.
CATEGORY = {"Parameter": "parameters", "Buffer": "parameters", "Gradient": "gradients", "Activation": "activations",
            "Temp": "temporaries", "Optstate": "optimizer", "Other": "optimizer"}


# MemTracker's (and its ModTracker's) methods that run inside the user's step: hooks, dispatch-time tracking,
# weakref and resize callbacks. Each is replaced on the instance by its instrument-guarded version.
TRACKER_CALLBACKS = ("_pre_fw_hook", "_post_fw_hook", "_pre_bw_hook", "_post_bw_hook", "_track", "_update_snap",
                     "_update_peak_stats", "_delete_callback", "_track_optimizer_states")
MOD_TRACKER_CALLBACKS = ("_fw_pre_hook", "_fw_post_hook")
MOD_TRACKER_FACTORIES = ("_get_append_fn", "_get_pop_fn")  # make the backward hooks ModTracker registers


def guarded_tracker(instrument: Instrument):
    """`mem_tracker.tracker()` with every callback it runs inside the user's step guarded by `instrument`."""
    step_tracker = tracker()
    _guard_methods(step_tracker, TRACKER_CALLBACKS, instrument)
    step_tracker._update_and_maybe_create_winfos = instrument.wrap(step_tracker._update_and_maybe_create_winfos,
                                                                  fallback=lambda *_: [])
    mod_tracker = step_tracker._mod_tracker
    _guard_methods(mod_tracker, MOD_TRACKER_CALLBACKS, instrument)
    for name in MOD_TRACKER_FACTORIES:
        make = getattr(mod_tracker, name)
        setattr(mod_tracker, name, lambda *args, make=make: instrument.wrap(make(*args)))
    return step_tracker


def _guard_methods(owner, names: tuple, instrument: Instrument) -> None:
    for name in names:
        setattr(owner, name, instrument.wrap(getattr(owner, name)))


def ddp_buckets(model) -> list[int]:
    """Bytes of each bucket DDP's reducer holds now (`model` the DistributedDataParallel wrapper), read from the
    reducer's zero copies of them (`_get_zeros_like_grad_buckets`), made as fake tensors: no memory. [] for any other
    model, and under `gradient_as_bucket_view`, where the buckets are the gradients' own storage."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel) or model.gradient_as_bucket_view:
        return []
    with FakeTensorMode(allow_non_fake_inputs=True):
        return [b.buffer().numel() * b.buffer().element_size() for b in model.reducer._get_zeros_like_grad_buckets()]


def _skip_buckets(step_tracker, sizes: list[int], instrument: Instrument) -> None:
    """Keep DDP's buckets out of `step_tracker`: a storage it has not met, of a bucket's size, first seen through a
    view (the reducer writes each gradient into its view of the bucket; a tensor made in the step is met where it
    is made, whole) is a bucket, never tracked."""
    from torch.utils.weak import WeakIdKeyDictionary

    track, remaining, buckets = step_tracker._track, list(sizes), WeakIdKeyDictionary()

    def _track(reftype, t):
        storage = t.untyped_storage()
        if storage in buckets:
            return None
        if storage not in step_tracker._WINFO and t._is_view() and storage.nbytes() in remaining:
            remaining.remove(storage.nbytes())
            buckets[storage] = True
            return None
        return track(reftype, t)

    if sizes:
        step_tracker._track = instrument.wrap(_track)


class StepPeak:
    """Context manager around one optimizer step: `with StepPeak(model, optimizer, instrument) as peak: <step>`,
    then `peak.result()`. Phase boundaries come from hooks on the model's forward and the optimizer's step; every
    hook and tracker callback runs under `instrument` (a failure disables it, the step goes on). `wrapper`: what
    the loop runs `model` in; a DDP wrapper's reducer buckets (`ddp_buckets`) are counted as `buffers` at every
    moment, and kept out of the tracker."""

    def __init__(self, model, optimizer=None, instrument: Instrument | None = None, wrapper=None):
        if any(getattr(p, "_fsdp_flattened", False) for p in model.parameters()):  # FSDP1 marks its parameters
            # FSDP1 swaps in non-leaf views of its flat parameters during forward; torch refuses a gradient hook there
            raise ValueError("FSDP1 flat parameters cannot be tracked by MemTracker")
        self.instrument = instrument or Instrument("memory", WarnOnce())
        self.tracker = guarded_tracker(self.instrument)
        self.model, self.optimizer, buckets = model, optimizer, ddp_buckets(wrapper)
        self.buffers = sum(buckets)
        _skip_buckets(self.tracker, buckets, self.instrument)
        self.marks: list[tuple[str, int]] = []  # (phase starting, peak total so far)
        self.shape: dict | None = None  # the first training forward's (`step_shape`)

    def __enter__(self) -> "StepPeak":
        optimizers = [o for o in optimizer_layers(self.optimizer) if isinstance(o, torch.optim.Optimizer)]
        extra = [t for t in (*master_weights(self.optimizer), *zero_grad_buffers(self.optimizer))
                 if isinstance(t, torch.Tensor)]
        self.tracker.track_external(self.model, *optimizers, *extra)
        self.tracker.track_as_parameters(*zero3_partitions(self.model))
        hook = self.instrument.hook
        hook(self.model.register_forward_pre_hook, self._forward, with_kwargs=True)
        hook(self.model.register_forward_hook, lambda *_: self._mark("backward"))
        for opt in optimizers[-1:]:  # the innermost torch optimizer steps last: its hooks bracket the update
            hook(opt.register_step_pre_hook, lambda *_: self._mark("optimizer step"))
            hook(opt.register_step_post_hook, lambda *_: self._mark("after step"))
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.tracker.__exit__(*exc)
        finally:
            self.instrument.remove()

    def _peak_total(self) -> int:
        return sum(snap.get("Total", 0) for snap in self.tracker.get_tracker_snapshot("peak").values())

    def _mark(self, starting: str) -> None:
        self.marks.append((starting, self._peak_total()))

    def _forward(self, module, args, kwargs) -> None:
        self._mark("forward")
        if self.shape is None and torch.is_grad_enabled():
            self.shape = step_shape(module, args, kwargs)

    def result(self) -> dict:
        snapshot = self.tracker.get_tracker_snapshot("peak")
        breakdown = dict.fromkeys(BREAKDOWN, 0)
        for per_device in snapshot.values():
            for category, nbytes in per_device.items():
                if category in CATEGORY:
                    breakdown[CATEGORY[category]] += nbytes
        breakdown["buffers"] = self.buffers
        return {"peak_tensor_bytes": sum(breakdown.values()), "peak_breakdown": breakdown,
                "peak_phase": self._phase(self._peak_total()), "peak_step": self.shape or {}}

    def _phase(self, total: int) -> str:
        """The phase in which the peak total was first reached: each mark holds the phase starting then
        and the peak so far, so the peak fell in the phase before the first mark that has seen it."""
        current = "forward"
        for starting, peak in self.marks:
            if peak >= total:
                break
            current = starting
        return "optimizer step" if current == "after step" else current


def step_shape(module, args: tuple, kwargs: dict) -> dict:
    """`STEP_SHAPE` of one forward: rows, the token ids' length or the pixels' size (None where absent), and
    whether the module recomputes activations in backward (`checkpointing`)."""
    ids = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
    pixels = kwargs.get("pixel_values") if ids is None else None
    first = ids if ids is not None else pixels
    return {"micro_batch": None if first is None else int(first.shape[0]),
            "seq_len": None if ids is None else int(ids.shape[-1]),
            "image_size": None if pixels is None else int(pixels.shape[-1]),
            "gradient_checkpointing": checkpointing(module)}


def checkpointing(module) -> bool:
    """transformers' `is_activation_checkpointing` (5.x; earlier releases name it `is_gradient_checkpointing`, which
    5.x keeps as an alias that warns on every read)."""
    on = getattr(module, "is_activation_checkpointing", None)
    return bool(getattr(module, "is_gradient_checkpointing", False) if on is None else on)


# --- a `StepPeak.result()` as a rank's gathered fields, and back (None: not measured on that rank) ------------------
def _count(value) -> int | None:
    return None if value is None or math.isnan(value) else int(value)


def breakdown_fields(result: dict) -> dict:
    return {f"peak_{k}_bytes": v for k, v in result["peak_breakdown"].items()}


def breakdown_of(rank: dict) -> dict | None:
    if _count(rank["peak_tensor_bytes"]) is None:
        return None
    return {k: _count(rank[f"peak_{k}_bytes"]) for k in BREAKDOWN}


def phase_field(result: dict) -> int:
    return PHASES.index(result["peak_phase"])


def phase_of(rank: dict) -> str | None:
    phase = _count(rank["peak_phase"])
    return None if phase is None else PHASES[phase]


def step_fields(result: dict) -> dict:
    return {f"peak_step_{k}": math.nan if v is None else float(v) for k, v in result["peak_step"].items()}


def step_of(rank: dict) -> dict | None:
    step = {k: _count(rank[f"peak_step_{k}"]) for k in STEP_SHAPE}
    return None if step["micro_batch"] is None else {**step, "gradient_checkpointing": bool(step["gradient_checkpointing"])}
