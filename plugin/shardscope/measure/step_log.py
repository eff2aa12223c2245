"""Each optimizer step's real and padded tokens, and the worst step's peak (the summary's `worst_step`,
`padding_waste`, `measured_steps`; the logs' last step's tokens, `shardscope/step_tokens_*` and
`shardscope/step_padded_tokens_*`, beside `shardscope/peak_tensor_bytes_*`, the largest peak measured so far).

A step's padded tokens are its micro-batches' rows x sequence length as fed (padding included: what sets the peak);
its real tokens the non-padding ones (`throughput.batch_counts`). The tensor tracker (`peak.StepPeak`) costs several
times a plain step, so it does not run on every step: on the memory step, then on each later step whose first
micro-batch has more padded tokens than any step measured so far (a new record: for a shuffled dataset about ln(steps)
of them, and the step that holds the longest micro-batch among them); a step that carries a sampled instrument (the
collective counter, the timer: dispatch modes that must leave in order) is not measured, nor one before the first
plain step is counted (a measured step is left out of throughput, which keeps one). `worst_step`: of the
measured steps, the one of the largest peak.
"""
from __future__ import annotations

import math

MEASURED_KEPT = 16  # measured steps each rank sends (the first ones; records are few: about ln(steps))
STEP_KEYS = ("step", "tokens", "padded_tokens", "peak_tensor_bytes")
WORST_FIELDS = tuple(f"worst_step_{k}" for k in STEP_KEYS)
TOKEN_FIELDS = ("tokens_fed", "padded_tokens_fed")
MEASURED_FIELDS = tuple(f"measured_{i}_{k}" for i in range(MEASURED_KEPT) for k in STEP_KEYS)
FIELDS = WORST_FIELDS + TOKEN_FIELDS + MEASURED_FIELDS  # what a rank sends (metrics.py's rows)
LAST_FIELDS = ("last_step_tokens", "last_step_padded_tokens")  # the logs': the last closed step's


class StepLog:
    """The run's tokens fed (real, padded), this step's so far, and the steps the tracker measured."""

    def __init__(self):
        self.tokens = self.padded = 0            # the run's, closed steps
        self.step_tokens = self.step_padded = 0  # this step's so far
        self.step_first_padded = None            # this step's first micro-batch's padded tokens
        self.forwarded = False                   # a forward of this step has run
        self.measured: list[dict] = []           # {step, tokens, padded_tokens, peak_tensor_bytes}
        self.last = None                         # (tokens, padded tokens) of the last closed step

    def add(self, tokens, rows: int, seq_len: int) -> None:
        """One micro-batch fed: its real tokens (an int, or a device tensor summed later), rows x sequence length."""
        padded = rows * seq_len
        if self.step_first_padded is None:
            self.step_first_padded = padded
        self.step_tokens = self.step_tokens + (padded if tokens is None else tokens)
        self.step_padded += padded

    def record(self, padded: int) -> bool:
        """Whether a step whose first micro-batch has `padded` tokens beats every measured step."""
        return padded > max((m["padded_tokens"] for m in self.measured), default=0)

    def close(self, step: int, peak: dict | None) -> None:
        """The step's end: its tokens into the run's; `peak` (its `StepPeak.result()`) when it was measured."""
        if peak is not None:  # (a device tensor's count is read here only: no sync on other steps)
            self.measured.append({"step": step, "tokens": int(self.step_tokens), "padded_tokens": self.step_padded,
                                  "peak_tensor_bytes": peak["peak_tensor_bytes"]})
        self.tokens = self.tokens + self.step_tokens
        self.last = (self.step_tokens, self.step_padded)
        self.padded += self.step_padded
        self.step_tokens = self.step_padded = 0
        self.step_first_padded, self.forwarded = None, False

    def worst(self) -> dict | None:
        return max(self.measured, key=lambda m: m["peak_tensor_bytes"], default=None)

    def fields(self) -> dict:
        """This rank's gathered fields (NaN: none)."""
        worst = self.worst() or {}
        out = {f"worst_step_{k}": float(worst.get(k, math.nan)) for k in STEP_KEYS}
        out.update(tokens_fed=float(self.tokens), padded_tokens_fed=float(self.padded))
        for i in range(MEASURED_KEPT):
            step = self.measured[i] if i < len(self.measured) else {}
            out.update({f"measured_{i}_{k}": float(step.get(k, math.nan)) for k in STEP_KEYS})
        return out


def last_fields(log: StepLog) -> dict:
    """The last closed step's real and padded tokens (NaN: no step yet), as the logs send them."""
    tokens, padded = log.last if log.last is not None else (math.nan, math.nan)
    return {"last_step_tokens": float(tokens), "last_step_padded_tokens": float(padded)}


def last_of(rank: dict) -> dict:
    """{tokens, padded_tokens} of a rank's last closed step (None: none)."""
    return {"tokens": _int(rank["last_step_tokens"]), "padded_tokens": _int(rank["last_step_padded_tokens"])}


def _int(value) -> int | None:
    return None if value is None or math.isnan(value) else int(value)


def worst_of(rank: dict) -> dict | None:
    """The summary's `worst_step` {step, tokens, padded_tokens, peak_tensor_bytes} of a rank's fields."""
    worst = {k: _int(rank[f"worst_step_{k}"]) for k in STEP_KEYS}
    return None if worst["step"] is None else worst


def waste_of(rank: dict) -> float | None:
    """The run's padding waste: padded tokens / real tokens - 1 (None: nothing fed)."""
    tokens = _int(rank["tokens_fed"])
    return (_int(rank["padded_tokens_fed"]) / tokens - 1) if tokens else None


def measured_of(rank: dict) -> list[dict]:
    """The summary's `measured_steps`: each measured step's tokens and peak."""
    steps = ({k: _int(rank[f"measured_{i}_{k}"]) for k in STEP_KEYS} for i in range(MEASURED_KEPT))
    return [s for s in steps if s["step"] is not None]
