"""What the profiler samples when: the hooks it puts into the loop and the steps they mark.

`StepHooks` is the part of `ShardingProfiler` (profiler.py) that runs inside the user's step: forward pre-hooks
tell training forwards from those that do not train and count them (samples, tokens, FLOPs), an optimizer step
pre-hook snapshots the gradients (on the first step, the measuring steps and the last), the step's time is
anchored and closed on the throughput windows (and, on a CUDA rank, the CUDA events of `cuda_compute`), and the
instrumented steps are begun and ended: the memory step's tensor tracker (`peak.StepPeak`) and the sampled steps'
counter and timer (`sampled_steps.SampledSteps`). Every hook goes in through the profiler's instruments (guard.py).

It reads the profiler's set-up (`_module`, `optimizer`, `frozen_models`, `_device`, the instruments, `_flops_model`,
`_frozen_flops`, `_tp`, `_sp`, `_patch_size`, `_frozen_patch_sizes`, `every_n_steps`, `memory_step`,
`last_step`, `global_step`, `detected`, `precision`, `_sampled`, `_clock`: `step_clock.StepClock`), calls its `guard`
and `_instruments`, and keeps the step state (its initial values set in `ShardingProfiler.__init__`): `_counts`,
`_grads`, `_walk`, `_step_peak`, `step_peak`, `_sampled_due`, `_plan_due`, `_adapter_layer`.
"""
from __future__ import annotations

import functools
import logging

import torch

from ..state_bytes import base_optimizer, gradient_bytes, held_gradients, state_walk, zero_optimizer
from ..strategy import num_nodes
from .guard import MethodWrap
from .peak import StepPeak
from .rank_gather import process_rank
from .step_counts import first_adapter_layer
from .throughput import batch_counts, sequence_share

logger = logging.getLogger("shardscope")


class StepHooks:
    """The hooks and step marks of `ShardingProfiler` (see the module docstring)."""

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
            self._clock.mark("restart")  # the plan's seconds are not the step's
        if self._sampled_due:  # deferred by a pause: starts before the first training forward at the latest
            self._begin_sampled()
        with self.guard("batch counting"):
            adapters_off = self._adapter_layer is not None and self._adapter_layer.disable_adapters
            training = torch.is_grad_enabled() and not adapters_off
            if training:
                if self._clock.run.anchor is None:  # (begin_step anchored it, most often)
                    self._clock.mark("step_begin")  # the first training forward anchors the step's time
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

    def _is_measure_step(self, step: int) -> bool:
        return self.every_n_steps is not None and step > 0 and step % self.every_n_steps == 0
