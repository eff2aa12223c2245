"""A strategy's peak per rank: its model states plus the worst moment of a step.

`step_trace` says what one micro-batch holds besides parameters and optimizer state at each candidate
moment (forward, the head's backward, the top and the bottom layer's backward); the strategy decides
how much of the rest is live then. Per moment, per rank:

    parameters   = params_bytes (the rank's shard) + what FSDP / ZeRO-3 gather to compute (FSDP: the
                   largest unit in the compute dtype; ZeRO-3: the largest layer)
    gradients    = the gradient fraction live at that moment x the gradients the rank ends backward
                   with (DDP: all; FSDP, ZeRO: its shard), + FSDP's unit gradient before its
                   reduce-scatter once backward has produced any
    optimizer    = optimizer_bytes (moments, master copy, step counts)
    activations, temporaries = the trace's (each rank computes its own micro-batch whole)
    buffers      = what the strategy allocates to communicate, from the row's `buffers_detail` (ZeRO's
                   reduce buckets; DDP's reducer buckets once backward has produced gradients: torch's
                   MemTracker sees them allocated as gradients arrive), without what exists only inside
                   the optimizer step

and the optimizer step: parameters + gradients (all the rank holds) + optimizer + buffers, the step's
own copies included (DeepSpeed's fp32 gradient copy; the Trainer's default fused AdamW allocates no
per-parameter temporary). `peak_bytes` is the largest of these, `peak_phase` its phase.
"""
from __future__ import annotations

STEP_ONLY = ("fp32_grad_copy_in_step",)                       # buffers that exist only inside the step
GATHERED = ("gathered_units", "unit_grad", "gathered_layer", "gathered_params")  # counted as parameters
IN_BACKWARD = ("ddp_buckets",)                                # live once gradients exist


def step_peak(states: dict, buffers_detail: dict, moments: dict, gathered: int = 0, unit_grad: int = 0) -> dict:
    """{peak_bytes, peak_breakdown, peak_phase} of one strategy (see the module docstring).
    `states`: params_bytes, grads_bytes, optimizer_bytes of the rank; `moments`: StepTrace.at(layers)."""
    held = sum(v for k, v in buffers_detail.items() if k not in STEP_ONLY + GATHERED + IN_BACKWARD)
    in_backward = sum(buffers_detail.get(k, 0) for k in IN_BACKWARD)
    candidates = {}
    for name, m in moments.items():
        live = m["gradient_fraction"]
        candidates[name] = {
            "parameters": states["params_bytes"] + gathered,
            "gradients": int(live * states["grads_bytes"]) + (unit_grad if live else 0),
            "optimizer": states["optimizer_bytes"],
            "activations": m["activations"],
            "temporaries": m["temporaries"],
            "buffers": held + (in_backward if live else 0),
        }
    candidates["optimizer step"] = {
        "parameters": states["params_bytes"], "gradients": states["grads_bytes"],
        "optimizer": states["optimizer_bytes"], "activations": 0, "temporaries": 0,
        "buffers": held + in_backward + sum(buffers_detail.get(k, 0) for k in STEP_ONLY)}
    moment, breakdown = max(candidates.items(), key=lambda item: sum(item[1].values()))
    phase = moment if moment in ("forward", "optimizer step") else "backward"
    return {"peak_bytes": sum(breakdown.values()), "peak_breakdown": breakdown, "peak_phase": phase}


def formula_moments(activations: int, checkpointing: bool) -> dict:
    """One moment from the written-out activation formula, where no trace exists (approximate): all
    activations live, and with checkpointing all gradients too (the peak moves to the end of backward)."""
    return {"formula": {"activations": activations, "temporaries": 0,
                        "gradient_fraction": 1.0 if checkpointing else 0.0}}
