"""`ShardingProfilerCallback`: `ShardingProfiler` driven by the Trainer's events.

A thin adapter: counting, throughput, memory and the summary all live in `profiler.py`. This module maps
Trainer events onto profiler calls, finds the models the trainer holds besides the trained one (TRL's
reference, reward, value, teacher models), feeds the profiler each training micro-batch with the Trainer's own
sample count, and puts the metrics into the Trainer's logs (so every `report_to` backend gets them).
"""
from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import DefaultFlowCallback

from . import parity_record
from .guard import Guard, MethodWrap, WarnOnce, never_raises, unwrap_stale, validate_arguments
from .profiler import ShardingProfiler
from .step_counts import describe_flops
from ..strategy import trainer_precision
from ..summary import FIT_ATTRIBUTE, SUMMARY_FILE

# Trainer attributes holding a frozen model -> the name it has in the summary (others: the attribute's name).
FROZEN_NAMES = {"ref_model": "reference", "reward_model": "reward", "value_model": "value",
                "teacher_model": "teacher"}


def _events_never_raise(cls):
    """Each Trainer event is `never_raises`: whatever its own guards miss is warned about once."""
    for name in ("on_init_end", "on_train_begin", "on_step_begin", "on_pre_optimizer_step", "on_step_end", "on_log",
                 "on_train_end"):
        setattr(cls, name, never_raises()(getattr(cls, name)))
    return cls


