"""`ShardingProfiler`: what a distributed strategy really does, measured on every rank of any training loop.

One owner for when and what to measure: model-state bytes (`state_bytes`), frozen models held beside the
trained one, throughput (`throughput`), memory (`memory`, `peak`), precision (`precision`), the cross-rank
gather and the summary file (`summary`). The Trainer callback (`callback.py`) only maps Trainer events onto it.

Here: the loop's calls (`step`, `logged`, `close`, ...), the set-up and each measurement (this rank's figures, the
gather started). By concern, the rest: what is sampled when, the hooks inside the user's step (`step_hooks.py`, the
part of the class that runs there); the steps' clocks (`step_clock.py`); the fields exchanged and what each rank's
report (`rank_figures.py`); the summary file's contents (`run_summary.py`).
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import torch

from . import rank_figures, run_summary
from .collective_timing import probe_links, probe_size
from .detect import live_strategy, visible_module, zero_buckets
from .guard import Guard, Instrument, WarnOnce, never_raises, validate_arguments
from .memory import device_of, read_memory, reset_peak
from .peak import figures as peak_figures
from .precision import PrecisionWatch, classify, effective_precision, gather_reports
from .rank_gather import Gathered, as_float, gather_objects, log_metrics, process_rank, route, start_gather
from .sampled_steps import SampledSteps  # issue 21
from .step_counts import StepCounts, count_batch, describe_flops, patch_size, unwrap
from .step_clock import StepClock
from .step_hooks import StepHooks
from .stragglers import Windows, line as straggler_line
from .throughput import FlopsModel, device_peak_flops, sequence_share, split_degrees, step_time_summary
from .watchdog import Watchdog
from ..state_bytes import count_state, forget
from ..summary import SUMMARY_FILE, write_summary

logger = logging.getLogger("shardscope")


class ShardingProfiler(StepHooks):
    """Per-rank model-state bytes, peak memory and throughput of any training loop, reduced across ranks.

    Usage, after `accelerator.prepare(...)` (or torch DDP / `fully_shard` / FSDP1, or `deepspeed.initialize`):

        with ShardingProfiler(model, optimizer, accelerator, output_dir="out") as profiler:
            for batch in loader:
                loss = model(**batch).loss; accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()
                profiler.step(batch)  # once per optimizer step: the batch, a list of its micro-batches, or counts

    Every `every_n_steps` steps each rank measures and one `all_gather` collects all ranks' figures (every
    rank must call `step()` equally often); `step()` returns them as metrics (also sent through
    `accelerator.log` when an accelerator is given). `close()` (or leaving the `with`) measures the run and
    rank 0 writes `output_dir/shardscope_summary.json` (`summary.FIELDS`; per rank the keys below).

    Logged keys (bytes per rank; README's "The profiling callback" says what each means): across ranks
    `shardscope/{params,grads,optimizer,frozen_models,peak_memory,peak_tensor}_bytes_{min,max,mean}`,
    `shardscope/{tokens_per_s_per_device,tflops_per_device,mfu}_{min,max,mean}`; over all data-parallel
    replicas `shardscope/samples_per_s` and `shardscope/tokens_per_s` (absent without tokens). TFLOP/s follow
    `throughput.FLOPS_CONVENTION`; MFU is absent where the device's peak is unknown (CPU).

    Summary only, per rank: `frozen_models` {name: parameter bytes this rank holds (ZeRO-3 partitions, FSDP shards,
    the dtype really held)} and `frozen_models_bytes`; `peak_tensor_bytes`, `peak_breakdown` {parameters, gradients,
    optimizer, activations, temporaries, buffers}, `peak_phase`, `peak_step` {micro_batch, seq_len, image_size,
    gradient_checkpointing} from one instrumented warm step (`memory_step`, left out of throughput; see `peak.py`);
    `cpu_peak_rss_bytes` (the process's peak RSS, libraries included, never called peak memory); `throughput`
    {rates above, samples, tokens, seconds, flops_convention}; from `precision.py`: `dtypes`, `master_params_bytes`,
    `compute_dtype`; top level `precision_verdict`. Each instrument's `result()` under its `name`. Sampled steps
    (`sampled_steps.py`, issue 21): `comm` {kind: {calls, bytes, sent_bytes}}, `comm_sent_bytes_per_step`,
    `comm_padded_tokens` on `comm_step`; `time_breakdown` on `time_step` (and every `time_every_n_steps`-th);
    `step_time_s` {median, p10, p90, steps} over the throughput window's optimizer steps; top
    level `straggler` (`stragglers.py`: compute time beside wall time, `throughput` {compute_seconds, compute_share}).
    Instrumented steps are left out of throughput. `hang_after` (seconds, "auto" or None): a step past it makes every
    rank write its record into `output_dir/shardscope_hang/` and rank 0 log the verdict (`watchdog.py`).

    Counting: a sample is a row of the batch (`samples=` overrides it: the callback passes the Trainer's count);
    tokens are the non-padding tokens of the step's training inputs, once; forwards that do not train (frozen
    models, no_grad or adapter-disabled passes) add FLOPs only. Without a batch, the training forwards seen count.
    A TP group is one data-parallel replica (global rates count it once).

    `instruments=[...]`: objects with `name`, `start(step)` (before step `step` runs), `stop(step)` (in `step()`)
    and `result()` (JSON, gathered from every rank at `close()` into each rank's summary); each call guarded.
    """

    # The planner's check of this run at its first training batch (on a GPU): a function injected from above
    # (shardscope.profiling sets shardscope.profiling.plan_for_live_run; measure/ does not import plan/). None: none.
    plan_for_live_run = None

    def __init__(self, model, optimizer, accelerator=None, output_dir=".", every_n_steps: int | None = 10,
                 frozen_models: dict | None = None, *, peak_tflops: float | None = None,
                 summary_file: str | None = SUMMARY_FILE, memory_step: int | None = 3, comm_step: int | None = 3,
                 time_step: int | None = 4, time_every_n_steps: int | None = None, precision: str | None = None,
                 instruments=(), flops_model: FlopsModel | None = None, start_step: int = 0,
                 last_step: int | None = None, summary_extra: dict | None = None, hang_after="auto"):
        validate_arguments(every_n_steps, peak_tflops, summary_file, memory_step=memory_step, comm_step=comm_step,
                           time_step=time_step, time_every_n_steps=time_every_n_steps, hang_after=hang_after)
        self.model, self.optimizer, self.accelerator = model, optimizer, accelerator
        self.output_dir, self.summary_file = Path(output_dir), summary_file
        self.every_n_steps, self.peak_tflops, self.memory_step = every_n_steps, peak_tflops, memory_step
        self.instruments, self.last_step = list(instruments), last_step  # last_step: when known (max_steps)
        self.summary_extra = dict(summary_extra or {})  # top-level summary keys the caller owns (the callback's fit)
        self.global_step = start_step  # optimizer steps taken (a resumed Trainer run starts past 0)
        self.warn_once, self._guards = WarnOnce(), {}  # _guards: one per figure (a Guard holds no state of its own)
        names = ("throughput", "state_bytes", "memory", "precision", "gpu compute")  # what it installs (guard.py)
        self._throughput, self._state, self._memory, self._precision_probe, self._gpu_compute = (
            Instrument(name, self.warn_once) for name in names)
        self._loop_instruments: list[Instrument] = []  # what the loop's adapter installs (the callback's batch feed)
        # _pending: a measurement whose gather step(defer=True) started; _sampled_due: see `_begin_sampled`
        self._closed, self._pending, self._sampled_due = False, None, True
        self._grads, self._step_peak, self.step_peak, self._adapter_layer = None, None, {}, None
        self._counts = StepCounts()  # the step's samples, tokens and FLOPs
        self._walk, self._route = {}, None  # {step: that step's snapshot's state_walk}; rank_gather.route, read once
        self._patch_size, self._frozen_patch_sizes = None, {}  # vision models' (read once: a config read costs ~6 us)
        self._precision, self._windows_compute = None, Windows()  # (stragglers.py)
        self._device, self._peak, self._flops_model, self._frozen_flops = torch.device("cpu"), None, flops_model, {}
        self.detected, self.model_facts, self.locations, self.memory = {}, {}, {}, {}
        self.frozen_models, self.precision, self._module = {}, precision, model
        with self.guard("strategy"):
            self._module = visible_module(model)
            self.detected.update(live_strategy(model, self._module, self.warn_once), **zero_buckets(optimizer))
        self._tp, self._sp = split_degrees(self.detected.get("mesh"))  # ranks sharing a batch / a sequence's tokens
        with self.guard("frozen models"):
            self.frozen_models = {str(name): unwrap(m) for name, m in (frozen_models or {}).items()}
        with self.guard("device"):
            self._device = device_of(accelerator, self._module)
        self._clock = StepClock(self._device, self._gpu_compute)  # the steps' times (cuda_compute on a CUDA rank)
        self._sampled = SampledSteps(comm_step, time_step, time_every_n_steps, self._device, self.warn_once)
        self._instrument_list = self._all_instruments()  # (read at every step)
        forget(self._module)  # state_bytes caches the module walk per model: a new run walks it afresh
        with self.guard("parameter counts"):
            self._describe_models()
        with self._throughput:
            self._install_hooks()
        with self._precision_probe:
            self._watch_precision()
        with self.guard("device peak FLOP/s"):
            self._peak = device_peak_flops(self.peak_tflops, self._device, self.precision)
        self._plan_due = self._device.type == "cuda" and self.plan_for_live_run is not None  # at the first batch
        if process_rank() == 0:
            with self.guard("detected strategy log"):
                logger.warning("shardscope detected: %s", json.dumps({**self.detected, **self.model_facts}))
        if not self._throughput.ok:  # no forward to anchor the first step's time on: start the clock now
            self._clock.mark("step_begin")
        self._begin()
        self._watchdog = Watchdog(output_dir, hang_after, self.instrument("watchdog"), self).start()  # hang records

    # --- The loop's calls --------------------------------------------------------------------------------------
    @never_raises()
    def begin_step(self) -> None:
        """Optional: where a step's time starts (by default at its first training forward, or where the previous
        `step()` returned); the Trainer callback calls it at each step begin."""
        if self._clock.run.anchor is None:  # (the previous step's end anchored it unless it paused)
            with self.guard("throughput"):
                self._clock.mark("step_begin")
        if self._sampled_due:
            self._begin_sampled()

    @never_raises()
    def add_batch(self, batch, samples: int | None = None) -> None:
        """Count one micro-batch as it is fed (loops that accumulate gradients may call this per micro-batch and
        `step()` without a batch); `samples` overrides the rows counted from the batch."""
        with self.guard("batch counting"):
            try:
                counted, tokens, seq_len = count_batch(batch, self._patch_size)
                flops = tokens * (self._flops_model.per_token(seq_len * self._sp) / self._tp) \
                    if tokens is not None and self._flops_model else None
            except TypeError as error:  # rows not yet collated (GRPO hands its prompts over): count the forwards
                self.warn_once("uncountable batch", f"{error}: samples, tokens and FLOPs are counted from the "
                               "training forwards instead", note=True)
                return
            if tokens is None:
                self.warn_once("no tokens", "the batch has no input_ids (images, audio?): samples are counted from "
                               "its first dimension, tokens and FLOP/s are left out", note=True)
            self._counts.add_batch(sequence_share(counted if samples is None else samples, self._sp), tokens, flops)

    @never_raises(default=dict)
    def step(self, batch=None, tokens=None, samples=None, *, pause: bool = False, defer: bool = False) -> dict:
        """Close one optimizer step (call it after `optimizer.step()`). `batch`: the dict fed to the model or a list of
        the step's micro-batches; `tokens=` / `samples=` (ints) override what is counted from it. `pause=True` leaves
        the time until the next `begin_step()` or training forward out (evaluation, checkpointing). Returns the metrics
        measured at this step ({} if none); `defer=True` leaves their gather running (`logged()` returns them)."""
        if self._closed:
            self.warn_once("closed", "step() after close(): nothing more is measured")
            return {}
        metrics = {} if self._pending is None else self.logged()  # a deferred measurement not collected since
        for micro in (batch if isinstance(batch, list) else [] if batch is None else [batch]):
            self.add_batch(micro)
        instrumented = self._sampled.active and self._sampled.end() or self._step_peak is not None
        if instrumented:
            self._end_step_peak(keep=True)
        if self.instruments:
            self._instruments("stop", self.global_step + 1)
        for instrument in self._instrument_list:
            if instrument.failure is not None:  # a failed instrument's hooks come out here, outside them
                instrument.remove()
        with self.guard("throughput"):
            counted = self._counts.close(samples, tokens, self._flops_model, self._tp)
            if not instrumented:
                self._clock.mark("add_batch", *counted)
            self._clock.mark("step_end", pause_after=pause, count=not instrumented)
        self.global_step += 1
        self._watchdog.step_done(self.global_step, pause)
        if self._is_measure_step(self.global_step):
            self._measure_and_log()
            metrics.update({} if defer else self.logged())
        self._begin(sampled=not pause)  # after evaluation or a save: at the next begin_step (or training forward)
        return metrics

    @never_raises(default=dict)
    def logged(self) -> dict:
        """The metrics of a measurement `step(defer=True)` left pending ({} when none), its gather awaited; also sent
        through `accelerator.log` when an accelerator is given."""
        pending, self._pending, metrics = self._pending, None, {}
        with self.guard("metric logging"):
            if pending is not None:
                metrics = log_metrics(self._complete_all(pending, summary=False), self._tp)
                self._windows_compute.add(pending.ranks or [])  # (gathered above) per rank: compute_seconds
            if self.accelerator is not None and metrics:
                self.accelerator.log(metrics, step=pending.step)
        return metrics

    @never_raises()
    def close(self) -> Path | None:
        """Measure the whole run on every rank (collectives: call it on every rank) and write the summary on
        rank 0; returns its path there. A second call does nothing."""
        if self._closed:
            return None
        self.logged()  # a measurement's gather still pending: completed on every rank before the next collective
        self._closed = True
        self._sampled.end(keep=False)  # a timer started for a step that never ran
        self._end_step_peak(keep=False)  # a step begun and never closed is not measured
        ranks, link_probe, precision_ranks = self._complete_all(self._measure_rank(summary=True)), None, []
        with self.guard("link probe"):  # collectives on every rank (all have the same summary_file), for the summary
            link_probe = probe_links(probe_size(ranks), self._device) if self.summary_file else None
        with self.guard("precision"):  # one collective, reached on every rank
            precision_ranks = gather_reports(self._precision)
        extra, statuses = [{}] * len(ranks), [self._statuses()] * len(ranks)
        with self.guard("instruments"):  # one collective: every rank's instrument statuses and results
            gathered = gather_objects({"status": self._statuses(), "results": self._instruments("result")})
            extra, statuses = [g["results"] for g in gathered], [g["status"] for g in gathered]
        self._release()
        if process_rank() != 0 or not self.summary_file:
            return None
        with self.guard("summary file"):
            summary = run_summary.contents(
                ranks, extra, statuses, detected=self.detected, extra=self.summary_extra, model=self.model_facts,
                frozen_flops=self._frozen_flops, device=self._device, precision=self.precision,
                precision_ranks=precision_ranks, global_step=self.global_step, locations=self.locations,
                windows=self._windows_compute, link_probe=link_probe, memory=self.memory)
            path = write_summary(self.output_dir / self.summary_file, summary)
            logger.warning("shardscope summary written to %s%s", path,
                           "; " + straggler_line(summary["straggler"]) if straggler_line(summary["straggler"]) else "")
            return path
        return None

    def __enter__(self) -> "ShardingProfiler":
        return self

    def __exit__(self, kind, error, _tb) -> None:  # also on an exception in the loop: what was measured is written
        if error is not None:
            self._watchdog.failed(error)
        self.close()

    # --- Instruments -------------------------------------------------------------------------------------------
    def _release(self):
        """Leave nothing behind that a run without the profiler would not have: every hook, wrapped method and
        dispatch mode out, no reference to the model, the optimizer, their tensors or the process group."""
        self._watchdog.stop()
        for instrument in self._all_instruments():
            instrument.remove()
        self.model = self.optimizer = self.accelerator = self._module = self._adapter_layer = None
        self.frozen_models, self._grads, self._precision, self._route, self._walk = {}, None, None, None, {}

    def _all_instruments(self) -> tuple[Instrument, ...]:
        return (self._throughput, self._state, self._memory, self._precision_probe,
                *((self._gpu_compute,) if self._device.type == "cuda" else ()), *self._sampled.instruments,
                *self._loop_instruments)

    def instrument(self, name: str) -> Instrument:
        """A new instrument for what the loop's adapter installs (warned, reported and removed as the profiler's)."""
        self._loop_instruments.append(Instrument(name, self.warn_once))
        self._instrument_list = self._all_instruments()
        return self._loop_instruments[-1]

    def _statuses(self) -> dict:
        """{instrument: "ok" or why it stopped} on this rank (memory: why the memory step was not measured)."""
        out = {i.name: i.status for i in self._all_instruments()}
        if self.memory_step is None:
            out["memory"] = "off (memory_step=None)"
        return out

    # --- Measuring ---------------------------------------------------------------------------------------------
    def _measure_and_log(self) -> None:
        self._pending = self._measure_rank(summary=False)  # guarded inside, collective; logged() completes it
        with self.guard("throughput"):
            self._clock.reset_interval()
        with self.guard("peak memory"):
            reset_peak(self._device)

    def _complete_all(self, gathered: Gathered, summary: bool = True) -> list[dict]:
        """Every rank's reported figures, once the exchange completes (this rank's alone where it failed)."""
        ranks = [gathered.local]
        with self.guard("cross-rank gather"):
            ranks = gathered.result()
        return [self._reported(rank, summary) for rank in ranks]

    def _reported(self, rank: dict, summary: bool) -> dict:
        with self.guard("reported figures"):
            return rank_figures.complete(rank, summary, self.frozen_models, self._peak, self._sampled, self._memory)
        return rank_figures.empty()

    def _measure_rank(self, summary: bool) -> Gathered:
        """This rank's figures over the run (`summary`) or the logging interval, the exchange with every rank started
        (a collective: called on all ranks)."""
        window = self._clock.run if summary else self._clock.interval
        fields = rank_figures.fields(self.frozen_models, summary)
        mine = dict.fromkeys(fields, math.nan)  # (a logging step's: what its gather sends, and a few unsent)
        with self.guard("model-state bytes"):
            walk = None if summary else self._walk.pop(self.global_step, None)  # this step's snapshot's walk
            counted = count_state(self._module, self.optimizer, grad_bytes=self._grads, walk=walk)
            for category in ("params", "grads", "optimizer"):
                mine[f"{category}_bytes"] = counted.total(category)
                if summary:  # (the logs read neither)
                    mine[f"{category}_cpu_bytes"] = counted.by_device[category].get("cpu", 0)
                    self.locations[category] = sorted(counted.by_device[category])
            mine["trainable_params_bytes"] = counted.trainable_params
        with self.guard("frozen model bytes"):
            for name, module in self.frozen_models.items():
                mine[f"frozen:{name}"] = count_state(module).total("params")
        with self.guard("peak memory"):
            if summary or self._device.type == "cuda":  # RSS is for the summary only
                self.memory = read_memory(self._device)
            mine["cpu_peak_rss_bytes"] = self.memory.get("cpu_peak_rss_bytes", math.nan)
            if self._device.type == "cuda":
                mine["peak_memory_bytes"] = self.memory["peak_memory_bytes"]
        if self.step_peak and self._memory.ok:
            with self._memory:
                mine.update(peak_figures(self.step_peak))
                if self._device.type != "cuda":
                    mine["peak_memory_bytes"] = self.step_peak["peak_tensor_bytes"]
        with self.guard("throughput"):
            totals = window.totals()
            mine.update(samples=totals.samples, seconds=totals.seconds, tokens=as_float(totals.tokens),
                        flops=as_float(totals.flops), compute_seconds=as_float(self._clock.compute_seconds(summary)))
            if summary:  # (the logs do not read the step times)
                mine.update({f"step_time_{k}": as_float(v) for k, v in step_time_summary(window.durations).items()})
        mine.update(self._sampled.fields() if summary else ())
        with self.guard("cross-rank gather"):
            self._route = route(self._device, self._route)
            return start_gather(mine, self.global_step, self._route, fields)
        return Gathered(mine, self.global_step, ranks=[mine])

    # --- Set-up ------------------------------------------------------------------------------------------------
    def _describe_models(self):
        """Parameter counts (FLOPs, the summary's `model`) and vision patch sizes of the trained and frozen models."""
        self._flops_model = self._flops_model or describe_flops(self._module)
        self._frozen_flops = {name: describe_flops(m) for name, m in self.frozen_models.items()}
        self._patch_size = patch_size(self._module)
        self._frozen_patch_sizes = {name: patch_size(m) for name, m in self.frozen_models.items()}
        self.model_facts = {"name_or_path": getattr(getattr(self._module, "config", None), "_name_or_path", None),
                            "params_total": self._flops_model.total_params,
                            "trainable_params": self._flops_model.trainable_total}

    def _watch_precision(self):
        """The configured precision: given, else the accelerator's, else what the tensors are at the start."""
        if self.precision is None and self.accelerator is not None:
            self.precision = {"no": "fp32"}.get(str(self.accelerator.mixed_precision), self.accelerator.mixed_precision)
        if self.precision is None:
            self.precision = effective_precision(classify(self._module, self.optimizer)).split("-")[0]
        flags = SimpleNamespace(bf16=self.precision == "bf16", fp16=self.precision == "fp16")
        self._precision = PrecisionWatch(self._module, self.optimizer, flags, self.detected.get("strategy"),
                                         self._precision_probe)
        if process_rank() == 0:
            logger.warning("shardscope precision: %s", json.dumps(self._precision.report()))

    def _instruments(self, method: str, *args) -> dict:
        """Call `method` on every instrument, each guarded; {name: what it returned}."""
        out = {}
        for instrument in self.instruments:
            name = getattr(instrument, "name", type(instrument).__name__)
            with self.guard(f"instrument {name}"):
                out[name] = getattr(instrument, method)(*args)
        return out

    def guard(self, what: str) -> Guard:
        """Measuring never stops training: a failure inside is warned about once and left out."""
        guard = self._guards.get(what)
        return guard if guard is not None else self._guards.setdefault(what, Guard(self.warn_once, what))

