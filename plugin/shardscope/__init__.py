"""shardscope: choose, run and measure distributed-training strategies with the Hugging Face Trainer."""

__version__ = "0.1.0"

__all__ = ["ShardingProfiler", "ShardingProfilerCallback", "fit_training_args", "__version__"]


def __getattr__(name):
    # The profiler pulls in torch, the callback transformers; keep `import shardscope` (and the CLI) light.
    if name == "ShardingProfilerCallback":
        from .callback import ShardingProfilerCallback

        return ShardingProfilerCallback
    if name == "fit_training_args":
        from .fit_training import fit_training_args

        return fit_training_args
    if name == "ShardingProfiler":
        from .profiler import ShardingProfiler

        return ShardingProfiler
    raise AttributeError(f"module 'shardscope' has no attribute {name!r}")
