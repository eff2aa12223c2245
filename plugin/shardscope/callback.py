"""`ShardingProfilerCallback`: what a distributed strategy really does, measured on every rank.

A thin adapter: counting lives in `state_bytes`, throughput maths in `throughput`, memory readers in
`memory`, strategy naming in `strategy`. This module only decides *when* to measure and where the
numbers go.
"""
from __future__ import annotations

import functools
import inspect
import json
import logging
import math
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback

from . import __version__
from .sampled_steps import RANK_FIELDS as SAMPLED_FIELDS, SampledSteps, straggler  # [issue 21]
from .memory import read_memory, reset_peak
from .peak import BREAKDOWN, PHASES, StepPeak
from .precision import PrecisionWatch, gather_reports, run_verdict
from .state_bytes import base_optimizer, count_state, forget, held_gradients, zero_optimizer
from .strategy import detect_strategy, num_nodes
from .summary import COMPONENTS, SUMMARY_FILE, reduce_ranks, write_summary
from .throughput import (FLOPS_CONVENTION, FlopsModel, ThroughputWindow, WindowTotals, batch_counts, peak_flops,
                         rates)

logger = logging.getLogger("shardscope")

PREFIX = "shardscope/"
# Per-rank figures exchanged with one all_gather per measurement (NaN = not measured on that rank).
RANK_FIELDS = ("params_bytes", "grads_bytes", "optimizer_bytes", "trainable_params_bytes",
               "params_cpu_bytes", "grads_cpu_bytes", "optimizer_cpu_bytes", "peak_memory_bytes",
               "samples", "tokens", "flops", "seconds", "cpu_peak_rss_bytes", "peak_tensor_bytes",
               *(f"peak_{part}_bytes" for part in BREAKDOWN), "peak_phase",
               *SAMPLED_FIELDS)  # [issue 21]
REDUCED = ("params_bytes", "grads_bytes", "optimizer_bytes", "peak_memory_bytes", "peak_tensor_bytes",
           "tokens_per_s", "tflops_per_device", "mfu")
WRAPPERS = ("DistributedDataParallel", "FullyShardedDataParallel", "DeepSpeedEngine")


def _never_raises(event):
    """A Trainer event that cannot stop training: whatever its own guards miss is warned about once."""
    @functools.wraps(event)
    def safe(self, *args, **kwargs):
        try:
            return event(self, *args, **kwargs)
        except Exception as error:
            self._warn_once(event.__name__, f"{event.__name__} failed: {type(error).__name__}: {error}")
        return None

    return safe


def _events_never_raise(cls):
    for name in ("on_init_end", "on_train_begin", "on_step_begin", "on_step_end", "on_log", "on_train_end"):
        setattr(cls, name, _never_raises(getattr(cls, name)))
    return cls


