"""What the profiler samples when: the hooks it puts into the loop, and the state of the step they mark.

`StepState` is where the run stands between two optimizer steps (the step's counts, the gradient snapshot, the
memory step's tracker and result, what is due). `StepHooks` owns it and is built from its collaborators: the models
(`Models`), how a batch is counted (`step_counts.Counting`), which steps measure (`Schedule`), the steps' clocks
(`step_clock.StepClock`), the sampled steps (`sampled_steps.SampledSteps`), the profiler's instruments and guards
and the caller's instruments (guard.py), the run's facts (`run_facts.RunFacts`, where the live-run plan is kept) and
the planner's `plan_for_live_run` (injected from above measure/; None: none).

Forward pre-hooks tell training forwards from those that do not train and count them (samples, tokens, FLOPs), an
optimizer step pre-hook snapshots the gradients (on the first step, the measuring steps and the last), the step's
time is anchored on the clock, and the instrumented steps are begun and ended: the memory step's tensor tracker
(`peak.StepPeak`) and the sampled steps' counter and timer. Every hook goes in through an instrument (guard.py).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .state_bytes import base_optimizer, gradient_bytes, held_gradients, state_walk, zero_optimizer
from ..strategy import num_nodes
from .guard import CallerInstruments, Guards, Instruments, MethodWrap
from .peak import StepPeak
from .rank_gather import process_rank
from .run_facts import RunFacts
from .sampled_steps import SampledSteps
from .step_clock import StepClock
from .step_counts import Counting, StepCounts, count_batch, first_adapter_layer
from .step_log import StepLog
from .throughput import batch_counts

logger = logging.getLogger("shardscope")


@dataclass
class Models:
    """What is measured: the model as the loop runs it (`wrapper`: DDP's reducer buckets are read from it), the module
    counted inside it (`detect.visible_module`), its optimizer, and the frozen models held beside it {name: module}."""

    wrapper: Any
    module: Any
    optimizer: Any
    frozen: dict = field(default_factory=dict)

    def release(self) -> None:
        """Keep no reference to the models or the optimizer (the profiler's end)."""
        self.wrapper = self.module = self.optimizer = None
        self.frozen = {}


@dataclass(frozen=True)
class Schedule:
    """Which optimizer steps measure: every `every_n_steps`-th (the logs' measurement; None: none), the memory step
    (its tensor tracker; None: none), and the last one (`last_step`, when known: its gradients are snapshotted)."""

    every_n_steps: int | None
    memory_step: int | None
    last_step: int | None

    def measures(self, step: int) -> bool:
        return self.every_n_steps is not None and step > 0 and step % self.every_n_steps == 0


@dataclass
class StepState:
    """Where the run stands between two optimizer steps."""

    global_step: int = 0  # optimizer steps taken (a resumed Trainer run starts past 0)
    counts: StepCounts = field(default_factory=StepCounts)  # the step's samples, tokens and FLOPs so far
    grad_bytes: int | None = None  # the gradients' bytes at the last snapshot (None: none taken yet)
    walks: dict = field(default_factory=dict)  # {step: its snapshot's state walk}, reused by its measurement
    memory_tracker: StepPeak | None = None  # the memory step's tensor tracker while that step runs
    memory_step_peak: dict = field(default_factory=dict)  # the largest peak the tracker measured (step_log.py)
    steps: StepLog = field(default_factory=StepLog)  # each step's real and padded tokens, the measured steps' peaks
    sampled_due: bool = True  # the sampled steps' instruments are still to begin for the upcoming step
    plan_due: bool = False  # the live-run plan is still to be made, at the first training forward
    closed: bool = False  # the profiler closed: nothing more is measured


class StepHooks:
    """The hooks and step marks of the profiler (see the module docstring); `state`: its `StepState`."""

    def __init__(self, models: Models, counting: Counting, schedule: Schedule, clock: StepClock,
                 sampled: SampledSteps, instruments: Instruments, guards: Guards, caller: CallerInstruments,
                 facts: RunFacts, plan_for_live_run: Callable | None, start_step: int = 0):
        self.models, self.counting, self.schedule, self.clock, self.sampled = models, counting, schedule, clock, sampled
        self.instruments, self.guards, self.caller, self.facts = instruments, guards, caller, facts
        self.plan_for_live_run = plan_for_live_run
        self.state = StepState(global_step=start_step, plan_due=facts.device.type == "cuda" and bool(plan_for_live_run))
        self.adapter_layer = None  # a PEFT adapter layer (whether adapters are off in a forward), or None

    def install(self) -> None:
        """Forward hooks tell training forwards from those that do not train; a step hook snapshots gradients."""
        throughput, module = self.instruments.throughput, self.models.module
        with throughput:
            throughput.hook(module.register_forward_pre_hook, self.on_forward, with_kwargs=True)
            for name, frozen in self.models.frozen.items():
                throughput.hook(frozen.register_forward_pre_hook, functools.partial(self.on_frozen_forward, name),
                                with_kwargs=True)
            self.adapter_layer = first_adapter_layer(module)
        with self.instruments.state_bytes:
            optimizer = self.models.optimizer
            zero, base = zero_optimizer(optimizer), base_optimizer(optimizer)
            if zero is not None:  # DeepSpeed ZeRO optimizers have no step hooks: wrap this instance's step
                MethodWrap(self.instruments.state_bytes, zero, "step", self.snapshot_gradients)
            elif base is not None:
                self.instruments.state_bytes.hook(base.register_step_pre_hook, self.snapshot_gradients)

    def snapshot_gradients(self, *_) -> None:
        """On the first step, the steps that measure and the last one (when known): the gradients' bytes, read
        before the optimizer frees or moves them (the step's measurement reuses the walk)."""
        state, upcoming = self.state, self.state.global_step + 1
        measuring = self.schedule.measures(upcoming) or upcoming == self.schedule.last_step
        if state.grad_bytes is None or measuring:
            walk = state_walk(self.models.module, self.models.optimizer)
            state.grad_bytes = gradient_bytes(held_gradients(self.models.module, self.models.optimizer, walk))
            state.walks = {upcoming: walk} if measuring else {}

    @property
    def instrumented(self) -> bool:
        """This step runs an instrument that slows it (the memory step's tracker, a sampled step's): not throughput."""
        return self.state.memory_tracker is not None or self.sampled.active

    def add_batch(self, batch, samples: int | None = None) -> None:
        """Count one micro-batch the loop hands over (`samples`: the loop's own count of its rows)."""
        with self.guards("batch counting"):
            try:
                counted, tokens, seq_len = count_batch(batch, self.counting.patch_size)
            except TypeError as error:  # rows not yet collated (GRPO hands its prompts over): count the forwards
                self.guards.warn("uncountable batch", f"{error}: samples, tokens and FLOPs are counted from the "
                                 "training forwards instead", note=True)
                return
            self.measure_if_record(counted, seq_len)
            self.state.steps.add(tokens, counted, seq_len)
            if tokens is None:
                self.guards.warn("no tokens", "the batch has no input_ids (images, audio?): samples are counted "
                                 "from its first dimension, tokens and FLOP/s are left out", note=True)
            self.state.counts.add_batch(*self.counting.training(counted if samples is None else samples, tokens,
                                                                seq_len))

    def measure_if_record(self, rows: int, seq_len: int) -> None:
        """Past the memory step, start the tensor tracker on a step whose first micro-batch (given before any forward
        of the step: the callback's batch feed) has more padded tokens than every step measured (step_log.py), unless
        a sampled instrument runs or no plain step has been counted yet (the run's throughput keeps one)."""
        state, memory, upcoming = self.state, self.instruments.memory, self.state.global_step + 1
        if (self.schedule.memory_step is None or upcoming <= self.schedule.memory_step or not memory.ok
                or not self.clock.run.durations  # throughput keeps a plain step: none counted yet, none measured
                or state.memory_tracker is not None or state.steps.step_first_padded is not None or state.steps.forwarded
                or self.sampled.active or (state.sampled_due and self.sampled.carries(upcoming, self.schedule.last_step))
                or not state.steps.record(rows * seq_len)):
            return
        with memory:
            models = self.models
            state.memory_tracker = StepPeak(models.module, models.optimizer, memory, models.wrapper).__enter__()

    def on_forward(self, module, args, kwargs) -> None:
        if not module.training:  # evaluation
            return
        state = self.state
        state.steps.forwarded = True  # a tracker started after this would miss the step (measure_if_record)
        if self.instrumented:  # an instrumented step is not throughput
            if self.sampled.active and torch.is_grad_enabled():  # the counted step's padded tokens
                with self.guards("batch counting"):
                    samples, _, seq_len = batch_counts(args, kwargs)
                    self.sampled.add_batch(samples, seq_len)
            return
        if state.plan_due and torch.is_grad_enabled():
            state.plan_due = False
            with self.guards("plan for the live run"):
                self.plan_live_run({"input_ids": args[0], **kwargs} if args else kwargs)
            self.clock.mark("restart")  # the plan's seconds are not the step's
        if state.sampled_due:  # deferred by a pause: starts before the first training forward at the latest
            self.begin_sampled()
        with self.guards("batch counting"):
            adapters_off = self.adapter_layer is not None and self.adapter_layer.disable_adapters
            training = torch.is_grad_enabled() and not adapters_off
            if training:
                if self.clock.run.anchor is None:  # (begin_step anchored it, most often)
                    self.clock.mark("step_begin")  # the first training forward anchors the step's time
                if state.counts.given:  # the loop hands its batches over (the callback does): nothing to count
                    return
            samples, tokens, seq_len = batch_counts(args, kwargs, self.counting.patch_size)  # (the trained module)
            if training:
                state.counts.saw_training(*self.counting.training(samples, tokens, seq_len))
            else:  # a reference / generation pass of the trained model
                state.counts.inference_flops += self.counting.forward_flops(tokens, seq_len) or 0.0

    def on_frozen_forward(self, name, module, args, kwargs) -> None:
        if not self.models.module.training or self.instrumented:
            return
        with self.guards("batch counting"):
            _, tokens, seq_len = batch_counts(args, kwargs, self.counting.frozen_patch_sizes.get(name))
            self.state.counts.inference_flops += self.counting.forward_flops(tokens, seq_len, frozen=name) or 0.0

    def plan_live_run(self, inputs: dict) -> None:
        """Warn (rank 0) when the planner's peak for this run at the first training batch's shape does not fit this
        GPU (`plan_for_live_run`, traced as `fit` traces). Kept as the run's `live_plan` (the summary's)."""
        facts = self.facts
        plan = self.plan_for_live_run(self.models.module, facts.strategy, facts.mesh, facts.world_size, num_nodes(),
                                      facts.configured_precision, torch.cuda.get_device_properties(facts.device).total_memory,
                                      inputs)
        if plan is not None:
            facts.live_plan = plan
        if plan and plan["fits"] is False and process_rank() == 0:
            logger.warning("shardscope plan for this run: %s", plan["warning"])

    def begin_step(self) -> None:
        """Where a step's time starts (by default at its first training forward, or where the previous step ended)."""
        if self.clock.run.anchor is None:  # (the previous step's end anchored it unless it paused)
            with self.guards("throughput"):
                self.clock.mark("step_begin")
        if self.state.sampled_due:
            self.begin_sampled()

    def begin(self, sampled: bool = True) -> None:
        """Start the next step's instruments (and, on the memory step, the tensor tracker; on the sampled steps,
        the collective counter and the timer, unless `sampled` is False: then at the next begin_step)."""
        upcoming, memory = self.state.global_step + 1, self.instruments.memory
        self.state.sampled_due = True
        self.caller.call("start", upcoming)
        if upcoming == self.schedule.memory_step and memory.ok:
            with memory:
                models = self.models
                self.state.memory_tracker = StepPeak(models.module, models.optimizer, memory, models.wrapper).__enter__()
        if sampled:  # after the tracker: dispatch modes leave in reverse order (the counter first, in end())
            self.begin_sampled()

    def begin_sampled(self) -> None:
        if self.state.sampled_due and not self.state.closed:
            self.state.sampled_due = False
            self.sampled.begin(self.state.global_step + 1, self.schedule.last_step, self.models.module,
                               self.models.optimizer)

    def end(self) -> bool:
        """The step's end: its instruments stopped; True when it was instrumented (left out of throughput)."""
        instrumented = self.sampled.active and self.sampled.end() or self.state.memory_tracker is not None
        peak = self.end_memory_step(keep=True) if instrumented else None
        with self.guards("batch counting"):
            self.state.steps.close(self.state.global_step + 1, peak)
        self.caller.call("stop", self.state.global_step + 1)
        self.instruments.remove(failed_only=True)  # a failed instrument's hooks come out here, outside them
        return instrumented

    def end_memory_step(self, keep: bool) -> dict | None:
        """Stop the memory step's tracker (also after its instrument failed: its dispatch mode must leave); its
        result (None: none kept). The largest peak measured is the run's `memory_step_peak`."""
        tracker, self.state.memory_tracker = self.state.memory_tracker, None
        memory = self.instruments.memory
        if tracker is not None:
            with memory:
                tracker.__exit__(None, None, None)
                if keep and memory.ok:
                    result = tracker.result()
                    if result["peak_tensor_bytes"] >= self.state.memory_step_peak.get("peak_tensor_bytes", 0):
                        self.state.memory_step_peak = result
                    return result
        return None

    def close(self) -> None:
        """Nothing more measured: a step begun and never closed is dropped."""
        self.state.closed = True
        self.sampled.end(keep=False)  # a timer started for a step that never ran
        self.end_memory_step(keep=False)
        self.adapter_layer = None
