"""Test-only shim: let accelerate run the CPU (gloo) paths that torch and DeepSpeed support but it refuses.

The tests put this directory on PYTHONPATH for launched runs; its patches act only when a run asks for
FSDP or DeepSpeed, and it never touches a machine with CUDA. Everything else (wrapping, sharding,
optimizer, checkpointing) is the real library, so what the tests measure is what users get.

1. FSDP: accelerate only switches to FSDP inside its MULTI_GPU-family branch of `AcceleratorState`, so
   a CPU run (MULTI_CPU) with an FSDP config silently trains as plain DDP. torch's FSDP1 and FSDP2 both
   shard over gloo, so after accelerate builds its state we promote MULTI_CPU to FSDP with the plugin
   accelerate itself built from the config, on device `cpu` (FSDP1 rejects `cpu:0`), and FSDP2
   offload without pinned memory (pinning needs an accelerator).
2. DeepSpeed launcher: with no accelerator accelerate picks no process-group backend, so the Trainer sees
   world size 1 while DeepSpeed (which falls back to gloo) sees 2 and asserts on the batch size. We
   hand accelerate the backend DeepSpeed itself uses on CPU, gloo.
3. Tensor parallelism: `ParallelismConfig._validate_accelerator` accepts a mesh only when
   `Accelerator.multi_device` is true, and that property lists the GPU-family types but not MULTI_CPU,
   so a TP or FSDP x TP run on CPU stops at `Trainer(...)` although torch's DTensor TP works on gloo.
   We count MULTI_CPU as multi-device when a parallelism config spans several ranks. The sharding itself
   is transformers' (`from_pretrained(distributed_config=...)`) and the Trainer skips accelerate's
   wrapping for such a model either way, so nothing about what the tests measure changes.
"""
import os


def _flag(name):
    return os.environ.get(name, "false").lower() == "true"


def _patch_fsdp():
    import torch
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original_init = AcceleratorState.__init__

    def init_with_cpu_fsdp(self, *args, fsdp_plugin=None, **kwargs):
        original_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if self.distributed_type == DistributedType.MULTI_CPU and fsdp_plugin is not None:
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            if type(fsdp_plugin.cpu_offload).__name__ == "CPUOffloadPolicy":
                # FSDP2 pins offloaded shards by default, which needs an accelerator; on a CPU run the
                # "offloaded" shards live in the same memory anyway, so only the pinning is dropped.
                fsdp_plugin.cpu_offload = type(fsdp_plugin.cpu_offload)(pin_memory=False)
            self.fsdp_plugin = fsdp_plugin
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.device = PartialState._shared_state["device"] = torch.device("cpu")

    AcceleratorState.__init__ = init_with_cpu_fsdp


def _patch_deepspeed_backend():
    from accelerate.state import PartialState

    original_prepare = PartialState._prepare_backend

    def prepare_backend_gloo(self, cpu=False, sagemaker_dp=False, backend=None):
        backend, distributed_type = original_prepare(self, cpu, sagemaker_dp, backend)
        if backend is None and _flag("ACCELERATE_USE_DEEPSPEED") and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            backend = "gloo"
        return backend, distributed_type

    PartialState._prepare_backend = prepare_backend_gloo


def _patch_parallelism_config():
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    original = Accelerator.multi_device.fget

    def multi_device(self):
        pc = self.state.parallelism_config
        cpu_mesh = self.distributed_type == DistributedType.MULTI_CPU and pc is not None and pc.total_size > 1
        return original(self) or cpu_mesh

    Accelerator.multi_device = property(multi_device)


if "LOCAL_RANK" in os.environ:  # a launched rank (accelerate launch, torchrun, deepspeed)
    import torch

    if not torch.cuda.is_available():
        _patch_fsdp()  # acts only when accelerate built an FSDP plugin (config, env or TrainingArguments)
        _patch_deepspeed_backend()
        _patch_parallelism_config()  # acts only when a parallelism config spans several ranks
