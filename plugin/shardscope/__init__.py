"""shardscope: choose, run and measure distributed-training strategies with the Hugging Face Trainer.

The public Python surface is the names below, imported from `shardscope` itself; module paths below the top
level (`shardscope.plan.planner`, ...) are internal and may move. docs/architecture.md draws the layers."""

__version__ = "0.1.0"

from .notices import quiet_bitsandbytes_cpu_kernels  # noqa: E402  (a logging filter: nothing heavy imported)

quiet_bitsandbytes_cpu_kernels()

# name -> module (below shardscope) that defines it; imported on first use, so `import shardscope` (and the CLI)
# stays light: the profiler pulls in torch, the callback transformers.
_PUBLIC = {
    "ShardingProfiler": "profiling",
    "ShardingProfilerCallback": "profiling",
    "fit_training_args": "fit.training_args",
    "estimate": "plan.planner",
    "plan_dict": "plan.planner",
    "recommend": "plan.planner",
    "convention_table": "plan.planner",
    "strategy_row": "plan.formulas",
    "Setup": "plan.mesh",
    "LibraryKnobs": "plan.mesh",
    "setup_for_mesh": "plan.mesh",
    "model_spec": "model.spec",
    "plan_vs_run": "report.plan_vs_run",
    "end_of_run": "recipes.training",
}

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'shardscope' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)


def __dir__():
    return sorted(__all__)
