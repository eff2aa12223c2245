"""The sampled steps of a run: which optimizer steps carry the collective counter (`comm_count.py`) and the
step timer (`step_time.py`), and what they measured, as flat figures for the cross-rank gather and as the
summary's per-rank keys. Any training loop drives it with four calls:

    steps.begin(step, max_steps, model, optimizer)   where optimizer step `step` begins (1-based)
    steps.end() -> bool                              where it ends: True when it was instrumented
    steps.next(step, max_steps, model, optimizer)    right after, unless an evaluation or save follows
    steps.fields() / SampledSteps.complete(fields)   what it measured

A step is timed from the previous step's end (`next`) so its data loading counts; the first step, or one after
an evaluation, from its own begin. An instrumented step is not a plain step: leave it out of throughput.
"""
from __future__ import annotations

from contextlib import contextmanager

from . import comm_count, step_time

RANK_FIELDS = (*comm_count.RANK_FIELDS, *step_time.RANK_FIELDS)


@contextmanager
def _raising(_what):
    yield


class SampledSteps:
    def __init__(self, comm_step: int | None = 3, time_step: int | None = 4, time_every_n_steps: int | None = None,
                 device=None, guard=_raising, warn=None):
        self.comm_step, self.time_step, self.time_every_n_steps = comm_step, time_step, time_every_n_steps
        self.device, self.guard, self.warn = device, guard, warn
        self.comm, self.timed = None, []
        self._counter = self._timer = None
        self._padded_tokens = 0
        self._fields = None  # `fields()` until `end()` keeps a new result

    @property
    def active(self) -> bool:
        return self._counter is not None or self._timer is not None

    def begin(self, step: int, max_steps: int, model, optimizer) -> None:
        if self.comm_step is not None and step == min(self.comm_step, max_steps or self.comm_step):  # None: not known
            with self.guard("collective counting"):
                self._counter = comm_count.CollectiveCounter(self.warn).__enter__()
        self.next(step, max_steps, model, optimizer)  # no previous step's end started its timer

    def next(self, step: int, max_steps: int, model, optimizer) -> None:
        if self._timer is None and self._is_timed(step, max_steps):
            with self.guard("step time breakdown"):
                self._timer = step_time.StepTimer(model, optimizer, self.device).start()

    def add_batch(self, samples: int, seq_len: int) -> None:
        """A training forward's batch: the counted step's padded tokens (what TP's traffic scales with)."""
        if self._counter is not None:
            self._padded_tokens += samples * seq_len

    def end(self, keep: bool = True) -> bool:
        """Stop what runs over this step; True when something did. `keep=False` drops what it measured."""
        counter, timer, self._counter, self._timer = self._counter, self._timer, None, None
        if counter is not None:
            with self.guard("collective counting"):
                counter.__exit__(None, None, None)
                if keep:
                    self.comm, self._fields = {**counter.result(), "comm_padded_tokens": self._padded_tokens}, None
        if timer is not None:
            with self.guard("step time breakdown"):
                result = timer.stop()
                if keep:
                    self.timed.append(result)
                    self._fields = None
        return counter is not None or timer is not None

    def fields(self) -> dict:
        """This rank's figures as `RANK_FIELDS` floats (NaN: not measured); the same dict until a step adds some."""
        if self._fields is None:
            self._fields = comm_count.to_fields(self.comm) | step_time.to_fields(step_time.mean_breakdown(self.timed))
        return self._fields

    def complete(self, rank: dict) -> dict:
        """A rank's gathered fields -> its summary keys `comm`, `comm_sent_bytes_per_step`, `comm_padded_tokens`,
        `time_breakdown` (None where not measured)."""
        timed = step_time.from_fields(rank)
        if timed:
            timed["timed_steps"] = len(self.timed)
        return comm_count.from_fields(rank) | {"time_breakdown": timed}

    def _is_timed(self, step: int, max_steps: int) -> bool:
        if max_steps and step > max_steps:
            return False
        every = self.time_every_n_steps
        return step == self.time_step or bool(every and step % every == 0)


def straggler(ranks: list[dict]) -> dict | None:
    """The summary's top-level `straggler`, from the ranks' completed keys."""
    return step_time.straggler([r.get("time_breakdown") for r in ranks])
