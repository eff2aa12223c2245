"""The sampled steps of a run: which optimizer steps carry the collective counter (`comm_count.py`, instrument
"collectives") and the step timer (`step_time.py`, instrument "step_time"), and what they measured, as flat figures
for the cross-rank gather and as the summary's per-rank keys. Any training loop drives it with these calls:

    steps.begin(step, max_steps, model, optimizer)   where optimizer step `step` begins (1-based)
    steps.end() -> bool                              where it ends: True when it was instrumented
    steps.fields() / steps.complete(fields)          what it measured

A step is timed from its begin; the profiler begins the next step where the previous one ended, so its data loading
counts. An instrumented step is not a plain step: leave it out of throughput. Each instrument's work, in the step
and at the gather, runs under its `Instrument`: after a failure its figures are NaN here and None in the summary.
"""
from __future__ import annotations

import math

from . import comm_count, step_time
from .guard import Instrument, WarnOnce

RANK_FIELDS = (*comm_count.RANK_FIELDS, *step_time.RANK_FIELDS)


class SampledSteps:
    def __init__(self, comm_step: int | None = 3, time_step: int | None = 4, time_every_n_steps: int | None = None,
                 device=None, warn=None):
        self.comm_step, self.time_step, self.time_every_n_steps = comm_step, time_step, time_every_n_steps
        warn = warn or WarnOnce()
        self.device = device
        self.collectives, self.timing = Instrument("collectives", warn), Instrument("step_time", warn)
        self.comm, self.timed = None, []
        self._counter = self._timer = None
        self._padded_tokens = 0
        self._fields = None  # `fields()` until `end()` keeps a new result
        self._last = max(comm_step or 0, time_step or 0)

    @property
    def instruments(self) -> tuple[Instrument, Instrument]:
        return self.collectives, self.timing

    @property
    def active(self) -> bool:
        return self._counter is not None or self._timer is not None

    def begin(self, step: int, max_steps: int, model, optimizer) -> None:
        if step > self._last and self.time_every_n_steps is None:  # past every sampled step (most steps)
            return
        if self.comm_step is not None and step == min(self.comm_step, max_steps or self.comm_step) \
                and self.collectives.ok:  # max_steps None: not known
            with self.collectives:
                self._counter = comm_count.CollectiveCounter(self.collectives).__enter__()
        if self._timer is None and self._is_timed(step, max_steps) and self.timing.ok:
            with self.timing:
                self._timer = step_time.StepTimer(model, optimizer, self.device, self.timing).start()

    def add_batch(self, samples: int, seq_len: int) -> None:
        """A training forward's batch: the counted step's padded tokens (what TP's traffic scales with)."""
        if self._counter is not None:
            self._padded_tokens += samples * seq_len

    def end(self, keep: bool = True) -> bool:
        """Stop what runs over this step; True when something did. `keep=False` drops what it measured."""
        counter, timer, self._counter, self._timer = self._counter, self._timer, None, None
        if counter is not None:
            with self.collectives:
                counter.__exit__(None, None, None)
                if keep and self.collectives.ok:
                    self.comm, self._fields = {**counter.result(), "comm_padded_tokens": self._padded_tokens}, None
        if timer is not None:
            with self.timing:
                result = timer.stop()
                if keep and result is not None:
                    self.timed.append(result)
                    self._fields = None
        return counter is not None or timer is not None

    def fields(self) -> dict:
        """This rank's figures as `RANK_FIELDS` floats (NaN: not measured); the same dict until a step adds some."""
        if self._fields is None:
            fields = dict.fromkeys(RANK_FIELDS, math.nan)
            with self.collectives:
                fields.update(comm_count.to_fields(self.comm if self.collectives.ok else None))
            with self.timing:
                fields.update(step_time.to_fields(step_time.mean_breakdown(self.timed) if self.timing.ok else None))
            self._fields = fields
        return self._fields

    def complete(self, rank: dict) -> dict:
        """A rank's gathered fields -> its summary keys `comm`, `comm_sent_bytes_per_step`, `comm_padded_tokens`,
        `time_breakdown` (None where not measured)."""
        out = dict.fromkeys(comm_count.SUMMARY_KEYS)  # None unless counted
        with self.collectives:
            out = comm_count.from_fields(rank)
        out["time_breakdown"] = None
        with self.timing:
            timed = step_time.from_fields(rank)
            if timed:
                timed["timed_steps"] = len(self.timed)
            out["time_breakdown"] = timed
        return out

    def _is_timed(self, step: int, max_steps: int) -> bool:
        if max_steps and step > max_steps:
            return False
        every = self.time_every_n_steps
        return step == self.time_step or bool(every and step % every == 0)


def straggler(ranks: list[dict]) -> dict | None:
    """The summary's top-level `straggler`, from the ranks' completed keys."""
    return step_time.straggler([r.get("time_breakdown") for r in ranks])
