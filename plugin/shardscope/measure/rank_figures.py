"""The figures one measurement exchanges between ranks, and what each rank's gathered figures report.

A measurement (every `every_n_steps` steps for the logs, once at the end for the summary) fills `RANK_FIELDS` (or,
for the logs, `LOGGED_FIELDS`) with this rank's figures, NaN where not measured, then one `frozen:<name>` field per
frozen model; one all_gather exchanges them (`rank_gather.start_gather`, completed at the Trainer's next log) and
`complete` turns each rank's raw fields into the reported figures (the summary's `ranks`, the logged metrics).
"""
from __future__ import annotations

import math

from ..summary import COMPONENTS
from .peak import RANK_FIELDS as PEAK_FIELDS, SUMMARY_KEYS as PEAK_KEYS, reported as peak_reported
from .rank_gather import int_or_none, none_if_nan
from .sampled_steps import RANK_FIELDS as SAMPLED_FIELDS  # issue 21
from .throughput import FLOPS_CONVENTION, STEP_TIME_KEYS, WindowTotals, rates

# Per-rank figures exchanged with one all_gather per measurement (NaN = not measured on that rank); one
# `frozen:<name>` field per frozen model follows them.
RANK_FIELDS = ("params_bytes", "grads_bytes", "optimizer_bytes", "trainable_params_bytes",
               "params_cpu_bytes", "grads_cpu_bytes", "optimizer_cpu_bytes", "peak_memory_bytes",
               "samples", "tokens", "flops", "seconds", "compute_seconds", *(f"step_time_{k}" for k in STEP_TIME_KEYS),
               "cpu_peak_rss_bytes", *PEAK_FIELDS, *SAMPLED_FIELDS)
# ... of which the byte counts reported as they are (the peak's and the sampled steps' are reported apart)
COUNTED_BYTES = tuple(k for k in RANK_FIELDS if k.endswith("_bytes") and not k.startswith(("peak_", "comm_")))
LOGGED_BYTES = ("params_bytes", "grads_bytes", "optimizer_bytes")  # ... of which the logs reduce (rank_gather.REDUCED)
# ... and all `complete(summary=False)` reads: what a measurement for the logs sends (then each `frozen:<name>`)
LOGGED_FIELDS = (*LOGGED_BYTES, "peak_memory_bytes", "peak_tensor_bytes", "samples", "tokens", "flops", "seconds",
                 "compute_seconds")


def fields(frozen_names, summary: bool) -> tuple[str, ...]:
    """The fields a measurement sends: the summary's (`RANK_FIELDS`) or the logs' (`LOGGED_FIELDS`), then one per
    frozen model."""
    return (*(RANK_FIELDS if summary else LOGGED_FIELDS), *(f"frozen:{name}" for name in frozen_names))


def empty() -> dict:
    """The reported figures of a rank whose figures could not be completed."""
    return {key: None for key in (*COMPONENTS, "peak_memory_bytes")} | {"throughput": {}}


def complete(rank: dict, summary: bool, frozen_names, peak: float | None, sampled, memory) -> dict:
    """Turn one rank's raw fields into reported figures (`summary=False`: those the logs reduce, no more). `peak`:
    the device's FLOP/s (MFU), `sampled`: the `SampledSteps` (their summary keys), `memory`: the memory instrument
    (the peak's figures are read under it)."""
    out = {k: int_or_none(rank[k]) for k in (COUNTED_BYTES if summary else LOGGED_BYTES)}
    out["frozen_models"] = {name: int_or_none(rank[f"frozen:{name}"]) for name in frozen_names}
    frozen = [v for v in out["frozen_models"].values() if v is not None]
    out["frozen_models_bytes"] = sum(frozen) if len(frozen) == len(out["frozen_models"]) else None
    out["peak_memory_bytes"] = int_or_none(rank["peak_memory_bytes"])
    if summary:
        out.update(dict.fromkeys(PEAK_KEYS))  # None unless measured
        with memory:
            out.update(peak_reported(rank))
    else:  # (one number, read as the others are)
        out["peak_tensor_bytes"] = int_or_none(rank["peak_tensor_bytes"])
    totals = WindowTotals(rank["samples"], none_if_nan(rank["tokens"]), none_if_nan(rank["flops"]),
                          0.0 if math.isnan(rank["seconds"]) else rank["seconds"],
                          none_if_nan(rank["compute_seconds"]))
    out["throughput"] = rates(totals, peak)
    if summary:
        out["throughput"].update(samples=int_or_none(totals.samples), tokens=int_or_none(totals.tokens),
                                 seconds=totals.seconds, compute_seconds=totals.compute,
                                 flops_convention=FLOPS_CONVENTION)
        step_time = {k: none_if_nan(rank[f"step_time_{k}"]) for k in STEP_TIME_KEYS}
        out["step_time_s"] = {**step_time, "steps": int(step_time["steps"] or 0)}
        out.update(sampled.complete(rank))
    return out
