"""The public profiler and callback: measure/'s classes with the planner wired in. measure/ imports nothing from
plan/; this module sits above both and hands the profiler `plan_for_live_run` (the planner's row for the live run
at its first training batch, checked against the GPU)."""
from __future__ import annotations

from .measure import callback, profiler
from .measure.peak import step_shape
from .model.spec import live_config, spec_from_config
from .plan.mesh import Setup, setup_for_mesh
from .plan.planner import estimate, usable_bytes
from .plan.trace import traces_for
from .strategy import PRECISION_ALIASES
from .units import gb


def plan_for_live_run(model, strategy: str | None, mesh: dict | None, world: int, nodes: int, precision: str | None,
                      gpu_memory_bytes: int, inputs: dict | None = None) -> dict | None:
    """The planner's row for a live run as its first training batch goes in: its strategy, world size, precision
    ("bf16", "fp16", "fp32"), TP mesh, LoRA adapters and checkpointing, and the batch's shape (`inputs`: the
    forward's keyword arguments, input_ids or pixel_values). The step is traced at that shape as `plan --model`
    traces it (`plan.trace.traces_for`; a fake-tensor trace costs the same at any micro-batch); where tracing
    fails the row's `activations_source` says approximate, and without a batch (no inputs) the plan is model
    states and buffers only, a lower bound.
    {strategy, peak_bytes, total_bytes, peak_phase, activations_source, micro_batch, seq_len, fits,
    gpu_memory_bytes, usable_bytes, recommendation, warning (when it does not fit)}, or None for a strategy it
    has no row for."""
    config, lora = live_config(model)
    shape = step_shape(model, (), inputs or {})
    setup = Setup(gpus_per_node=max(1, world // nodes), nodes=nodes, gpu_memory_bytes=gpu_memory_bytes,
                  precision=PRECISION_ALIASES.get(str(precision), "fp32"),
                  micro_batch=shape["micro_batch"] or 1, seq_len=shape["seq_len"] or 0,
                  image_size=shape["image_size"], activation_checkpointing=shape["gradient_checkpointing"], **lora)
    if mesh and mesh.get("tp", 1) > 1:
        strategy, setup = setup_for_mesh(setup, mesh)
    batch = shape["micro_batch"] is not None
    plan = estimate(spec_from_config(config), setup, traces_for(config, setup)[0] if batch else None)
    row = next((r for r in plan["rows"] if r.strategy == strategy), None)
    if row is None:
        return None
    usable, best = usable_bytes(setup), plan["recommendation"]
    out = {"strategy": strategy, "peak_bytes": row.peak_bytes, "total_bytes": row.peak_bytes,
           "peak_phase": row.peak_phase, "activations_source": row.activations_source,
           "micro_batch": setup.micro_batch, "seq_len": setup.seq_len, "fits": row.fits,
           "gpu_memory_bytes": setup.gpu_memory_bytes, "usable_bytes": int(usable), "recommendation": best}
    if row.fits is False:
        out["warning"] = (f"the planner's peak for {strategy} at micro-batch {setup.micro_batch} is "
                          f"{gb(row.peak_bytes)} GB per GPU ({row.peak_phase}; activations "
                          f"{row.activations_source}), more than the {gb(usable)} GB usable on this GPU; "
                          f"recommended: {best['strategy']} ({best['reason']})")
    return out


class ShardingProfiler(profiler.ShardingProfiler):
    __doc__ = profiler.ShardingProfiler.__doc__
    plan_for_live_run = staticmethod(plan_for_live_run)


class ShardingProfilerCallback(callback.ShardingProfilerCallback):
    __doc__ = callback.ShardingProfilerCallback.__doc__
    profiler_class = ShardingProfiler