@_events_never_raise
class ShardingProfilerCallback(TrainerCallback):
    """Per-rank model-state bytes, frozen models, peak memory and throughput of a Trainer run.

    Usage: `Trainer(..., callbacks=[ShardingProfilerCallback()])` (TRL's trainers included). Every
    `every_n_steps` optimizer steps (default: the Trainer's `logging_steps`) each rank measures, one
    `all_gather` collects all ranks' figures, and the next Trainer log carries them. At the end of training
    rank 0 writes `shardscope_summary.json` into `args.output_dir`. Keys, summary layout and counting
    conventions: `profiler.ShardingProfiler`. A sample is what the Trainer counts (`per_device_train_batch_size`
    rows per micro-batch: one DPO preference pair is one sample); tokens are those of the inputs the Trainer
    trains on (`training_step`), so reference and adapter-disabled passes add FLOPs, not tokens.

    Time covers whole gradient-accumulation cycles including data loading, excluding evaluation and
    checkpointing. Nothing here may stop training: a measurement that fails is warned about once.

    Args:
        every_n_steps: measure every N optimizer steps (None: the Trainer's logging interval).
        peak_tflops: dense peak TFLOP/s of one device, overriding the built-in table (for MFU).
        summary_file: file name written into `args.output_dir` (None to skip).
        memory_step: the optimizer step whose peak tensor memory is measured by category (None: none);
            the default 3 is a warm step after DDP's bucket rebuild, which allocates during step 2.
        comm_step: the optimizer step whose collectives are counted (`comm_count.py`; None: none); by default
            the memory step, so one step carries both dispatch modes.
        time_step: the optimizer step whose time is broken down (`time_breakdown.py`; None: none); by default the
            step after them (an instrumented step's time is not a plain step's).
        time_every_n_steps: also break down every N-th step (None: `time_step` only).
        hang_after: seconds a step may run before every rank writes its hang record into
            `output_dir/shardscope_hang/` and rank 0 logs which rank and collective (`watchdog.py`); "auto": 10x the
            median step, at least 120 s; None: no watchdog.
    Instrumented steps are left out of throughput.
    """

    profiler_class = ShardingProfiler  # shardscope.ShardingProfilerCallback's: with the planner's plan_for_live_run

    def __init__(self, every_n_steps: int | None = None, peak_tflops: float | None = None,
                 summary_file: str | None = SUMMARY_FILE, memory_step: int | None = 3,
                 comm_step: int | None = 3, time_step: int | None = 4, time_every_n_steps: int | None = None,
                 hang_after="auto"):
        self.sampled = dict(comm_step=comm_step, time_step=time_step, time_every_n_steps=time_every_n_steps)
        validate_arguments(every_n_steps, peak_tflops, summary_file, memory_step=memory_step, **self.sampled,
                           hang_after=hang_after)
        self.hang_after = hang_after
        self.every_n_steps, self.peak_tflops = every_n_steps, peak_tflops
        self.summary_file, self.memory_step = summary_file, memory_step
        self.profiler: ShardingProfiler | None = None
        self._flops_model, self._trainer, self._pending = None, None, {}
        self.parity: parity_record.ParityRecorder | None = None  # while `shardscope parity` runs the script
        self.warn_once = WarnOnce()

    # --- Trainer events (each also wrapped by `never_raises`) ---------------------------------------------
    def on_init_end(self, args, state, control, **kwargs):
        with self._guard("callback order"):
            self._run_before_reporters(self._find_trainer())
        with self._guard("parameter counts"):  # before any wrapping flattens or shards the parameters
            self._flops_model = describe_flops(kwargs["model"])
        if parity_record.requested():
            with self._guard("parity"):  # the reference run: the launched world's global batch
                parity_record.imitate_world(args)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        frozen, trained = {}, model
        with self._guard("frozen models"):
            self._trainer = self._find_trainer()  # (also for a callback added after the Trainer was made)
            frozen = frozen_models_of(self._trainer, model)
        with self._guard("callback order"):
            self._run_before_reporters(self._trainer)
        with self._guard("DDP wrapper"):  # the profiler reads the buckets of DDP's reducer from the wrapper
            wrapped = getattr(self._trainer, "model_wrapped", None)
            trained = wrapped if type(wrapped).__name__ == "DistributedDataParallel" and wrapped.module is model \
                else model
        memory_step = self.memory_step and min(self.memory_step, state.max_steps or self.memory_step)
        every = self.every_n_steps or max(1, int(state.logging_steps or 1))  # the Trainer keeps it as a float too
        self.profiler = self.profiler_class(
            trained, optimizer, output_dir=args.output_dir, every_n_steps=every,
            frozen_models=frozen, peak_tflops=self.peak_tflops, summary_file=self.summary_file,
            memory_step=memory_step, **self.sampled, precision=trainer_precision(args.bf16, args.fp16),
            flops_model=self._flops_model, start_step=state.global_step, last_step=state.max_steps,
            hang_after=self.hang_after,
            summary_extra={"fit": getattr(args, FIT_ATTRIBUTE, None),  # shardscope fit: fit_training
                           "gradient_accumulation_steps": args.gradient_accumulation_steps})  # what plan --against plans
        self._pending = {}
        with self._guard("sequence split"):  # each rank's log names the ranks it shares its sequences with
            split = self.profiler.detected.get("sequence_parallel")
            if split:
                logging.getLogger("shardscope").warning("shardscope sequence split (rank %d): %s", args.process_index,
                                                        json.dumps(split))
        with self._guard("batch counting"):
            self._feed_batches(args.per_device_train_batch_size)
        if parity_record.requested():
            self._start_parity(args, model)
        self.profiler.begin_step()  # the first step's time includes its data loading, as every later step's does

    def on_step_begin(self, args, state, control, **kwargs):
        self.profiler.begin_step()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.parity is not None:
            self.parity.before_optimizer()

    def on_step_end(self, args, state, control, **kwargs):
        if self.parity is not None:  # every step logged (the loss and gradient norm compared), the steps asked for
            self.parity.step_end(state.global_step)
            control.should_log = True
            last = parity_record.last_step()
            control.should_training_stop |= last is not None and state.global_step >= last
        # defer: the measuring step's gather is collected at the Trainer's log, after the Trainer's own gather has
        # brought every rank there, so the first rank to finish its step does not wait in ours
        self._pending.update(self.profiler.step(pause=control.should_evaluate or control.should_save, defer=True))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.parity is not None and logs:
            self.parity.logged(state.global_step, logs)
        if self.profiler is not None:  # (an evaluation before training logs too)
            self._pending.update(self.profiler.logged())  # every rank logs (Trainer.log runs on each)
        if self._pending and logs is not None:
            with self._guard("metric logging"):
                logs.update(self._pending)
                if state.log_history and state.log_history[-1].get("step") == state.global_step:
                    state.log_history[-1].update(self._pending)
            self._pending = {}

    def on_train_end(self, args, state, control, **kwargs):
        if self.parity is not None:
            self.parity.close()
            self.parity = None
        self.profiler.close()  # removes every instrument, the batch feed's wrapped training_step included
        self._trainer = None

    # --- Helpers ----------------------------------------------------------------------------------------------
    def _feed_batches(self, rows_per_batch: int):
        """Hand the profiler each micro-batch the Trainer trains on, counted as the Trainer counts samples."""
        if self._trainer is None:
            return  # no Trainer found: the profiler counts the training forwards it sees
        unwrap_stale(self._trainer, "training_step", "batch_feed")  # ours, left by a train() that raised
        profiler = self.profiler

        def feed(model, inputs, *args, **kwargs):
            profiler.add_batch(inputs, samples=rows_per_batch)

        MethodWrap(profiler.instrument("batch_feed"), self._trainer, "training_step", before=feed)

    def _start_parity(self, args, model):
        """The parity recorder (measure/parity_record.py), its hooks through the profiler's "parity" instrument."""
        instrument = self.profiler.instrument("parity")
        with instrument:
            facts = parity_record.run_facts(args, self._trainer, model, self.profiler.detected)
            folder = Path(args.output_dir) / parity_record.requested()
            self.parity = parity_record.ParityRecorder(folder, args.process_index, args.world_size, instrument, facts)
            self.parity.start(self._trainer, model)

    def _find_trainer(self):
        """The Trainer whose callback handler is calling this event, or None.

        Found on the call stack: the Trainer hands callbacks its model, optimizer, scheduler, processing class and
        data loaders (transformers' `CallbackHandler.call_event`), never itself or its handler. The callback needs
        the Trainer for what those do not carry: the frozen models it holds (TRL's `ref_model`, ...), DDP's wrapper
        (`model_wrapped`), the `training_step` that receives each micro-batch and the callback list to reorder.
        Only a Trainer that holds this very callback is taken (not another Trainer further up the stack).
        """
        frame = inspect.currentframe()
        while frame is not None:
            caller = frame.f_locals.get("self")
            handler = getattr(caller, "callback_handler", None) if isinstance(caller, Trainer) else None
            if self in getattr(handler, "callbacks", ()):
                return caller
            frame = frame.f_back
        return None

    def _run_before_reporters(self, trainer):
        """Move this callback ahead of the reporting callbacks, so the logs they send include our keys.

        The Trainer puts user callbacks after its reporters (TensorBoard, W&B, ...) and offers no way to insert
        one at a position (`add_callback` appends): the Trainer's public `callback_handler.callbacks` list is
        reordered in place, once per event that finds it out of order.
        """
        if trainer is None:
            self.warn_once("callback order", "could not find the Trainer's callback list; shardscope metrics "
                            "reach trainer_state.json and the summary file but not the report_to backends")
            return
        callbacks = trainer.callback_handler.callbacks
        position = 1 if callbacks and isinstance(callbacks[0], DefaultFlowCallback) else 0
        if callbacks.index(self) > position:
            callbacks.remove(self)
            callbacks.insert(position, self)

    def _guard(self, what: str) -> Guard:  # measuring must never stop training
        return Guard(self.warn_once, what)


def frozen_models_of(trainer, model) -> dict:
    """{name: module} of the models `trainer` holds as attributes besides the trained `model` (TRL's ref_model,
    reward_model, teacher_model, a list of reward models as `reward_funcs_0`, ...): torch modules, DeepSpeed
    engines included, sharing no parameter with it."""
    if trainer is None:
        return {}
    trained = {id(p) for p in model.parameters()}
    found = {}
    for attr, value in vars(trainer).items():
        name = FROZEN_NAMES.get(attr, attr.strip("_").removesuffix("_model"))
        held = enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)]
        for i, module in held:
            if not isinstance(module, torch.nn.Module) or next(iter(module.parameters()), None) is None:
                continue
            if any(id(p) in trained for p in module.parameters()):
                continue  # the trained model itself (model_wrapped, the DeepSpeed engine, ...)
            found[name if i is None else f"{name}_{i}"] = module
    return found
