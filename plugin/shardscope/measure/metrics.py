"""The metric table: each per-rank figure once, with where it is read, whether the logs carry it, how it is reduced
across ranks and how it is written into each rank's summary entry. A new per-rank metric is one row of `METRICS`.

A measurement (every `every_n_steps` steps for the logs, once at the end for the summary) reads each source once on
every rank (`Readings`, filled by the profiler), then each row's `read` turns the readings into the row's fields
(floats; NaN: not measured). One all_gather exchanges every row's fields (`rank_gather.start_gather`, for the logs
only the rows with `logs`), then each row's `write` turns a rank's gathered fields into its summary value (the
summary's `ranks`; for the logs, what `log_metrics` reduces: min, max and mean over ranks of each row's `reduced`).

A row reads and writes under its source's guard (the profiler's `Guard` of that source, or the instrument that
measured it): a failure leaves that row out (NaN, then None), and every row of an instrument that failed is None.
The per-rank keys that are not figures (the precision report, the instruments' results) are gathered as objects at
the end of the run (`run_summary.py`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from ..summary import reduce_ranks
from . import comm_count, peak, step_log, throughput, time_breakdown
from .rank_gather import int_or_none

PREFIX = "shardscope/"
STATS = ("min", "max", "mean")


@dataclass
class Readings:
    """What one measurement read on this rank, by source (None: not read there, or its reading failed)."""

    cuda: bool  # a CUDA rank (its peak memory is the allocator's)
    state: Any = None  # `state_bytes.count_state`'s count of the parameters, gradients and optimizer state
    frozen: dict | None = None  # {name: parameter bytes} of each frozen model
    memory: dict | None = None  # `memory.read_memory`'s readings ({} where not read: RSS is for the summary only)
    memory_step: dict | None = None  # the memory step's `peak.StepPeak.result()`
    window: Any = None  # the throughput window's `WindowTotals` (its compute seconds in `compute`)
    durations: list | None = None  # the window's step times (the summary's measurement only)
    comm: dict | None = None  # the counted step's collectives (`sampled_steps.SampledSteps.comm`)
    timed: list | None = None  # the timed steps' breakdowns (`SampledSteps.timed`)
    steps: Any = None  # the tokens fed and the measured steps (`step_log.StepLog`)


@dataclass(frozen=True)
class Metric:
    """One row: `key` in each rank's summary entry; `source`: the `Readings` attribute it is read from (and the guard
    it runs under); `read`: readings -> its value (its one field, named `key`) or {field: value} (`fields`);
    `fields`: what it sends in the gather when not one field named `key` (() for a row written from others' fields;
    `per_frozen_model`: one `<key>:<name>` field per frozen model); `write`: (a rank's gathered fields, the run's
    facts) -> its summary value (default: its field as an integer); `logs`: sent and written at each logging
    measurement too; `reduced`: the logged name of its min/max/mean over ranks (`shardscope/<name>_{min,max,mean}`),
    or {key inside its value: logged name}."""

    key: str
    source: str
    read: Callable | None
    fields: tuple[str, ...] | None = None
    write: Callable | None = None
    logs: bool = False
    reduced: str | dict | None = None
    per_frozen_model: bool = False

    def __post_init__(self):
        if self.reduced and not self.logs:
            raise ValueError(f"metric {self.key}: a reduced metric is logged")

    def sent(self, frozen_names) -> tuple[str, ...]:
        """The fields this row sends in the gather."""
        if self.per_frozen_model:
            return tuple(f"{self.key}:{name}" for name in frozen_names)
        return (self.key,) if self.fields is None else self.fields

    def written(self, rank: dict, facts):
        return int_or_none(rank[self.key]) if self.write is None else self.write(rank, facts)

    def reductions(self) -> tuple:
        """((key inside the value or None, logged name), ...)."""
        if isinstance(self.reduced, str):
            return ((None, self.reduced),)
        return tuple((self.reduced or {}).items())


def _state(category: str, on_cpu: bool = False) -> Callable:
    if on_cpu:
        return lambda r: r.state.by_device[category].get("cpu", 0)
    return lambda r: r.state.total(category)


def _peak_memory(r: Readings) -> float:
    """The allocator's peak on a CUDA rank; on a CPU rank the memory step's tensor peak (RSS is not a tensor peak)."""
    if r.cuda:
        return r.memory["peak_memory_bytes"]
    return r.memory_step["peak_tensor_bytes"] if r.memory_step else math.nan


def _frozen_models(rank: dict, facts) -> dict:
    return {k.partition(":")[2]: int_or_none(v) for k, v in rank.items() if k.startswith("frozen_models:")}


def _frozen_total(rank: dict, facts) -> int | None:
    held = _frozen_models(rank, facts).values()
    return sum(held) if None not in held else None


def _comm_key(key: str) -> Callable:
    return lambda rank, facts: comm_count.from_fields(rank)[key]


METRICS = (
    Metric("params_bytes", "state", _state("params"), logs=True, reduced="params_bytes"),
    Metric("grads_bytes", "state", _state("grads"), logs=True, reduced="grads_bytes"),
    Metric("optimizer_bytes", "state", _state("optimizer"), logs=True, reduced="optimizer_bytes"),
    Metric("trainable_params_bytes", "state", lambda r: r.state.trainable_params),
    Metric("params_cpu_bytes", "state", _state("params", on_cpu=True)),
    Metric("grads_cpu_bytes", "state", _state("grads", on_cpu=True)),
    Metric("optimizer_cpu_bytes", "state", _state("optimizer", on_cpu=True)),
    Metric("cpu_peak_rss_bytes", "memory", lambda r: r.memory.get("cpu_peak_rss_bytes", math.nan)),
    Metric("frozen_models", "frozen", lambda r: {f"frozen_models:{name}": v for name, v in r.frozen.items()},
           per_frozen_model=True, write=_frozen_models, logs=True),
    Metric("frozen_models_bytes", "frozen", None, fields=(), write=_frozen_total, logs=True,
           reduced="frozen_models_bytes"),
    Metric("peak_memory_bytes", "memory", _peak_memory, logs=True, reduced="peak_memory_bytes"),
    Metric("peak_tensor_bytes", "memory_step", lambda r: r.memory_step["peak_tensor_bytes"], logs=True,
           reduced="peak_tensor_bytes"),
    Metric("peak_breakdown", "memory_step", lambda r: peak.breakdown_fields(r.memory_step),
           fields=peak.BREAKDOWN_FIELDS, write=lambda rank, facts: peak.breakdown_of(rank)),
    Metric("peak_phase", "memory_step", lambda r: peak.phase_field(r.memory_step),
           write=lambda rank, facts: peak.phase_of(rank)),
    Metric("peak_step", "memory_step", lambda r: peak.step_fields(r.memory_step), fields=peak.STEP_FIELDS,
           write=lambda rank, facts: peak.step_of(rank)),
    Metric("throughput", "window", lambda r: throughput.window_fields(r.window), fields=throughput.WINDOW_FIELDS,
           write=lambda rank, facts: throughput.throughput_of(rank, facts.peak_flops), logs=True,
           reduced={"tokens_per_s": "tokens_per_s_per_device", "tflops_per_device": "tflops_per_device",
                    "mfu": "mfu", "compute_share": "compute_share"}),
    Metric("step_seconds", "window", lambda r: throughput.step_time_fields(r.durations),
           fields=throughput.STEP_TIME_FIELDS, write=lambda rank, facts: throughput.step_time_of(rank)),
    Metric("comm", "comm", lambda r: comm_count.to_fields(r.comm), fields=comm_count.RANK_FIELDS,
           write=_comm_key("comm")),
    Metric("comm_sent_bytes_per_step", "comm", None, fields=(), write=_comm_key("comm_sent_bytes_per_step")),
    Metric("comm_padded_tokens", "comm", None, fields=(), write=_comm_key("comm_padded_tokens")),
    Metric("worst_step", "steps", lambda r: r.steps.fields(), fields=step_log.FIELDS,
           write=lambda rank, facts: step_log.worst_of(rank)),
    Metric("padding_waste", "steps", None, fields=(), write=lambda rank, facts: step_log.waste_of(rank)),
    Metric("last_step", "steps", lambda r: step_log.last_fields(r.steps), fields=step_log.LAST_FIELDS,
           write=lambda rank, facts: step_log.last_of(rank), logs=True,
           reduced={"tokens": "step_tokens", "padded_tokens": "step_padded_tokens"}),
    Metric("measured_steps", "steps", None, fields=(), write=lambda rank, facts: step_log.measured_of(rank)),
    Metric("time_breakdown", "timed", lambda r: time_breakdown.to_fields(r.timed), fields=time_breakdown.RANK_FIELDS,
           write=lambda rank, facts: time_breakdown.from_fields(rank)),
)
LOGGED = tuple(m for m in METRICS if m.logs)


def rows(summary: bool) -> tuple[Metric, ...]:
    """The rows a measurement carries: every row for the summary's, those with `logs` for the logs'."""
    return METRICS if summary else LOGGED


def fields(frozen_names, summary: bool) -> tuple[str, ...]:
    """The fields a measurement sends, row by row."""
    return tuple(f for m in rows(summary) for f in m.sent(frozen_names))


def read(readings: Readings, guards: dict, frozen_names, summary: bool) -> dict:
    """This rank's fields (NaN where not measured): each row read from its source under that source's guard."""
    out = dict.fromkeys(fields(frozen_names, summary), math.nan)
    for m in rows(summary):
        guard = guards[m.source]
        if m.read is not None and getattr(readings, m.source) is not None and getattr(guard, "ok", True):
            with guard:
                value = m.read(readings)
                out.update(value if isinstance(value, dict) else {m.key: value})
    for m in rows(summary):  # an instrument that failed while its rows were read: none of them is measured
        if not getattr(guards[m.source], "ok", True):
            out.update(dict.fromkeys(m.sent(frozen_names), math.nan))
    return out


def written(rank: dict, facts, guards: dict, summary: bool) -> dict:
    """One rank's summary values (None where not measured) from its gathered fields, each row under its guard."""
    out = {}
    for m in rows(summary):
        out[m.key] = None
        with guards[m.source]:
            out[m.key] = m.written(rank, facts)
    for m in rows(summary):  # an instrument that failed (in the step, the gather or here): none of its rows
        if not getattr(guards[m.source], "ok", True):
            out[m.key] = None
    return out


def log_metrics(ranks: list[dict], tp: int = 1) -> dict:
    """The logs' metrics: each reduced row's min/max/mean over the ranks' written values, then the global samples/s
    and tokens/s (sum over ranks / `tp`: the ranks of a tensor-parallel group share one batch, so each data-parallel
    replica counts once)."""
    flat = []
    for rank in ranks:
        rates = rank.get("throughput") or {}
        values = {"samples_per_s": rates.get("samples_per_s"), "tokens_per_s": rates.get("tokens_per_s")}
        for m in LOGGED:
            for inside, name in m.reductions():
                values[name] = rank.get(m.key) if inside is None else (rank.get(m.key) or {}).get(inside)
        flat.append(values)
    names = [name for m in LOGGED for _, name in m.reductions()]
    reduced = reduce_ranks(flat, names, tp)
    metrics = {f"{PREFIX}{name}_{stat}": reduced[name][stat] for name in names if name in reduced for stat in STATS}
    for key in ("samples_per_s", "tokens_per_s"):
        if reduced[f"global_{key}"] is not None:
            metrics[f"{PREFIX}{key}"] = reduced[f"global_{key}"]
    return metrics

