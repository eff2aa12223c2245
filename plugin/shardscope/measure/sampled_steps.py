"""The sampled steps of a run: which optimizer steps carry the collective counter (`comm_count.py`, instrument
"collectives") and the step timer (`time_breakdown.py`, instrument "step_time"), and what they measured (`comm`, the
counted step's collectives; `timed`, each timed step's breakdown: the metric table's rows read them, `metrics.py`).
Any training loop drives it with these calls:

    steps.begin(step, max_steps, model, optimizer)   where optimizer step `step` begins (1-based)
    steps.end() -> bool                              where it ends: True when it was instrumented

A step is timed from its begin; the profiler begins the next step where the previous one ended, so its data loading
counts. An instrumented step is not a plain step: leave it out of throughput. Each instrument's work, in the step
and at the gather, runs under its `Instrument`: after a failure its figures are NaN in the gather and None in the
summary.
"""
from __future__ import annotations

from . import comm_count, time_breakdown
from .guard import Instrument, WarnOnce


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
                self._timer = time_breakdown.StepTimer(model, optimizer, self.device, self.timing).start()

    def carries(self, step: int, max_steps: int | None) -> bool:
        """Whether `step` runs the collective counter or the timer."""
        comm = self.comm_step is not None and step == min(self.comm_step, max_steps or self.comm_step)
        return (comm and self.collectives.ok) or (self._is_timed(step, max_steps) and self.timing.ok)

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
                    self.comm = {**counter.result(), "comm_padded_tokens": self._padded_tokens}
        if timer is not None:
            with self.timing:
                result = timer.stop()
                if keep and result is not None:
                    self.timed.append(result)
        return counter is not None or timer is not None

    def _is_timed(self, step: int, max_steps: int) -> bool:
        if max_steps and step > max_steps:
            return False
        every = self.time_every_n_steps
        return step == self.time_step or bool(every and step % every == 0)

