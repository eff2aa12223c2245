"""Throughput maths, kept free of the Trainer so it can be tested alone with a fake clock.

FLOPs convention (model FLOPs, as in MFU; activation recomputation is NOT counted):
    flops_per_token = 6 * N_trainable + 4 * N_frozen + 12 * n_layers * d_attn * seq_len
where N counts the parameters that take part in matrix multiplies (the input-embedding lookup is
excluded unless it is tied to the output head), 6 = forward 2 + backward 4 (activation and weight
gradients), a frozen parameter needs no weight gradient (2 + 2), and the last term is attention's
QK^T and AV matmuls, forward and backward (d_attn = heads * head_dim, seq_len = the padded length of
the batch). Tokens are non-padding tokens (attention-mask sum) of the training inputs, once per step.
Forwards that do not train (a DPO reference model, an adapter-disabled pass, generation, no_grad
forwards) add their forward work, 2 * N_model + 4 * n_layers * d_attn * seq_len per token they
process, to the FLOPs but no tokens. For vision transformers a "token" is a patch (plus the CLS token). References: Kaplan et al. 2020; Korthikanti et al. 2022;
torchtitan `get_num_flop_per_token`.

Long sequences split across ranks (`split_degrees`): under DeepSpeed's Ulysses (sp) each rank is fed 1/sp of
every sequence, so its tokens are counted as they are (each token once over the group), its samples as 1/sp
each, and the attention term at the full length (seq_len = the rank's slice x sp). torch's context parallelism
(cp) shards inside the training step, after the batch was counted: like a tensor-parallel group, the cp ranks
share one batch (its tokens count once over the group, its FLOPs 1/cp on each rank).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ..units import peak_flops
from .rank_gather import as_float, int_or_none, none_if_nan

FLOPS_CONVENTION = ("6*N_trainable + 4*N_frozen + 12*layers*d_attn*seq per non-padding training token, plus "
                    "2*N + 4*layers*d_attn*seq per token of each forward that does not train (reference models, "
                    "adapter-disabled passes); recompute not counted")

@dataclass
class FlopsModel:
    """What the FLOPs convention needs to know about a model."""

    trainable_params: int  # excluding an untied input embedding
    frozen_params: int
    n_layers: int
    d_attn: int
    embedding_params: int = 0  # input-embedding lookup: no matmul, no FLOPs
    trainable_total: int = 0  # every trainable parameter, embedding included (for reporting)

    @property
    def total_params(self) -> int:
        return self.trainable_params + self.frozen_params + self.embedding_params

    def per_token(self, seq_len: int) -> float:
        return 6 * self.trainable_params + 4 * self.frozen_params + 12 * self.n_layers * self.d_attn * seq_len

    def forward_per_token(self, seq_len: int) -> float:
        """A forward that does not train: every matmul parameter once (2 FLOPs each), attention forward."""
        return 2 * (self.trainable_params + self.frozen_params) + 4 * self.n_layers * self.d_attn * seq_len


@dataclass
class WindowTotals:
    samples: float
    tokens: float | None
    flops: float | None
    seconds: float
    compute: float | None = None  # compute seconds over the same steps (CPU: `ThroughputWindow`; CUDA: cuda_compute)


class ThroughputWindow:
    """Accumulates samples, tokens and FLOPs over optimizer steps and the time they took.

    Time per step runs from the end of the previous step (so data loading counts) or, after an
    evaluation/save, from the next step's begin (so evaluation does not). Only complete
    gradient-accumulation cycles are timed: the Trainer calls `step_end` once per cycle. Beside the wall time,
    `compute` adds up the calling (training) thread's CPU time over the same steps (`time.thread_time`): on a CPU
    rank, its computing without its waits inside collectives (a blocked wait uses no CPU time).
    """

    def __init__(self, clock):
        self.clock, self.cpu_clock = clock, time.thread_time
        self.reset()
        self.anchor = self.cpu_anchor = None

    def reset(self):
        self.samples, self.tokens, self.flops, self.seconds, self.compute = 0.0, 0.0, 0.0, 0.0, 0.0
        self.has_tokens = self.has_flops = False
        self.durations: list[float] = []  # seconds of each step counted

    def step_begin(self):
        if self.anchor is None:
            self.anchor, self.cpu_anchor = self.clock(), self.cpu_clock()

    def restart(self):
        """The step's time starts now: what ran since its begin (the planner's plan for the live run) is left out."""
        self.anchor, self.cpu_anchor = self.clock(), self.cpu_clock()

    def add_batch(self, samples: int, tokens=None, flops=None):
        self.samples += samples
        if tokens is not None:
            self.tokens, self.has_tokens = self.tokens + tokens, True
        if flops is not None:
            self.flops, self.has_flops = self.flops + flops, True

    def step_end(self, pause_after: bool = False, count: bool = True):
        """Close one optimizer step; `pause_after` excludes the gap to the next step (eval, save);
        `count=False` leaves this step's time out (its batches must not have been added)."""
        now, cpu_now = self.clock(), self.cpu_clock()
        if self.anchor is not None and count:
            self.seconds += now - self.anchor
            self.compute += cpu_now - self.cpu_anchor
            self.durations.append(now - self.anchor)
        self.anchor, self.cpu_anchor = (None, None) if pause_after else (now, cpu_now)

    def totals(self) -> WindowTotals:
        return WindowTotals(self.samples, self.tokens if self.has_tokens else None,
                            self.flops if self.has_flops else None, self.seconds, self.compute)


