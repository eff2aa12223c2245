"""`ShardingProfiler`: what a distributed strategy really does, measured on every rank of any training loop.

One owner for when and what to measure: model-state bytes (`state_bytes`), frozen models held beside the
trained one, throughput (`throughput`), memory (`memory`, `peak`), precision (`precision`), the cross-rank
gather and the summary file (`summary`). The Trainer callback (`callback.py`) only maps Trainer events onto it.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from .. import __version__
from .collective_timing import probe_links, probe_size
from .cuda_compute import gpu_compute
from .guard import Guard, Instrument, MethodWrap, WarnOnce, instrument_statuses, never_raises, validate_arguments
from .memory import device_of, memory_kind, read_memory, reset_peak
from .peak import RANK_FIELDS as PEAK_FIELDS, SUMMARY_KEYS as PEAK_KEYS, StepPeak
from .peak import figures as peak_figures, reported as peak_reported
from .precision import PrecisionWatch, classify, effective_precision, gather_reports, run_verdict
from .rank_gather import (Gathered, as_float, gather_objects, int_or_none, log_metrics, none_if_nan,
                          process_rank, route, start_gather)
from .sampled_steps import RANK_FIELDS as SAMPLED_FIELDS, SampledSteps  # issue 21
from .stragglers import Windows, line as straggler_line, straggler
from ..state_bytes import (base_optimizer, count_state, forget, gradient_bytes, held_gradients, state_walk,
                           zero_optimizer)
from ..strategy import num_nodes
from ..summary import COMPONENTS, SUMMARY_FILE, write_summary
from .detect import live_strategy, visible_module, zero_buckets
from .step_counts import StepCounts, count_batch, describe_flops, first_adapter_layer, patch_size, unwrap
from .throughput import (FLOPS_CONVENTION, STEP_TIME_KEYS, FlopsModel, ThroughputWindow, WindowTotals, batch_counts,
                         device_peak_flops, rates, sequence_share, split_degrees, step_time_summary)
from .watchdog import Watchdog

logger = logging.getLogger("shardscope")

# Per-rank figures exchanged with one all_gather per measurement (NaN = not measured on that rank); one
# `frozen:<name>` field per frozen model follows them.
RANK_FIELDS = ("params_bytes", "grads_bytes", "optimizer_bytes", "trainable_params_bytes",
               "params_cpu_bytes", "grads_cpu_bytes", "optimizer_cpu_bytes", "peak_memory_bytes",
               "samples", "tokens", "flops", "seconds", "compute_seconds", *(f"step_time_{k}" for k in STEP_TIME_KEYS),
               "cpu_peak_rss_bytes", *PEAK_FIELDS, *SAMPLED_FIELDS)
# ... of which the byte counts reported as they are (the peak's and the sampled steps' are reported apart)
COUNTED_BYTES = tuple(k for k in RANK_FIELDS if k.endswith("_bytes") and not k.startswith(("peak_", "comm_")))
LOGGED_BYTES = ("params_bytes", "grads_bytes", "optimizer_bytes")  # ... of which the logs reduce (`rank_gather.REDUCED`)
# ... and all `_complete(summary=False)` reads: what a measurement for the logs sends (then each `frozen:<name>`)
LOGGED_FIELDS = (*LOGGED_BYTES, "peak_memory_bytes", "peak_tensor_bytes", "samples", "tokens", "flops", "seconds",
                 "compute_seconds")


class ShardingProfiler:
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
        # _pending: a measurement whose gather step(defer=True) started; _link_probe: `collective_timing.probe_links`
        self._closed, self._pending, self._link_probe, self._sampled_due = False, None, None, True  # (_begin_sampled)
        window = functools.partial(ThroughputWindow, time.perf_counter)
        self._interval, self._run, self._counts = window(), window(), StepCounts()
        self._grads, self._step_peak, self.step_peak, self._adapter_layer = None, None, {}, None
        self._walk, self._route = {}, None  # {step: that step's snapshot's state_walk}; rank_gather.route, read once
        self._patch_size, self._frozen_patch_sizes = None, {}  # vision models' (read once: a config read costs ~6 us)
        self._precision, self._precision_ranks, self._windows_compute = None, [], Windows()  # (stragglers.py)
        self._device, self._peak, self._flops_model, self._frozen_flops = torch.device("cpu"), None, flops_model, {}
        self.detected, self.model_facts, self.locations, self.memory = {}, {}, {}, {}
        self.frozen_models, self.precision, self._module = {}, precision, model
        with self.guard("strategy"):
            self._module = visible_module(model)
            self.detected.update(live_strategy(model, self._module, self.warn_once), **zero_buckets(optimizer))
        self._tp, self._sp = split_degrees(self.detected.get("mesh"))  # ranks sharing a batch / a sequence's tokens
        with self.guard("frozen models"):
            self.frozen_models = {str(name): unwrap(m) for name, m in (frozen_models or {}).items()}
        frozen_fields = tuple(f"frozen:{name}" for name in self.frozen_models)
        self._fields, self._log_fields = (*RANK_FIELDS, *frozen_fields), (*LOGGED_FIELDS, *frozen_fields)
        with self.guard("device"):
            self._device = device_of(accelerator, self._module)
        self._gpu = gpu_compute(self._device, self._gpu_compute)  # None on CPU ranks (cuda_compute.py)
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
            self._windows("step_begin")
        self._begin()
        self._watchdog = Watchdog(output_dir, hang_after, self.instrument("watchdog"), self).start()  # hang records

    # --- The loop's calls --------------------------------------------------------------------------------------
    @never_raises()
    def begin_step(self) -> None:
        """Optional: where a step's time starts (by default at its first training forward, or where the previous
        `step()` returned); the Trainer callback calls it at each step begin."""
        if self._run.anchor is None:  # (the previous step's end anchored it unless it paused)
            with self.guard("throughput"):
                self._windows("step_begin")
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
                self._windows("add_batch", *counted)
            self._windows("step_end", pause_after=pause, count=not instrumented)
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
        ranks = self._complete_all(self._measure_rank(self._run))
        with self.guard("link probe"):  # collectives on every rank (all have the same summary_file), for the summary
            self._link_probe = probe_links(probe_size(ranks), self._device) if self.summary_file else None
        with self.guard("precision"):  # one collective, reached on every rank
            self._precision_ranks = gather_reports(self._precision)
        extra, statuses = [{}] * len(ranks), [self._statuses()] * len(ranks)
        with self.guard("instruments"):  # one collective: every rank's instrument statuses and results
            gathered = gather_objects({"status": self._statuses(), "results": self._instruments("result")})
            extra, statuses = [g["results"] for g in gathered], [g["status"] for g in gathered]
        self._release()
        if process_rank() != 0 or not self.summary_file:
            return None
        with self.guard("summary file"):
            summary = self._summary(ranks, extra) | {"instruments": instrument_statuses(statuses)}
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

    # --- Counting ----------------------------------------------------------------------------------------------
    def _install_hooks(self):
        """Forward hooks tell training forwards from those that do not train; a step hook snapshots gradients."""
        self._throughput.hook(self._module.register_forward_pre_hook, self._on_forward, with_kwargs=True)
        for name, module in self.frozen_models.items():
            self._throughput.hook(module.register_forward_pre_hook, functools.partial(self._on_frozen_forward, name),
                                  with_kwargs=True)
        self._adapter_layer = first_adapter_layer(self._module)

        def snapshot_gradients(*_):  # on the first step, steps that measure and the last one (when known)
            upcoming = self.global_step + 1
            measuring = self._is_measure_step(upcoming) or upcoming == self.last_step
            if self._grads is None or measuring:
                walk = state_walk(self._module, self.optimizer)  # read once: the step's count reuses it
                self._grads = gradient_bytes(held_gradients(self._module, self.optimizer, walk))
                self._walk = {upcoming: walk} if measuring else {}

        with self._state:
            zero, base = zero_optimizer(self.optimizer), base_optimizer(self.optimizer)
            if zero is not None:  # DeepSpeed ZeRO optimizers have no step hooks: wrap this instance's step
                MethodWrap(self._state, zero, "step", snapshot_gradients)
            elif base is not None:
                self._state.hook(base.register_step_pre_hook, snapshot_gradients)

    def _on_forward(self, module, args, kwargs):
        if not module.training:  # evaluation
            return
        if self._step_peak is not None or self._sampled.active:  # an instrumented step is not throughput
            if self._sampled.active and torch.is_grad_enabled():  # the counted step's padded tokens
                with self.guard("batch counting"):
                    samples, _, seq_len = batch_counts(args, kwargs)
                    self._sampled.add_batch(samples, seq_len)
            return
        if self._plan_due and torch.is_grad_enabled():
            self._plan_due = False
            with self.guard("plan for the live run"):
                self._plan_live_run({"input_ids": args[0], **kwargs} if args else kwargs)
            self._windows("restart")  # the plan's seconds are not the step's
        if self._sampled_due:  # deferred by a pause: starts before the first training forward at the latest
            self._begin_sampled()
        with self.guard("batch counting"):
            adapters_off = self._adapter_layer is not None and self._adapter_layer.disable_adapters
            training = torch.is_grad_enabled() and not adapters_off
            if training:
                if self._run.anchor is None:  # (begin_step anchored it, most often)
                    self._windows("step_begin")  # the first training forward anchors the step's time
                if self._counts.given:  # the loop hands its batches over (the callback does): nothing to count
                    return
            samples, tokens, seq_len = batch_counts(args, kwargs, self._patch_size)  # module is self._module
            if training:
                flops = tokens * (self._flops_model.per_token(seq_len * self._sp) / self._tp) \
                    if tokens is not None and self._flops_model else None
                self._counts.saw_training(sequence_share(samples, self._sp), tokens, flops)
            elif tokens is not None and self._flops_model:  # a reference / generation pass of the trained model
                self._counts.inference_flops += tokens * (self._flops_model.forward_per_token(seq_len) / self._tp)

    def _on_frozen_forward(self, name, module, args, kwargs):
        if not self._module.training or self._step_peak is not None or self._sampled.active:
            return
        with self.guard("batch counting"):
            _, tokens, seq_len = batch_counts(args, kwargs, self._frozen_patch_sizes.get(name))
            flops_model = self._frozen_flops.get(name)
            if tokens is not None and flops_model is not None:
                self._counts.inference_flops += tokens * (flops_model.forward_per_token(seq_len) / self._tp)

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
        self._pending = self._measure_rank(self._interval)  # guarded inside, collective; logged() completes it
        with self.guard("throughput"):
            self._interval.reset()
            if self._gpu is not None:
                self._gpu.reset()
        with self.guard("peak memory"):
            reset_peak(self._device)

    def _complete_all(self, gathered: Gathered, summary: bool = True) -> list[dict]:
        """Every rank's reported figures, once the exchange completes (this rank's alone where it failed)."""
        ranks = [gathered.local]
        with self.guard("cross-rank gather"):
            ranks = gathered.result()
        return [self._complete_or_empty(rank, summary) for rank in ranks]

    def _measure_rank(self, window: ThroughputWindow) -> Gathered:
        """This rank's figures, the exchange with every rank started (a collective: called on all ranks)."""
        summary = window is self._run  # the whole run's window: the summary's measurement
        fields = self._fields if summary else self._log_fields
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
                        flops=as_float(totals.flops),  # compute: CPU ranks' thread time; CUDA: cuda_compute
                        compute_seconds=as_float(totals.compute if self._device.type == "cpu" else
                                                 self._gpu_seconds(summary)))
            if summary:  # (the logs do not read the step times)
                mine.update({f"step_time_{k}": as_float(v) for k, v in step_time_summary(window.durations).items()})
        mine.update(self._sampled.fields() if summary else ())
        with self.guard("cross-rank gather"):
            self._route = route(self._device, self._route)
            return start_gather(mine, self.global_step, self._route, fields)
        return Gathered(mine, self.global_step, ranks=[mine])

    def _complete_or_empty(self, rank: dict, summary: bool) -> dict:
        with self.guard("reported figures"):
            return self._complete(rank, summary)
        return {key: None for key in (*COMPONENTS, "peak_memory_bytes")} | {"throughput": {}}

    def _complete(self, rank: dict, summary: bool = True) -> dict:
        """Turn one rank's raw counts into reported figures (`summary=False`: those the logs reduce, no more)."""
        out = {k: int_or_none(rank[k]) for k in (COUNTED_BYTES if summary else LOGGED_BYTES)}
        out["frozen_models"] = {name: int_or_none(rank[f"frozen:{name}"]) for name in self.frozen_models}
        frozen = [v for v in out["frozen_models"].values() if v is not None]
        out["frozen_models_bytes"] = sum(frozen) if len(frozen) == len(self.frozen_models) else None
        out["peak_memory_bytes"] = int_or_none(rank["peak_memory_bytes"])
        if summary:
            out.update(dict.fromkeys(PEAK_KEYS))  # None unless measured
            with self._memory:
                out.update(peak_reported(rank))
        else:  # (one number, read as the others are)
            out["peak_tensor_bytes"] = int_or_none(rank["peak_tensor_bytes"])
        totals = WindowTotals(rank["samples"], none_if_nan(rank["tokens"]), none_if_nan(rank["flops"]),
                              0.0 if math.isnan(rank["seconds"]) else rank["seconds"],
                              none_if_nan(rank["compute_seconds"]))
        out["throughput"] = rates(totals, self._peak)
        if summary:
            out["throughput"].update(samples=int_or_none(totals.samples), tokens=int_or_none(totals.tokens),
                                     seconds=totals.seconds, compute_seconds=totals.compute,
                                     flops_convention=FLOPS_CONVENTION)
            step_time = {k: none_if_nan(rank[f"step_time_{k}"]) for k in STEP_TIME_KEYS}
            out["step_time_s"] = {**step_time, "steps": int(step_time["steps"] or 0)}
            out.update(self._sampled.complete(rank))
        return out

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

    def _plan_live_run(self, inputs: dict):
        """Warn (rank 0) when the planner's peak for this run at the first training batch's shape does not fit this
        GPU (`plan_for_live_run`, traced as `fit` traces). Saved in the summary as `preflight_plan`."""
        plan = self.plan_for_live_run(self._module, self.detected.get("strategy"), self.detected.get("mesh"),
                                      self.detected.get("world_size", 1), num_nodes(), self.precision,
                                      torch.cuda.get_device_properties(self._device).total_memory, inputs)
        if plan is not None:
            self.detected["plan"] = plan
        if plan and plan["fits"] is False and process_rank() == 0:
            logger.warning("shardscope plan for this run: %s", plan["warning"])

    # --- Helpers -----------------------------------------------------------------------------------------------
    def _begin(self, sampled: bool = True):
        """Start the next step's instruments (and, on the memory step, the tensor tracker; on the sampled steps,
        the collective counter and the timer, unless `sampled` is False: then at the next begin_step)."""
        upcoming = self.global_step + 1
        self._sampled_due = True
        if self.instruments:
            self._instruments("start", upcoming)
        if self.memory_step is not None and upcoming == self.memory_step and self._memory.ok:
            with self._memory:
                self._step_peak = StepPeak(self._module, self.optimizer, self._memory, self.model).__enter__()
        if sampled:  # after the tracker: dispatch modes leave in reverse order (the counter first, in step())
            self._begin_sampled()

    def _end_step_peak(self, keep: bool) -> None:
        """Stop the memory step's tracker (also after its instrument failed: its dispatch mode must leave)."""
        peak, self._step_peak = self._step_peak, None
        if peak is not None:
            with self._memory:
                peak.__exit__(None, None, None)
                if keep and self._memory.ok:
                    self.step_peak = peak.result()

    def _begin_sampled(self):
        if self._sampled_due and not self._closed:
            self._sampled_due = False
            self._sampled.begin(self.global_step + 1, self.last_step, self._module, self.optimizer)

    def _instruments(self, method: str, *args) -> dict:
        """Call `method` on every instrument, each guarded; {name: what it returned}."""
        out = {}
        for instrument in self.instruments:
            name = getattr(instrument, "name", type(instrument).__name__)
            with self.guard(f"instrument {name}"):
                out[name] = getattr(instrument, method)(*args)
        return out

    def _windows(self, method, *args, **kwargs):  # both windows: this interval's and the whole run's
        if method == "step_end" and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)  # kernels are async: close the window on real time
        getattr(self._interval, method)(*args, **kwargs)
        getattr(self._run, method)(*args, **kwargs)
        if self._gpu is not None and self._gpu_compute.ok and method != "add_batch":
            with self._gpu_compute:  # the step's CUDA events (no synchronisation of its own)
                getattr(self._gpu, method)(*args, **kwargs)

    def _gpu_seconds(self, summary: bool) -> float | None:
        """A CUDA rank's compute seconds over the interval (or the run, `summary`) read so far; None without."""
        with self._gpu_compute:
            if self._gpu is not None and self._gpu_compute.ok:
                self._gpu.collect(settle_s=1.0 if summary else 0.0)
                return self._gpu.run if summary else self._gpu.interval
        return None

    def _is_measure_step(self, step: int) -> bool:
        return self.every_n_steps is not None and step > 0 and step % self.every_n_steps == 0

    def _summary(self, ranks: list[dict], instruments: list[dict]) -> dict:
        device = torch.cuda.get_device_name(self._device) if self._device.type == "cuda" else self._device.type
        precision = self._precision_ranks or [{}] * len(ranks)
        return {
            "shardscope_version": __version__,
            "strategy": self.detected.get("strategy"),
            "strategy_detail": {k: v for k, v in self.detected.items()
                                if k not in ("strategy", "world_size", "plan", "mesh")},
            "mesh": self.detected.get("mesh"),
            "preflight_plan": self.detected.get("plan"),
            **self.summary_extra,
            "world_size": self.detected.get("world_size", len(ranks)),
            "num_nodes": num_nodes(),
            "model": self.model_facts,
            "frozen_models": {name: {"params_total": fm.total_params} for name, fm in self._frozen_flops.items()},
            "device": device,
            "precision": self.precision,
            "precision_verdict": run_verdict(self._precision_ranks),
            "global_step": self.global_step,
            "state_locations": self.locations,
            "straggler": straggler(ranks, self._windows_compute),
            "link_probe": self._link_probe,
            "memory_details_rank0": self.memory,
            "ranks": [{"rank": i, **r, "memory_kind": memory_kind(self._device, self.memory, r), **(extra or {}),
                       **{k: v for k, v in p.items() if k != "precision_verdict"}}
                      for i, (r, p, extra) in enumerate(zip(ranks, precision, instruments))],
        }

    def guard(self, what: str) -> Guard:
        """Measuring never stops training: a failure inside is warned about once and left out."""
        guard = self._guards.get(what)
        return guard if guard is not None else self._guards.setdefault(what, Guard(self.warn_once, what))

