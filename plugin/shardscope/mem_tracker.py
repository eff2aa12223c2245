"""torch's MemTracker as both peaks use it: the measured one (measure/peak.py, one real step, each callback guarded
there) and the traced one (plan/trace.py, a step on fake tensors). MemTracker hooks the gradient of every parameter
it meets and torch refuses a hook on a frozen one: frozen base weights under LoRA and a frozen reference model are
tracked without one. A top-level module run again in one step is tracked anew (MemTracker refuses it).

Its ModTracker registers a multi-grad hook on each module's inputs and outputs and keeps no handle: the hook's
closure holds the graph nodes it hooks, and the nodes hold the hook, a cycle through C++ that Python's collector
cannot see. Seen on an H200 (benchmarks/results/gpu_check.md) and on CPU: after one tracked step of a Llama, the
parameters of every decoder layer outlived the model, the trainer and the optimizer (4.9 GB of fp32 weights per
run of a 1B model). The tracker here keeps those handles and removes them when it exits, which breaks the cycle."""
from __future__ import annotations


class _NoHook:
    def remove(self) -> None:
        pass


def tracker():
    """torch's MemTracker hooking the gradients of trainable parameters only, a module run again in one step tracked
    as a first call, its module hooks removed at exit (see the module docstring)."""
    from torch.distributed._tools import mod_tracker
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepTracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            for p in module.parameters():  # a frozen parameter counts as hooked already: no hook is installed
                if not p.requires_grad:
                    self._param_to_grad_hook_handles.setdefault(p, (_NoHook(), _NoHook()))
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _pre_fw_hook(self, module, inputs):
            """A top-level module run again in the same step (the next micro-batch, LoRA-DPO's adapter-disabled
            reference pass, a second forward in `compute_loss`, generation) is refused by MemTracker ("multiple
            iterative calls"). Its per-module statistics are not what is read here (the step's peak by category
            is), so the earlier call's are dropped and the call is tracked as a first one."""
            name = self._mod_tracker.get_known_fqn(module)
            if module in self.memory_tracking and not self._mod_tracker.is_bw and \
                    set(self._mod_tracker.parents) - {name} == {"Global"}:
                del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

        def track_as_parameters(self, *tensors) -> None:
            """Count `tensors` (which no module holds as a parameter: ZeRO-3's `ds_tensor` partitions) as
            parameters, from now on."""
            from torch.distributed._tools.mem_tracker import _MemRefType

            for tensor in tensors:
                self._update_and_maybe_create_winfos(tensor, _MemRefType.PARAM)

        def __enter__(self):
            self._module_hooks, register = [], mod_tracker.register_multi_grad_hook

            def keep(*args, **kwargs):
                handle = register(*args, **kwargs)
                self._module_hooks.append(handle)
                return handle

            self._register_multi_grad_hook = register
            mod_tracker.register_multi_grad_hook = keep
            return super().__enter__()

        def __exit__(self, *args):
            try:
                super().__exit__(*args)
            finally:
                mod_tracker.register_multi_grad_hook = self._register_multi_grad_hook
                for handle in self._module_hooks:
                    handle.remove()
                self._module_hooks = []

    return StepTracker()
