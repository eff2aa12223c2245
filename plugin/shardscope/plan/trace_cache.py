"""`trace.traces_for` of a shipped name or local folder, through `model/cache.py`: the traces depend on the
config and on the setup's shape of a step (micro-batch, sequence, precision, checkpointing, attention, image
size, LoRA), not on the GPUs, so `plan --model` and `fit --model` trace a model once per step shape and
install."""
from __future__ import annotations

import json
from dataclasses import asdict, fields

from ..model import cache as model_cache
from .mesh import Setup
from ..model.spec import config_bytes, load_model_config
from .trace import Moment, StepTrace, tracer, traces_for

# Setup fields only the formulas read (GPUs, sharding): left out of the key (what the libraries decide,
# `LibraryKnobs`, is not traced at all). A field not listed here is in it, so a new one can cost a cache miss but
# never serve a stale trace.
NOT_TRACED = ("gpus_per_node", "nodes", "gpu_memory_bytes", "optimizer", "grad_accum_steps", "headroom",
              "cpu_memory_bytes", "prefer", "tp_size")


def cached_traces_for(model: str, setup: Setup, simulate: bool = False) -> tuple[dict, str | None]:
    """`traces_for(load_model_config(model), setup, simulate)`, from the cache when it holds them."""
    config = config_bytes(model)
    shape = {f.name: getattr(setup, f.name) for f in fields(Setup) if f.name not in NOT_TRACED}
    libraries = (*model_cache.LIBRARIES, "peft") if setup.lora_rank else model_cache.LIBRARIES  # peft's adapters
    key = model_cache.cache_key(config, ("plan/trace.py", "mem_tracker.py"), "traces", json.dumps(shape, sort_keys=True),
                               str(simulate), libraries=libraries) if config is not None else None
    cached = model_cache.load(key) if key else None
    if isinstance(cached, dict) and set(cached) == {"traces", "note"}:
        try:
            return {regime: _trace(value) for regime, value in cached["traces"].items()}, cached["note"]
        except (TypeError, KeyError, AttributeError, ValueError):
            pass  # not what this code writes: count again
    traces, note = traces_for(load_model_config(model), setup, simulate)
    if key:
        model_cache.store(key, {"traces": {regime: asdict(t) for regime, t in traces.items()}, "note": note})
    return traces, note


def cached_tracer(model: str, largest: int):
    """`trace.tracer` of a shipped name or local folder (`fit`), each shape traced through the cache."""
    return tracer(None, largest, lambda setup: cached_traces_for(model, setup))


def _trace(value: dict) -> StepTrace:
    moments = {name: Moment(**{part: tuple(pair) for part, pair in moment.items()})
               for name, moment in value["moments"].items()}
    return StepTrace(moments, tuple(value["trainable"]), value["regime"], value["simulated"])
