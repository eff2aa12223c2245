"""A strategy's peak per rank: its model states plus the worst moment of a step.

`trace.py` says what one micro-batch holds besides parameters and optimizer state at each candidate
moment (forward, the head's backward, the top and the bottom layer's backward: a fresh gradient before it
becomes a parameter's .grad is among the trace's temporaries); the strategy decides how much of the rest is
live then. `formulas.FamilyRow.held` gives the strategy's part. Per moment, per rank:

    parameters   = params_bytes (the rank's shard) + what FSDP / ZeRO-3 hold gathered (FSDP: the largest
                   unit in the compute dtype; shard-grad-op: every unit, gathered in forward and counted
                   held through backward; ZeRO-3: the largest layer + what stays gathered from forward)
    gradients    = the gradient fraction live at that moment x the gradients the rank ends backward with
                   (DDP, ZeRO-1: all, stage 1 reduces after backward; FSDP, ZeRO-2/3: its shard),
                   + FSDP2's reduce-scatter copy of a unit's unsharded gradient once backward has produced any
    optimizer    = optimizer_bytes (moments, master copy, step counts)
    activations, temporaries = the trace's (each rank computes its own micro-batch whole)
    buffers      = what the strategy allocates to communicate, from the row's `buffers_detail` (ZeRO's
                   reduce buckets; DDP's reducer buckets, which the reducer allocates when DDP wraps the model
                   and holds at every moment: the callback adds them to its measured peak, as MemTracker never
                   sees them), without what exists only inside the optimizer step

With gradient accumulation (A > 1, the Trainer's `no_sync` on all but the last micro-batch) a later
micro-batch starts with what earlier ones left, the carried gradients, at every moment above:
    DDP, ZeRO-1  full gradients T*g (accumulated in place: gradients = max(fraction x all, T*g))
    FSDP         full UNSHARDED gradients T*e (FSDP2's `set_requires_gradient_sync(False)`), reduce-scattered
                 unit by unit only in the last micro-batch (counted live until the end of backward)
    ZeRO-2       its partition s(T)*g (reduced every micro-batch; DeepSpeed's `all_grad_tensors`), kept
                 beside this micro-batch's until the end of backward sums them
    ZeRO-3       its partition s(T)*g (reduced every micro-batch into the same flat buffer, in place)

and the end of backward (no activations): all the rank's gradients + carried (ZeRO-2) + the last unit's fresh
gradient (FSDP: its unit, ZeRO-3: the largest layer's) + the copies made then (ZeRO-2: the flat gradient
partition DeepSpeed's epilogue builds for the step; ZeRO-3: the bucket's reduce-scatter output); FSDP
shard-grad-op holds one unit gathered there. The optimizer step: parameters + gradients (the rank's) +
optimizer + buffers, the step's own copies included (DeepSpeed's fp32 gradient copy; the Trainer's default
fused AdamW allocates no per-parameter temporary). `peak_bytes` is the largest of these, `peak_phase` its phase.
"""
from __future__ import annotations

STEP_ONLY = ("fp32_grad_copy_in_step",)                       # buffers that exist only inside the step
AT_END = ("flat_grad_partition", "reduce_scatter_output")     # gradient copies made at the end of backward
GATHERED = ("gathered_units", "unit_grad", "gathered_layer", "gathered_params", "kept_gathered",
            "reduce_scatter_input")                           # counted through `held`


def step_peak(states: dict, buffers_detail: dict, moments: dict, held: dict | None = None) -> dict:
    """{peak_bytes, peak_breakdown, peak_phase} of one strategy (see the module docstring).
    `states`: params_bytes, grads_bytes, optimizer_bytes of the rank; `moments`: StepTrace.at(layers);
    `held`: gathered, gathered_end, reduce_copy, fresh_unit, backward_grads, carried, carried_kept (formulas.FamilyRow.held)."""
    h = {"gathered": 0, "reduce_copy": 0, "fresh_unit": 0, "backward_grads": states["grads_bytes"], "carried": 0,
         **(held or {})}
    gathered, gathered_end = h["gathered"], h.get("gathered_end", h["gathered"])
    held_buffers = sum(v for k, v in buffers_detail.items() if k not in STEP_ONLY + AT_END + GATHERED)
    moments = {**moments, "end of backward": {"activations": 0, "temporaries": 0, "gradient_fraction": 1.0}}
    candidates = {}
    for name, m in moments.items():
        live, end = m["gradient_fraction"], name == "end of backward"
        grads = int(live * h["backward_grads"])
        if h.get("carried_kept"):
            grads += h["carried"]
        elif not end:
            grads = max(grads, h["carried"])
        at_end = h["fresh_unit"] + sum(buffers_detail.get(k, 0) for k in AT_END) if end else 0
        candidates[name] = {
            "parameters": states["params_bytes"] + (gathered_end if end else gathered),
            "gradients": grads + (h["reduce_copy"] if live else 0) + at_end,
            "optimizer": states["optimizer_bytes"],
            "activations": m["activations"],
            "temporaries": m["temporaries"],
            "buffers": held_buffers,
        }
    candidates["optimizer step"] = {
        "parameters": states["params_bytes"], "gradients": states["grads_bytes"],
        "optimizer": states["optimizer_bytes"], "activations": 0, "temporaries": 0,
        "buffers": held_buffers + sum(buffers_detail.get(k, 0) for k in STEP_ONLY)}
    moment, breakdown = max(candidates.items(), key=lambda item: sum(item[1].values()))
    phase = moment if moment in ("forward", "optimizer step") else "backward"
    return {"peak_bytes": sum(breakdown.values()), "peak_breakdown": breakdown, "peak_phase": phase}


def formula_moments(activations: int, checkpointing: bool) -> dict:
    """One moment from the written-out activation formula, where no trace exists (approximate): all
    activations live, and with checkpointing all gradients too (the peak moves to the end of backward)."""
    return {"formula": {"activations": activations, "temporaries": 0,
                        "gradient_fraction": 1.0 if checkpointing else 0.0}}