STEP_TIME_KEYS = ("median", "p10", "p90", "steps")


def step_time_summary(durations: list[float]) -> dict:
    """`step_seconds`: the median, 10th and 90th percentiles (linear interpolation between the sorted steps, as
    numpy's default) and the count of the optimizer steps timed; values None when no step was."""
    if not durations:
        return {"median": None, "p10": None, "p90": None, "steps": 0}
    ordered = sorted(durations)

    def quantile(q: float) -> float:
        at = q * (len(ordered) - 1)
        low = int(at)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (at - low)

    return {"median": quantile(0.5), "p10": quantile(0.1), "p90": quantile(0.9), "steps": len(ordered)}


# --- the window as a rank's gathered fields, and back (metrics.py's `throughput` and `step_seconds` rows) ----------
WINDOW_FIELDS = ("samples", "tokens", "flops", "seconds", "compute_seconds")
STEP_TIME_FIELDS = tuple(f"step_time_{k}" for k in STEP_TIME_KEYS)


def window_fields(totals: WindowTotals) -> dict:
    return {"samples": totals.samples, "tokens": as_float(totals.tokens), "flops": as_float(totals.flops),
            "seconds": totals.seconds, "compute_seconds": as_float(totals.compute)}


def throughput_of(rank: dict, peak: float | None) -> dict:
    """A rank's `throughput`: its rates (`rates`) and the window's totals, from its gathered fields."""
    totals = WindowTotals(rank["samples"], none_if_nan(rank["tokens"]), none_if_nan(rank["flops"]),
                          0.0 if math.isnan(rank["seconds"]) else rank["seconds"], none_if_nan(rank["compute_seconds"]))
    return {**rates(totals, peak), "samples": int_or_none(totals.samples), "tokens": int_or_none(totals.tokens),
            "seconds": totals.seconds, "compute_seconds": totals.compute, "flops_convention": FLOPS_CONVENTION}


def step_time_fields(durations: list[float]) -> dict:
    return {f"step_time_{k}": as_float(v) for k, v in step_time_summary(durations).items()}


def step_time_of(rank: dict) -> dict:
    """A rank's `step_seconds` {median, p10, p90, steps} from its gathered fields."""
    out = {k: none_if_nan(rank[f"step_time_{k}"]) for k in STEP_TIME_KEYS}
    return {**out, "steps": int(out["steps"] or 0)}


def split_degrees(mesh: dict | None) -> tuple[int, int]:
    """(ranks that share each batch: tp x cp, ranks that share each sequence's tokens: sp) of a summary's mesh."""
    mesh = mesh or {}
    return mesh.get("tp", 1) * mesh.get("cp", 1), mesh.get("sp", 1)


def sequence_share(samples, sp: int):
    """A rank's share of `samples` it holds 1/sp of each of (unchanged, an int stays an int, without a split)."""
    return samples / sp if sp > 1 else samples


def rates(totals: WindowTotals, peak: float | None) -> dict:
    """samples/s, tokens/s, TFLOP/s and MFU (`peak`: the device's peak FLOP/s) for one device's window (None where not
    countable)."""
    if totals.seconds <= 0:
        return {"samples_per_s": None, "tokens_per_s": None, "tflops_per_device": None, "mfu": None,
                "compute_share": None}
    flops_per_s = None if totals.flops is None else totals.flops / totals.seconds
    return {
        "samples_per_s": totals.samples / totals.seconds,
        "tokens_per_s": None if totals.tokens is None else totals.tokens / totals.seconds,
        "tflops_per_device": None if flops_per_s is None else flops_per_s / 1e12,
        "mfu": None if (flops_per_s is None or not peak) else flops_per_s / peak,
        "compute_share": None if totals.compute is None else totals.compute / totals.seconds,
    }


def batch_counts(args: tuple, kwargs: dict, patch_size: int | None = None):
    """(samples, tokens, sequence length) of one forward's inputs.

    Tokens are the attention-mask sum (padding excluded; an int for a CPU mask, a tensor otherwise, so no
    device sync), all of `input_ids` when there is no mask, or patches + CLS per image for a vision transformer; None
    when the inputs carry nothing countable as tokens.
    """
    input_ids = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
    if input_ids is not None:
        mask = kwargs.get("attention_mask")
        tokens = input_ids.numel() if mask is None else int(mask.sum()) if mask.is_cpu else mask.sum()
        return input_ids.shape[0], tokens, input_ids.shape[-1]
    pixels = kwargs.get("pixel_values")
    if pixels is not None:
        if not patch_size:
            return pixels.shape[0], None, 0
        seq_len = (pixels.shape[-2] // patch_size) * (pixels.shape[-1] // patch_size) + 1
        return pixels.shape[0], pixels.shape[0] * seq_len, seq_len
    first = next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
    return (first.shape[0] if first is not None else 0), None, 0


def device_peak_flops(peak_tflops: float | None, device, precision: str | None) -> float | None:
    """FLOP/s of one device at `precision`: the user's `peak_tflops`, else the table's for a CUDA device, else None."""
    if peak_tflops:
        return peak_tflops * 1e12
    if device.type != "cuda":
        return None
    dtype = precision if precision in ("bf16", "fp16") else "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    return peak_flops(torch.cuda.get_device_name(device), dtype)
