"""torch's MemTracker hooking only the parameters that train, shared by the measured peak (measure/peak.py, one real
step) and the traced one (plan/trace.py, a step on fake tensors). MemTracker hooks the gradient of every parameter
it meets and torch refuses a hook on a frozen one: frozen base weights under LoRA and a frozen reference model are
tracked without one."""


class _NoHook:
    def remove(self) -> None:
        pass


def tracker():
    """torch's MemTracker hooking the gradients of trainable parameters only (see the module docstring)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class TrainableOnlyTracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            for p in module.parameters():  # a frozen parameter counts as hooked already: no hook is installed
                if not p.requires_grad:
                    self._param_to_grad_hook_handles.setdefault(p, (_NoHook(), _NoHook()))
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    return TrainableOnlyTracker()
