"""`ShardingProfiler`: what a distributed strategy really does, measured on every rank of any training loop.

One owner for when and what to measure: model-state bytes (`state_bytes`), frozen models held beside the
trained one, throughput (`throughput`), memory (`memory`, `peak`), precision (`precision`), the cross-rank
gather and the summary file (`summary`). The Trainer callback (`callback.py`) only maps Trainer events onto it.

Here: the loop's calls (`step`, `logged`, `close`, ...), the set-up and each measurement (this rank's readings, the
gather started). By concern, the rest: what is sampled when and the hooks inside the user's step, with the step's
state (`step_hooks.py`); the steps' clocks (`step_clock.py`); the per-rank metrics, each read, gathered, reduced and
written by one row of one table (`metrics.py`); the run's facts (`run_facts.py`) and the summary file's contents
(`run_summary.py`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import torch

from . import metrics, run_summary
from .collective_timing import probe_links, probe_size
from .detect import live_strategy, visible_module, zero_buckets
from .guard import CallerInstruments, Guards, Instrument, Instruments, WarnOnce, never_raises, validate_arguments
from .memory import device_of, read_memory, reset_peak
from .precision import PrecisionWatch, classify, effective_precision, gather_reports
from .rank_gather import Gathered, gather_objects, process_rank, route, start_gather
from .run_facts import RunFacts
from .sampled_steps import SampledSteps  # issue 21
from .step_clock import StepClock
from .step_counts import Counting, counting_of, model_facts, unwrap
from .step_hooks import Models, Schedule, StepHooks
from .stragglers import Windows, line as straggler_line
from .throughput import FlopsModel, device_peak_flops
from .watchdog import Watchdog
from .state_bytes import count_state, forget
from .expert_load import expert_load_instruments
from ..summary import SUMMARY_FILE, write_summary

logger = logging.getLogger("shardscope")


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

    Logged keys (bytes per rank; README's "The profiling callback" says what each means; each a row of
    `metrics.METRICS`): across ranks
    `shardscope/{params,grads,optimizer,frozen_models,peak_memory,peak_tensor}_bytes_{min,max,mean}`,
    `shardscope/{tokens_per_s_per_device,tflops_per_device,mfu,compute_share}_{min,max,mean}`, the last step's
    `shardscope/{step_tokens,step_padded_tokens}_{min,max,mean}` (`step_log.py`); over all data-parallel
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
    `step_seconds` {median, p10, p90, steps} over the throughput window's optimizer steps; top
    level `straggler` (`stragglers.py`: the timed step's `busiest_rank` beside the verdict's `straggler_rank`, from
    compute time beside wall time, `throughput` {compute_seconds, compute_share}); on a GPU top level `live_plan`.
    Instrumented steps are left out of throughput. `hang_after` (seconds, "auto" or None): a step past it makes every
    rank write its record into `output_dir/shardscope_hang/` and rank 0 log the verdict (`watchdog.py`).

    Counting: a sample is a row of the batch (`samples=` overrides it: the callback passes the Trainer's count);
    tokens are the non-padding tokens of the step's training inputs, once; forwards that do not train (frozen
    models, no_grad or adapter-disabled passes) add FLOPs only. Without a batch, the training forwards seen count.
    A TP group is one data-parallel replica (global rates count it once).

    `instruments=[...]`: objects with `name`, `start(step)` (before step `step` runs), `stop(step)` (in `step()`)
    and `result()` (JSON, gathered from every rank at `close()` into each rank's summary); each call guarded.

    Its parts: `facts` (`run_facts.RunFacts`: what the summary says of the run; `detected` is `facts.detected`),
    `hooks` (`step_hooks.StepHooks`, what runs inside the user's step, and its `state`), `clock`, `sampled`,
    `instruments` (its own, guard.py) and `watchdog`.
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
        self.accelerator, self.output_dir, self.summary_file = accelerator, Path(output_dir), summary_file
        self.warn_once = WarnOnce()
        self.guards = Guards(self.warn_once)
        self.models, self.facts = self._detect(model, optimizer, frozen_models or {}, precision)
        self.facts.extra = dict(summary_extra or {})  # top-level summary keys the caller owns (the callback's fit)
        device = self.facts.device
        self.instruments = Instruments(self.warn_once, cuda=device.type == "cuda")
        self.clock = StepClock(device, self.instruments.gpu_compute)  # the steps' times (cuda_compute on a CUDA rank)
        self.sampled = SampledSteps(comm_step, time_step, time_every_n_steps, device, self.warn_once)
        for instrument in self.sampled.instruments:
            self.instruments.add(instrument)
        # where each metric source is read and written (metrics.py): a guard of its own, or its instrument
        self.source_guards = {"state": self.guards("model-state bytes"), "frozen": self.guards("frozen model bytes"),
                              "memory": self.guards("peak memory"), "memory_step": self.instruments.memory,
                              "window": self.guards("throughput"), "comm": self.sampled.collectives,
                              "timed": self.sampled.timing, "steps": self.guards("token log")}
        forget(self.models.module)  # state_bytes caches the module walk per model: a new run walks it afresh
        self.counting = self._describe(flops_model)
        self.schedule = Schedule(every_n_steps, memory_step, last_step)  # last_step: when known (max_steps)
        moe = ()
        with self.guards("expert load"):  # a mixture of experts: tokens per expert per layer and step
            moe = expert_load_instruments(self.models.module, self.instruments)
        self.caller = CallerInstruments((*instruments, *moe), self.guards)
        self.hooks = StepHooks(self.models, self.counting, self.schedule, self.clock, self.sampled, self.instruments,
                               self.guards, self.caller, self.facts, self.plan_for_live_run, start_step)
        self.hooks.install()
        self.precision_watch = None  # (precision.py)
        with self.instruments.precision:
            self._watch_precision()
        with self.guards("device peak FLOP/s"):
            self.facts.peak_flops = device_peak_flops(peak_tflops, device, self.facts.configured_precision)
        if process_rank() == 0:
            with self.guards("detected strategy log"):
                logger.warning("shardscope detected: %s", json.dumps({**self.facts.detected, **self.facts.model}))
        self._pending, self._route = None, None  # a measurement whose gather step(defer=True) started; its route
        self.compute_windows = Windows()  # each logged window's compute seconds per rank (stragglers.py)
        if not self.instruments.throughput.ok:  # no forward to anchor the first step's time on: start the clock now
            self.clock.mark("step_begin")
        self.hooks.begin()
        self.watchdog = Watchdog(output_dir, hang_after, self.instrument("watchdog"), self).start()  # hang records

    @property
    def detected(self) -> dict:
        """What the strategy was read from (strategy, world size, mesh, ZeRO's buckets, ...): `facts.detected`."""
        return self.facts.detected

    # --- The loop's calls --------------------------------------------------------------------------------------
    @never_raises()
    def begin_step(self) -> None:
        """Optional: where a step's time starts (by default at its first training forward, or where the previous
        `step()` returned); the Trainer callback calls it at each step begin."""
        self.hooks.begin_step()

    @never_raises()
    def add_batch(self, batch, samples: int | None = None) -> None:
        """Count one micro-batch as it is fed (loops that accumulate gradients may call this per micro-batch and
        `step()` without a batch); `samples` overrides the rows counted from the batch."""
        self.hooks.add_batch(batch, samples)

    @never_raises(default=dict)
    def step(self, batch=None, tokens=None, samples=None, *, pause: bool = False, defer: bool = False) -> dict:
        """Close one optimizer step (call it after `optimizer.step()`). `batch`: the dict fed to the model or a list of
        the step's micro-batches; `tokens=` / `samples=` (ints) override what is counted from it. `pause=True` leaves
        the time until the next `begin_step()` or training forward out (evaluation, checkpointing). Returns the metrics
        measured at this step ({} if none); `defer=True` leaves their gather running (`logged()` returns them)."""
        state = self.hooks.state
        if state.closed:
            self.warn_once("closed", "step() after close(): nothing more is measured")
            return {}
        metrics_now = {} if self._pending is None else self.logged()  # a deferred measurement not collected since
        for micro in (batch if isinstance(batch, list) else [] if batch is None else [batch]):
            self.add_batch(micro)
        instrumented = self.hooks.end()
        with self.guards("throughput"):
            counted = state.counts.close(samples, tokens, self.counting)
            if not instrumented:
                self.clock.mark("add_batch", *counted)
            self.clock.mark("step_end", pause_after=pause, count=not instrumented)
        state.global_step += 1
        self.watchdog.step_done(state.global_step, pause)
        if self.schedule.measures(state.global_step):
            self._measure_and_log()
            metrics_now.update({} if defer else self.logged())
        self.hooks.begin(sampled=not pause)  # after evaluation or a save: at the next begin_step (or training forward)
        return metrics_now

    @never_raises(default=dict)
    def logged(self) -> dict:
        """The metrics of a measurement `step(defer=True)` left pending ({} when none), its gather awaited; also sent
        through `accelerator.log` when an accelerator is given."""
        pending, self._pending, logged = self._pending, None, {}
        with self.guards("metric logging"):
            if pending is not None:
                logged = metrics.log_metrics(self._written(pending, summary=False), self.counting.tp)
                self.compute_windows.add(pending.ranks or [])  # (gathered above) per rank: compute_seconds
            if self.accelerator is not None and logged:
                self.accelerator.log(logged, step=pending.step)
        return logged

    @never_raises()
    def close(self) -> Path | None:
        """Measure the whole run on every rank (collectives: call it on every rank) and write the summary on
        rank 0; returns its path there. A second call does nothing."""
        if self.hooks.state.closed:
            return None
        self.logged()  # a measurement's gather still pending: completed on every rank before the next collective
        self.hooks.close()  # a step begun and never closed is not measured
        figures, link_probe, precision_ranks = self._written(self._measure_rank(summary=True)), None, []
        with self.guards("link probe"):  # collectives on every rank (all have the same summary_file), for the summary
            link_probe = probe_links(probe_size(figures), self.facts.device) if self.summary_file else None
        with self.guards("precision"):  # one collective, reached on every rank
            precision_ranks = gather_reports(self.precision_watch)
        results, statuses = [{}] * len(figures), [self._statuses()] * len(figures)
        with self.guards("instruments"):  # one collective: every rank's instrument statuses and results
            gathered = gather_objects({"status": self._statuses(), "results": self.caller.call("result")})
            results, statuses = [g["results"] for g in gathered], [g["status"] for g in gathered]
        self._release()
        if process_rank() != 0 or not self.summary_file:
            return None
        with self.guards("summary file"):
            end = run_summary.RunEnd(self.hooks.state.global_step, figures, precision_ranks, results, statuses,
                                     self.compute_windows, link_probe)
            summary = run_summary.contents(self.facts, end)
            path = write_summary(self.output_dir / self.summary_file, summary)
            straggler = straggler_line(summary["straggler"])
            logger.warning("shardscope summary written to %s%s", path, f"; {straggler}" if straggler else "")
            return path
        return None

    def __enter__(self) -> "ShardingProfiler":
        return self

    def __exit__(self, kind, error, _tb) -> None:  # also on an exception in the loop: what was measured is written
        if error is not None:
            self.watchdog.failed(error)
        self.close()

    # --- Instruments -------------------------------------------------------------------------------------------
    def _release(self):
        """Leave nothing behind that a run without the profiler would not have: every hook, wrapped method and
        dispatch mode out, no reference to the model, the optimizer, their tensors or the process group."""
        self.watchdog.stop()
        self.instruments.remove()
        self.models.release()
        self.accelerator = self.precision_watch = self._route = None
        self.hooks.state.grad_bytes, self.hooks.state.walks = None, {}

    def instrument(self, name: str) -> Instrument:
        """A new instrument for what the loop's adapter installs (warned, reported and removed as the profiler's)."""
        return self.instruments.add(name)

    def _statuses(self) -> dict:
        """{instrument: "ok" or why it stopped} on this rank (memory: why the memory step was not measured)."""
        out = self.instruments.statuses()
        if self.schedule.memory_step is None:
            out["memory"] = "off (memory_step=None)"
        return out

    # --- Measuring ---------------------------------------------------------------------------------------------
    def _measure_and_log(self) -> None:
        self._pending = self._measure_rank(summary=False)  # guarded inside, collective; logged() completes it
        with self.guards("throughput"):
            self.clock.reset_interval()
        with self.guards("peak memory"):
            reset_peak(self.facts.device)

    def _written(self, gathered: Gathered, summary: bool = True) -> list[dict]:
        """Every rank's figures as the metric table writes them, once the exchange completes (this rank's alone
        where it failed)."""
        ranks = [gathered.local]
        with self.guards("cross-rank gather"):
            ranks = gathered.result()
        return [metrics.written(rank, self.facts, self.source_guards, summary) for rank in ranks]

    def _measure_rank(self, summary: bool) -> Gathered:
        """This rank's figures over the run (`summary`) or the logging interval, the exchange with every rank started
        (a collective: called on all ranks)."""
        step = self.hooks.state.global_step
        mine = metrics.read(self._read(summary), self.source_guards, tuple(self.models.frozen), summary)
        with self.guards("cross-rank gather"):
            self._route = route(self.facts.device, self._route)
            return start_gather(mine, step, self._route, tuple(mine))
        return Gathered(mine, step, ranks=[mine])

    def _read(self, summary: bool) -> metrics.Readings:
        """This rank's readings of each metric source (metrics.py), each under its guard (None where it failed)."""
        state, models, guard, facts = self.hooks.state, self.models, self.source_guards, self.facts
        readings = metrics.Readings(cuda=facts.device.type == "cuda", memory={}, comm=self.sampled.comm,
                                    timed=self.sampled.timed, steps=state.steps)
        with guard["state"]:
            walk = None if summary else state.walks.pop(state.global_step, None)  # this step's snapshot's walk
            readings.state = count_state(models.module, models.optimizer, grad_bytes=state.grad_bytes, walk=walk)
            if summary:
                facts.state_locations = {c: sorted(readings.state.by_device[c]) for c in ("params", "grads", "optimizer")}
        with guard["frozen"]:
            readings.frozen = {name: count_state(module).total("params") for name, module in models.frozen.items()}
        with guard["memory"]:
            if summary or readings.cuda:  # RSS is for the summary only
                readings.memory = facts.memory_reading = read_memory(facts.device)
        if state.memory_step_peak and self.instruments.memory.ok:
            readings.memory_step = state.memory_step_peak
        with guard["window"]:
            window = self.clock.run if summary else self.clock.interval
            readings.window = dataclasses.replace(window.totals(), compute=self.clock.compute_seconds(summary))
            readings.durations = window.durations if summary else None  # (the logs do not read the step times)
        return readings

    # --- Set-up ------------------------------------------------------------------------------------------------
    def _detect(self, model, optimizer, frozen: dict, precision: str | None) -> tuple[Models, RunFacts]:
        """The models measured and what is read of them before the run: its strategy, its device."""
        models, detected, device = Models(model, model, optimizer), {}, torch.device("cpu")
        with self.guards("strategy"):
            models.module = visible_module(model)
            detected.update(live_strategy(model, models.module, self.warn_once), **zero_buckets(optimizer))
        with self.guards("frozen models"):
            models.frozen = {str(name): unwrap(m) for name, m in frozen.items()}
        with self.guards("device"):
            device = device_of(self.accelerator, models.module)
        return models, RunFacts(detected, device, precision)

    def _describe(self, flops_model: FlopsModel | None) -> Counting:
        """How a batch is counted (FLOPs, patch sizes, the split), and the models' facts for the summary."""
        counting = Counting(flops_model, tp=self.facts.split[0], sp=self.facts.split[1])
        with self.guards("parameter counts"):
            counting = counting_of(self.models.module, self.models.frozen, flops_model, self.facts.split)
            self.facts.model = model_facts(self.models.module, counting.flops_model)
            self.facts.frozen_params = {name: fm.total_params for name, fm in counting.frozen_flops.items()}
        return counting

    def _watch_precision(self):
        """The configured precision: given, else the accelerator's, else what the tensors are at the start."""
        facts, models, accelerator = self.facts, self.models, self.accelerator
        if facts.configured_precision is None and accelerator is not None:
            facts.configured_precision = {"no": "fp32"}.get(str(accelerator.mixed_precision), accelerator.mixed_precision)
        if facts.configured_precision is None:
            facts.configured_precision = effective_precision(classify(models.module, models.optimizer)).split("-")[0]
        configured = facts.configured_precision
        flags = SimpleNamespace(bf16=configured == "bf16", fp16=configured == "fp16")
        self.precision_watch = PrecisionWatch(models.module, models.optimizer, flags, facts.strategy,
                                              self.instruments.precision)
        if process_rank() == 0:
            logger.warning("shardscope precision: %s", json.dumps(self.precision_watch.report()))