@_events_never_raise
class ShardingProfilerCallback(TrainerCallback):
    """Per-rank model-state bytes, peak memory and throughput, reduced across ranks.

    Usage: `Trainer(..., callbacks=[ShardingProfilerCallback()])`. Every `every_n_steps` optimizer
    steps (default: the Trainer's `logging_steps`) each rank measures, one `all_gather` collects all
    ranks' figures, and the next Trainer log carries them (so every `report_to` backend gets them).
    At the end of training rank 0 writes `shardscope_summary.json` into `args.output_dir`.

    Logged keys (`X_min`/`X_max`/`X_mean` are across ranks; bytes are per rank):

    | key | meaning |
    | --- | --- |
    | shardscope/params_bytes_{min,max,mean} | parameter storage this rank holds (local shards, padding included) |
    | shardscope/grads_bytes_{min,max,mean} | gradient storage at the optimizer step (incl. ZeRO partition buffers) |
    | shardscope/optimizer_bytes_{min,max,mean} | optimizer state incl. fp32 master copies (DeepSpeed) |
    | shardscope/peak_memory_bytes_{min,max,mean} | CUDA max allocated in the interval; on CPU the tensor peak below |
    | shardscope/peak_tensor_bytes_{min,max,mean} | peak of live tensors during the instrumented step (MemTracker) |

    Summary only, per rank: `peak_tensor_bytes`, `peak_breakdown` = {parameters, gradients, optimizer,
    activations, temporaries} at that peak, `peak_phase` (forward, backward, optimizer step), all from
    one instrumented warm step (`memory_step`, excluded from throughput; see `peak.py`), and
    `cpu_peak_rss_bytes`, the process's peak RSS: libraries included, never called peak memory.
    | shardscope/samples_per_s | samples per second over the interval, all data-parallel replicas (global) |
    | shardscope/tokens_per_s | non-padding tokens per second, all replicas (global); absent when inputs carry no tokens |
    | shardscope/tokens_per_s_per_device_{min,max,mean} | tokens per second of the replica each rank works on |
    | shardscope/tflops_per_device_{min,max,mean} | model TFLOP/s per rank, convention in `throughput.FLOPS_CONVENTION` |
    | shardscope/mfu_{min,max,mean} | TFLOP/s over the device's dense peak; absent when the peak is unknown (CPU) |

    Summary only (per rank, from `precision.py`): `dtypes` {params, grads, optimizer, master_params},
    `master_params_bytes`, `compute_dtype`; top level: `precision_verdict` {configured, effective, ok, reason}.

    Under tensor parallelism the `tp` ranks of a group all see the same batch and each does 1/tp of
    its FLOPs: a rank's tokens/s is its replica's (the honest unit: a TP group is one data-parallel
    replica), global samples/s and tokens/s count each replica once (sum over ranks / tp), and
    TFLOP/s per device is the replica's FLOPs / tp. The summary's `mesh` gives the degrees.

    Time covers whole gradient-accumulation cycles including data loading, excluding evaluation and
    checkpointing. Nothing here may stop training: a measurement that fails is warned about once
    and left out; collectives run on every rank at the same steps so no rank can hang.

    Args:
        every_n_steps: measure every N optimizer steps (None: the Trainer's logging interval).
        peak_tflops: dense peak TFLOP/s of one device, overriding the built-in table (for MFU).
        summary_file: file name written into `args.output_dir` (None to skip).
        memory_step: the optimizer step whose peak tensor memory is measured by category (None: none);
            the default 3 is a warm step after DDP's bucket rebuild, which allocates during step 2.
        comm_step: the optimizer step whose collectives are counted (`comm_count.py`; None: none); by default
            the memory step, so one step carries both dispatch modes.
        time_step: the optimizer step whose time is broken down (`step_time.py`; None: none); by default the
            step after them (an instrumented step's time is not a plain step's).
        time_every_n_steps: also break down every N-th step (None: `time_step` only).
    Summary only, per rank (issue 21): `comm` {kind: {calls, bytes, sent_bytes}}, `comm_sent_bytes_per_step`
    and `comm_padded_tokens` on `comm_step`; `time_breakdown` {forward_s, backward_s, optimizer_s, comm_s,
    exposed_comm_s, data_wait_s, other_s, step_s, timed_steps}; top level: `straggler`.
    Instrumented steps are left out of throughput.
    """

    def __init__(self, every_n_steps: int | None = None, peak_tflops: float | None = None,
                 summary_file: str | None = SUMMARY_FILE, memory_step: int | None = 3,
                 comm_step: int | None = 3, time_step: int | None = 4, time_every_n_steps: int | None = None):
        for name, value in (("every_n_steps", every_n_steps), ("memory_step", memory_step), ("comm_step", comm_step),
                            ("time_step", time_step), ("time_every_n_steps", time_every_n_steps)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if peak_tflops is not None and (not isinstance(peak_tflops, (int, float)) or isinstance(peak_tflops, bool)
                                        or not 0 < peak_tflops < math.inf):
            raise ValueError(f"peak_tflops must be a positive number of TFLOP/s or None, got {peak_tflops!r}")
        if summary_file is not None and (not isinstance(summary_file, str) or not summary_file.strip()):
            raise ValueError(f"summary_file must be a file name or None, got {summary_file!r}")
        self.memory_step = memory_step
        self.comm_step, self.time_step, self.time_every_n_steps = comm_step, time_step, time_every_n_steps  # [issue 21]
        self.every_n_steps = every_n_steps
        self.peak_tflops = peak_tflops
        self.summary_file = summary_file
        self._warned: set[str] = set()
        self._hooks: list = []
        self._reset()

    # --- Trainer events (each also wrapped by `_never_raises`) --------------------------------------
    def on_init_end(self, args, state, control, **kwargs):
        with self._guard("callback order"):
            self._run_before_reporters()
        with self._guard("parameter counts"):
            self._flops_model = _flops_model(kwargs["model"])

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._reset()
        with self._guard("callback order"):
            self._run_before_reporters()
        with self._guard("device"):
            self._device = self._sampled.device = torch.device(args.device)  # [issue 21] the timer's too
        with self._guard("strategy"):
            self.preflight.update(detect_strategy(_unwrap(model)))
        forget(model)  # [issue 21] state_bytes caches the module walk per model: a new run walks it afresh
        with self._guard("parameter counts"):
            if self._flops_model is None:
                self._flops_model = _flops_model(model)
            self.model_facts = {"name_or_path": getattr(_unwrap(model).config, "_name_or_path", None),
                                "params_total": self._flops_model.total_params,
                                "trainable_params": self._flops_model.trainable_total}
        with self._guard("throughput hooks"):
            self._install_hooks(model, optimizer)
        with self._guard("precision"):
            self._precision = PrecisionWatch(model, optimizer, args, self.preflight.get("strategy"))
            self._hooks.append(self._precision)
            if state.is_world_process_zero:
                logger.warning("shardscope precision: %s", json.dumps(self._precision.report()))
        with self._guard("device peak FLOP/s"):
            self._peak = self._peak_flops(args)
        if self._device.type == "cuda":
            with self._guard("planner preflight"):
                self._plan_preflight(model, args, state)
        if state.is_world_process_zero:
            with self._guard("preflight log"):
                logger.warning("shardscope preflight: %s", json.dumps({**self.preflight, **self.model_facts}))

    def on_step_begin(self, args, state, control, **kwargs):
        with self._guard("throughput"):
            self._windows_call("step_begin")
        next_step = state.global_step + 1
        self._capture_grads = self._is_measure_step(next_step, state) or next_step == state.max_steps
        if self.memory_step is not None and next_step == min(self.memory_step, state.max_steps or next_step):
            with self._guard("peak tensor memory"):
                self._step_peak = StepPeak(_unwrap(kwargs.get("model")), kwargs.get("optimizer")).__enter__()
        self._sampled.begin(next_step, state.max_steps, kwargs.get("model"), kwargs.get("optimizer"))  # [issue 21]

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        instrumented = self._sampled.end() or self._step_peak is not None  # [issue 21]
        if self._step_peak is not None:
            with self._guard("peak tensor memory"):
                self._step_peak.__exit__(None, None, None)
                self.step_peak = self._step_peak.result()
            self._step_peak = None
        with self._guard("throughput"):
            self._windows_call("step_end", pause_after=control.should_evaluate or control.should_save,
                               count=not instrumented)
        if self._is_measure_step(state.global_step, state):
            ranks = self._measure_all_ranks(model, optimizer, self._interval)  # guarded inside, collective
            with self._guard("metric logging"):
                self._pending = _log_metrics(ranks, self._tp)
            with self._guard("throughput"):
                self._interval.reset()
            with self._guard("peak memory"):
                reset_peak(self._device)
        if not (control.should_evaluate or control.should_save):  # [issue 21] the timed step starts here
            self._sampled.next(state.global_step + 1, state.max_steps, model, optimizer)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._pending and logs is not None:
            with self._guard("metric logging"):
                logs.update(self._pending)
                if state.log_history and state.log_history[-1].get("step") == state.global_step:
                    state.log_history[-1].update(self._pending)
            self._pending = {}

    def on_train_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._sampled.end(keep=False)  # [issue 21] a timer started for a step that never ran
        ranks = self._measure_all_ranks(model, optimizer, self._run)
        with self._guard("precision"):  # one collective, reached on every rank
            self._precision_ranks = gather_reports(self._precision)
        with self._guard("hooks"):
            self._remove_hooks()
        if state.is_world_process_zero and self.summary_file:
            with self._guard("summary file"):
                path = write_summary(Path(args.output_dir) / self.summary_file, self._summary(args, state, ranks))
                logger.warning("shardscope summary written to %s", path)

    # --- Measuring --------------------------------------------------------------------------------
    def _measure_all_ranks(self, model, optimizer, window: ThroughputWindow) -> list[dict]:
        """Measure this rank, then exchange with every rank (one collective, called on all ranks)."""
        mine = dict.fromkeys(RANK_FIELDS, math.nan)
        with self._guard("model-state bytes"):
            counted = count_state(model, optimizer, grad_entries=self._grads)
            for category in ("params", "grads", "optimizer"):
                mine[f"{category}_bytes"] = counted.total(category)
                mine[f"{category}_cpu_bytes"] = counted.by_device[category].get("cpu", 0)
            mine["trainable_params_bytes"] = counted.trainable_params
            self.locations = {c: sorted(counted.by_device[c]) for c in ("params", "grads", "optimizer")}
        with self._guard("peak memory"):
            if window is self._run or self._device.type == "cuda":  # [issue 21] RSS is for the summary only
                self.memory = read_memory(self._device)
            mine["cpu_peak_rss_bytes"] = self.memory.get("cpu_peak_rss_bytes", math.nan)
            if self._device.type == "cuda":
                mine["peak_memory_bytes"] = self.memory["peak_memory_bytes"]
        if self.step_peak:
            mine["peak_tensor_bytes"] = self.step_peak["peak_tensor_bytes"]
            mine.update({f"peak_{k}_bytes": v for k, v in self.step_peak["peak_breakdown"].items()})
            mine["peak_phase"] = PHASES.index(self.step_peak["peak_phase"])
            if self._device.type != "cuda":
                mine["peak_memory_bytes"] = self.step_peak["peak_tensor_bytes"]
        with self._guard("throughput"):
            totals = window.totals()
            mine.update(samples=totals.samples, seconds=totals.seconds,
                        tokens=_float(totals.tokens), flops=_float(totals.flops))
        mine.update(self._sampled.fields())  # [issue 21]
        gathered = [mine]
        with self._guard("cross-rank gather"):
            gathered = _all_gather(mine, self._device)
        return [self._complete_or_empty(rank) for rank in gathered]

    def _complete_or_empty(self, rank: dict) -> dict:
        with self._guard("reported figures"):
            return self._complete(rank)
        return {key: None for key in (*COMPONENTS, "peak_memory_bytes")} | {"throughput": {}}

    def _complete(self, rank: dict) -> dict:
        """Turn one rank's raw counts into reported figures."""
        out = {k: _int_or_none(rank[k]) for k in RANK_FIELDS
               if k.endswith("_bytes") and not k.startswith(("peak_", "comm_"))}  # [issue 21] comm_: below
        out["peak_memory_bytes"] = _int_or_none(rank["peak_memory_bytes"])
        out["peak_tensor_bytes"] = _int_or_none(rank["peak_tensor_bytes"])
        out["peak_breakdown"] = ({k: _int_or_none(rank[f"peak_{k}_bytes"]) for k in BREAKDOWN}
                                 if out["peak_tensor_bytes"] is not None else None)
        out["peak_phase"] = None if math.isnan(rank["peak_phase"]) else PHASES[int(rank["peak_phase"])]
        totals = WindowTotals(rank["samples"], _none_if_nan(rank["tokens"]), _none_if_nan(rank["flops"]),
                              0.0 if math.isnan(rank["seconds"]) else rank["seconds"])
        out["throughput"] = {**rates(totals, self._peak), "flops_convention": FLOPS_CONVENTION}
        out.update(self._sampled.complete(rank))  # [issue 21]
        return out

    def _install_hooks(self, model, optimizer):
        """Count each training forward's samples/tokens/FLOPs; snapshot gradients as the step begins."""
        self._remove_hooks()
        self._hooks.append(_unwrap(model).register_forward_pre_hook(self._count_batch, with_kwargs=True))

        def snapshot_gradients(*_):
            if self._capture_grads:
                with self._guard("gradient bytes"):
                    self._grads = held_gradients(model, optimizer)

        zero, base = zero_optimizer(optimizer), base_optimizer(optimizer)
        if zero is not None:  # DeepSpeed ZeRO optimizers have no step hooks: wrap this instance's step
            self._hooks.append(_StepWrapper(zero, snapshot_gradients))
        elif base is not None:
            self._hooks.append(base.register_step_pre_hook(snapshot_gradients))

    def _remove_hooks(self):
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _count_batch(self, module, args, kwargs):
        if not module.training:
            return
        if self._step_peak is not None or self._sampled.active:  # the instrumented step is not throughput
            if self._sampled.active:  # [issue 21] the counted step's padded tokens
                with self._guard("batch counting"):
                    samples, _, seq_len = batch_counts(args, kwargs)
                    self._sampled.add_batch(samples, seq_len)
            return
        with self._guard("batch counting"):
            patch_size = getattr(getattr(module, "config", None), "patch_size", None)
            samples, tokens, seq_len = batch_counts(args, kwargs, patch_size)
            flops = None
            if tokens is not None and self._flops_model is not None:
                flops = tokens * self._flops_model.per_token(seq_len) / self._tp  # a TP rank's share
            self._windows_call("add_batch", samples, tokens, flops)

    # --- Helpers ------------------------------------------------------------------------------------
    def _reset(self):
        clock = time.perf_counter
        self._interval, self._run = ThroughputWindow(clock), ThroughputWindow(clock)
        self._pending, self._grads, self._capture_grads = {}, None, False
        self._flops_model = getattr(self, "_flops_model", None)
        self._device, self._peak = torch.device("cpu"), None
        self._precision, self._precision_ranks = None, []
        self.preflight, self.model_facts, self.locations, self.memory = {}, {}, {}, {}
        self._step_peak, self.step_peak = None, {}
        self._sampled = SampledSteps(self.comm_step, self.time_step, self.time_every_n_steps, self._device,
                                     self._guard, self._warn_once)  # [issue 21]

    def _windows_call(self, method, *args, **kwargs):
        if method == "step_end" and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)  # kernels are async: close the window on real time
        for window in (self._interval, self._run):
            getattr(window, method)(*args, **kwargs)

    @property
    def _tp(self) -> int:
        """Tensor-parallel degree of the run (1 without TP)."""
        return (self.preflight.get("mesh") or {}).get("tp", 1)

    def _is_measure_step(self, step: int, state) -> bool:
        every = self.every_n_steps or state.logging_steps or 1
        return step > 0 and step % every == 0

    def _peak_flops(self, args):
        if self.peak_tflops:
            return self.peak_tflops * 1e12
        if self._device.type != "cuda":
            return None
        dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else \
            "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
        return peak_flops(torch.cuda.get_device_name(self._device), dtype)

    def _plan_preflight(self, model, args, state):
        """Warn (rank 0) when the planner says the detected strategy will not fit this GPU.

        Activations depend on batches not seen yet, so the plan uses sequence length 0: model
        states and buffers only, a lower bound. Saved in the summary as `preflight.plan`.
        """
        from .mesh import Setup, setup_for_mesh
        from .model_spec import spec_from_config
        from .planner import estimate
        from .units import gb

        strategy = self.preflight.get("strategy")
        world, nodes = self.preflight.get("world_size", 1), num_nodes()
        precision = "bf16-mixed" if args.bf16 else "fp16-mixed" if args.fp16 else "fp32"
        setup = Setup(gpus_per_node=max(1, world // nodes), nodes=nodes, precision=precision, seq_len=0,
                      micro_batch=args.per_device_train_batch_size,
                      gpu_memory_bytes=torch.cuda.get_device_properties(self._device).total_memory)
        if self._tp > 1:
            strategy, setup = setup_for_mesh(setup, self.preflight["mesh"])
        plan = estimate(spec_from_config(_unwrap(model).config), setup)
        row = next((r for r in plan["rows"] if r["strategy"] == strategy), None)
        if row is None:
            return
        self.preflight["plan"] = {"strategy": strategy, "total_bytes": row["total_bytes"], "fits": row["fits"],
                                  "gpu_memory_bytes": setup.gpu_memory_bytes, "recommendation": plan["recommendation"]}
        if row["fits"] is False and state.is_world_process_zero:
            advice = plan["recommendation"]
            logger.warning("shardscope preflight: the planner estimates %s needs %s GB per GPU before activations, "
                           "more than this %s GB GPU allows; recommended: %s (%s)", strategy, gb(row["total_bytes"]),
                           gb(setup.gpu_memory_bytes), advice["strategy"], advice["reason"])

    def _summary(self, args, state, ranks: list[dict]) -> dict:
        device = self._device.type
        if device == "cuda":
            device = torch.cuda.get_device_name(self._device)
        return {
            "shardscope_version": __version__,
            "strategy": self.preflight.get("strategy"),
            "strategy_detail": {k: v for k, v in self.preflight.items()
                                if k not in ("strategy", "world_size", "plan", "mesh")},
            "mesh": self.preflight.get("mesh"),
            "preflight_plan": self.preflight.get("plan"),
            "fit": getattr(args, "shardscope_fit", None),  # shardscope fit: fit_training.FIT_ATTRIBUTE
            "world_size": self.preflight.get("world_size", len(ranks)),
            "num_nodes": num_nodes(),
            "model": self.model_facts,
            "device": device,
            "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
            "precision_verdict": run_verdict(self._precision_ranks),
            "global_step": state.global_step,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,  # [issue 21] what plan --compare plans
            "state_locations": self.locations,
            "memory_details_rank0": self.memory,
            "straggler": straggler(ranks),  # [issue 21]
            "ranks": [{"rank": i, **r, "memory_kind": self._memory_kind(r),
                       **{k: v for k, v in p.items() if k != "precision_verdict"}}
                      for i, (r, p) in enumerate(zip(ranks, self._precision_ranks or [{}] * len(ranks)))],
        }

    def _memory_kind(self, rank: dict) -> str | None:
        """What `peak_memory_bytes` is: CUDA's allocator peak, or on CPU the instrumented step's tensor peak."""
        if self._device.type == "cuda":
            return self.memory.get("memory_kind")
        return "tensor_peak" if rank.get("peak_memory_bytes") is not None else None

    def _run_before_reporters(self):
        """Move this callback ahead of the reporting callbacks, so the logs they send include our keys.

        The Trainer puts user callbacks after its reporters (TensorBoard, W&B, ...) and offers no public
        way to reorder; the handler is found on the call stack (it is the object calling this event).
        """
        frame = inspect.currentframe()
        while frame is not None and not isinstance(frame.f_locals.get("self"), CallbackHandler):
            frame = frame.f_back
        if frame is None:
            self._warn_once("callback order", "could not find the Trainer's callback list; shardscope metrics "
                            "reach trainer_state.json and the summary file but not the report_to backends")
            return
        callbacks = frame.f_locals["self"].callbacks
        position = 1 if callbacks and isinstance(callbacks[0], DefaultFlowCallback) else 0
        if callbacks.index(self) > position:
            callbacks.remove(self)
            callbacks.insert(position, self)

    @contextmanager
    def _guard(self, what: str):
        try:
            yield
        except Exception as error:  # measuring must never stop training
            self._warn_once(what, f"could not measure {what}: {type(error).__name__}: {error}")

    def _warn_once(self, key: str, message: str):
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("shardscope: %s (warned once; training continues)", message)


class _StepWrapper:
    """Runs `before()` ahead of `optimizer.step` on this one instance; `remove()` undoes it."""

    def __init__(self, optimizer, before):
        original = optimizer.step

        def step(*args, **kwargs):
            before()
            return original(*args, **kwargs)

        self.optimizer = optimizer
        optimizer.step = step

    def remove(self):
        del self.optimizer.step  # the class's own method shows through again


def _flops_model(model):
    """Parameter counts (full, unsharded) and attention shape for the FLOPs convention."""
    model = _unwrap(model)
    config = model.config
    trainable = frozen = 0
    for p in model.parameters():
        numel = _full_numel(p)
        if p.requires_grad:
            trainable += numel
        else:
            frozen += numel
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    embedding_params, trainable_total = 0, trainable
    if isinstance(embedding, torch.nn.Embedding) and not getattr(config, "tie_word_embeddings", False):
        embedding_params = _full_numel(embedding.weight)
        if embedding.weight.requires_grad:
            trainable -= embedding_params
        else:
            frozen -= embedding_params
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return FlopsModel(trainable, frozen, text_config.num_hidden_layers, heads * head_dim, embedding_params,
                      trainable_total)


def _full_numel(p) -> int:
    if hasattr(p, "ds_numel"):  # DeepSpeed ZeRO-3 partitioned parameter
        return p.ds_numel
    return p.numel()  # DTensor.numel() is the global size


def _unwrap(model):
    while type(model).__name__ in WRAPPERS and hasattr(model, "module"):
        model = model.module
    return model


def _all_gather(values: dict, device: torch.device) -> list[dict]:
    """Every rank's `values` (same keys everywhere), via one all_gather; just ours when not distributed."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [values]
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor([float(values[k]) for k in RANK_FIELDS], dtype=torch.float64, device=on)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [dict(zip(RANK_FIELDS, t.tolist())) for t in gathered]


def _log_metrics(ranks: list[dict], tp: int = 1) -> dict:
    """Cross-rank min/max/mean of per-rank figures, plus global samples/s and tokens/s (each of the
    `tp` ranks of a tensor-parallel group counts its shared batch: the group's replica counts once)."""
    flat = [{**{k: v for k, v in r.items() if k != "throughput"}, **r["throughput"]} for r in ranks]
    reduced = reduce_ranks(flat, REDUCED, tp)
    metrics = {}
    for key in REDUCED:
        if key in reduced:
            name = "tokens_per_s_per_device" if key == "tokens_per_s" else key
            metrics.update({f"{PREFIX}{name}_{k}": v for k, v in reduced[key].items()})
    for key in ("samples_per_s", "tokens_per_s"):
        if reduced[f"global_{key}"] is not None:
            metrics[f"{PREFIX}{key}"] = reduced[f"global_{key}"]
    return metrics


def _float(value) -> float:
    if value is None:
        return math.nan
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def _none_if_nan(value):
    return None if value is None or math.isnan(value) else value


def _int_or_none(value):
    return None if value is None or math.isnan(value) else int(value)
