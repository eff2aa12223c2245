"""`fit_training_args`: the fit decided once, on rank 0, and applied identically on every rank.

    args = fit_training_args(args, model, global_batch_size=64)            # on CUDA: the free memory
    args = fit_training_args(args, model, global_batch_size=64, memory_budget="2GB")  # required on CPU

Call it after `TrainingArguments` exists and the model is built, before the `Trainer`. Rank 0 plans with
the live model's config, the run's world size and strategy (read from the arguments and the launcher's
environment, as the Trainer will build them) and the smallest memory budget over the ranks; the
decision (or the one error) is broadcast, so every rank applies the same micro-batch, accumulation and
checkpointing, or every rank raises the same `UsageError`: no rank is left waiting in a collective.
The returned copy carries the decision as `args.shardscope_fit`; the profiler writes it to the summary
as `fit`.
"""
from __future__ import annotations

import dataclasses
import logging
import os

from ..errors import UsageError
from ..plan.calibration.figures import ASSUMED_GPU, hardware_for
from ..plan.mesh import HEADROOM, LibraryKnobs, Setup
from ..plan.planner import usable_bytes
from ..strategy import STRATEGIES, configured_precision, family, num_nodes, strategy_of_config, tp_strategy
from ..summary import FIT_ATTRIBUTE
from ..units import as_int, gb, parse_size
from .search import below_model_states, host_lines, nothing_fits, search

logger = logging.getLogger("shardscope")
OPTIMIZERS = {"adamw_bnb_8bit": "adamw-8bit", "adamw_8bit": "adamw-8bit", "paged_adamw_8bit": "adamw-8bit",
              "sgd": "sgd"}


def fit_training_args(args, model, global_batch_size: int, memory_budget=None, *, seq_len: int | None = None,
                      image_size: int | None = None, headroom: float = HEADROOM):
    """A copy of `args` with per_device_train_batch_size, gradient_accumulation_steps and gradient
    (activation) checkpointing chosen so that micro-batch x accumulation x data-parallel size ==
    `global_batch_size` and the planner's peak fits `memory_budget` less `headroom`, fastest first.

    memory_budget: bytes (an int, or a whole float such as 40e9) or a size ("2GB", "20GiB") per device; None on
    CUDA takes the smallest free memory over the ranks (plus what this process already reserved), and is required
    on CPU.
    seq_len / image_size: the longest sample the run will see (default: the model's
    max_position_embeddings / the config's image size)."""
    if not isinstance(global_batch_size, int) or isinstance(global_batch_size, bool) or global_batch_size < 1:
        raise UsageError(f"fit_training_args: global_batch_size must be a positive integer, got {global_batch_size!r}")
    budget = local_budget(args.device, memory_budget)
    budget = min(_all_gather(budget))
    decision = None
    if args.process_index == 0:
        try:
            decision = decide(args, model, global_batch_size, budget, seq_len, image_size, headroom)
        except UsageError as error:
            decision = {"error": str(error)}
        except Exception as error:  # a bug, but every rank must hear of it rather than hang
            decision = {"error": f"fit failed on rank 0: {type(error).__name__}: {error}"}
    decision = _broadcast(decision)
    if "error" in decision:
        raise UsageError(decision["error"])
    fitted = dataclasses.replace(args, per_device_train_batch_size=decision["per_device_train_batch_size"],
                                 gradient_accumulation_steps=decision["gradient_accumulation_steps"],
                                 activation_checkpointing=decision["gradient_checkpointing"],
                                 gradient_checkpointing=decision["gradient_checkpointing"])
    setattr(fitted, FIT_ATTRIBUTE, decision)
    logger.warning("shardscope fit (rank %d): per_device_train_batch_size=%d gradient_accumulation_steps=%d "
                   "gradient_checkpointing=%s; %s", args.process_index, decision["per_device_train_batch_size"],
                   decision["gradient_accumulation_steps"], decision["gradient_checkpointing"], decision["why"])
    return fitted


def local_budget(device, memory_budget) -> int:
    """This rank's memory budget in bytes: the given one, else CUDA's free memory plus what this process
    already reserved (the model already on the device is part of the plan, not lost to it)."""
    if memory_budget is not None:
        if isinstance(memory_budget, float) and memory_budget.is_integer():  # Python users write 40e9
            memory_budget = int(memory_budget)
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, str)):
            raise UsageError(f"fit_training_args: memory_budget must be bytes (an int, or a whole float like 40e9) "
                             f"or a size like '2GB', got {memory_budget!r}")
        if isinstance(memory_budget, int):
            if memory_budget < 1:
                raise UsageError(f"fit_training_args: memory_budget must be positive, got {memory_budget}")
            return memory_budget
        return parse_size(memory_budget, "memory_budget")
    if getattr(device, "type", str(device)) != "cuda":
        raise UsageError(f"fit_training_args on {device}: give memory_budget (bytes or a size like '2GB'; the "
                         "recipes' --fit_memory_budget): there is no device memory to read off a CPU")
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device))


def available_host_memory() -> int:
    """This node's available RAM (psutil, which accelerate already depends on): the offload candidates' bound."""
    import psutil

    return int(psutil.virtual_memory().available)


def run_strategy(args, model) -> tuple[str, dict | None, dict]:
    """The planner's name of the strategy the Trainer will build from these arguments and the launcher's
    environment, the tensor-parallel mesh if any, and what the library decides that the planner reads
    (`LibraryKnobs` fields: the FSDP version)."""
    env = os.environ
    loaded = getattr(getattr(_unwrap(model), "config", None), "distributed_config", None)
    if loaded is not None and getattr(loaded, "tp_size", 1) > 1:
        mesh = {"dp_replicate": loaded.dp_replicate_size, "dp_shard": loaded.fsdp_size, "tp": loaded.tp_size}
        return tp_strategy(mesh), mesh, {}
    tp = as_int(env.get("PARALLELISM_CONFIG_TP_SIZE")) or 1
    if tp > 1:
        world = args.world_size
        replicate = as_int(env.get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE")) or 1
        mesh = {"dp_replicate": replicate, "dp_shard": world // (replicate * tp), "tp": tp}
        return tp_strategy(mesh), mesh, {}
    plugin = getattr(args, "deepspeed_plugin", None)
    if plugin is not None:
        return strategy_of_config("deepspeed", plugin.deepspeed_config) or "ddp", None, {}
    if args.fsdp and isinstance(args.fsdp_config, dict):
        version = as_int(args.fsdp_config.get("version")) or 2
        return strategy_of_config("fsdp", args.fsdp_config), None, {"fsdp_version": version}
    if env.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        settings = {"fsdp_offload_params": env.get("FSDP_OFFLOAD_PARAMS", "false"),
                    "fsdp_reshard_after_forward": env.get("FSDP_RESHARD_AFTER_FORWARD",
                                                          env.get("FSDP_SHARDING_STRATEGY", "true"))}
        version = as_int(env.get("FSDP_VERSION")) or 1
        return strategy_of_config("accelerate", {"distributed_type": "FSDP", "fsdp_config": settings}), None, \
            {"fsdp_version": version}
    return "ddp", None, {}


def decide(args, model, global_batch: int, budget: int, seq_len, image_size, headroom: float) -> dict:
    """Rank 0's decision: `fit`'s search over the run's own strategy (the strategy is the run's); its candidates
    differ in micro-batch, checkpointing and accumulation, and those predicted within the model's error of the
    fastest are a tie, won by the most memory headroom (fit/search.py's `break_tie`)."""
    from ..model.spec import live_config, spec_from_config
    from ..plan.trace import tracer

    base = _unwrap(model)
    config, lora = live_config(base)
    spec = spec_from_config(config)
    strategy, mesh, extra = run_strategy(args, model)
    if strategy not in STRATEGIES:
        raise UsageError(f"fit_training_args: strategy {strategy!r} is not one the planner knows")
    world, nodes = args.world_size, num_nodes()
    precision = configured_precision(args.bf16, args.fp16)
    if precision == "bf16-mixed" and family(strategy) != "deepspeed" and _param_dtype(base) == "torch.bfloat16":
        precision = "bf16-pure"  # bf16 weights under autocast: no fp32 master anywhere
    if spec.kind == "text":
        seq_len = seq_len or getattr(config, "max_position_embeddings", None) or 2048
    setup = Setup(gpus_per_node=max(1, world // nodes), nodes=nodes, gpu_memory_bytes=budget, precision=precision,
                  optimizer=OPTIMIZERS.get(str(getattr(args.optim, "value", args.optim)), "adamw"),
                  seq_len=seq_len or 0, image_size=image_size, headroom=headroom,
                  tp_size=mesh["tp"] if mesh else None, cpu_memory_bytes=available_host_memory(),
                  **lora).validate()
    knobs = LibraryKnobs(**extra)
    gpu = None
    if str(args.device).startswith("cuda"):
        import torch

        gpu = torch.cuda.get_device_name(args.device)
    hw = hardware_for(gpu, precision, unknown="assume")  # a CPU run, an unknown GPU: to order this run's candidates
    assumed = (f" (step times ranked with {ASSUMED_GPU} figures: device peak unknown)"
               if hw.peak_source.startswith("assumed") else "")
    traces = tracer(config, global_batch)  # LoRA too: traced with the run's rank and targets
    found = search(spec, setup, global_batch, hw, (strategy,), traces, knobs)
    below = below_model_states(found, setup)
    if below:
        raise UsageError(f"fit_training_args: memory_budget {gb(budget)} GB: " + below.replace(
            "every strategy searched", f"this run's strategy ({strategy})"))
    if not found["fitting"]:
        reasons = [nothing_fits(spec, setup, found, (strategy,), traces, knobs),
                   *host_lines(found["host"], "this node's available RAM")]
        raise UsageError("fit_training_args: " + "; ".join(reasons))
    best, usable = found["fitting"][0], usable_bytes(setup)
    return {"budget_bytes": budget, "per_device_train_batch_size": best.per_device_train_batch_size,
            "gradient_accumulation_steps": best.gradient_accumulation_steps,
            "gradient_checkpointing": best.gradient_checkpointing, "predicted_peak_bytes": best.peak_bytes,
            "usable_bytes": int(usable), "headroom": headroom, "strategy": strategy,
            "world_size": world, "global_batch_size": global_batch, "tokens_per_sample": found["tokens_per_sample"],
            "step_time_s": best.step_time_s,
            "why": (f"{strategy} on {world} ranks, global batch {global_batch}, {found['tokens_per_sample']} tokens per "
                    f"sample: planned peak {gb(best.peak_bytes)} GB of {gb(usable)} GB usable "
                    f"({gb(budget)} GB budget less {headroom:.0%} headroom), fastest predicted of "
                    f"{len(found['fitting'])} settings of {strategy} that fit (the strategy is the run's own){assumed}")}


def data_parallel_size(args, model) -> int:
    """Ranks that see different batches: the world size over the tensor-parallel degree."""
    _, mesh, _ = run_strategy(args, model)
    return args.world_size // (mesh["tp"] if mesh else 1)


def _param_dtype(model) -> str:
    return str(next((p.dtype for p in model.parameters()), None))


def _unwrap(model):
    return getattr(model, "module", model)


def _distributed():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


def _all_gather(value) -> list:
    dist = _distributed()
    if dist is None:
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _broadcast(decision):
    dist = _distributed()
    if dist is None:
        return decision
    box = [decision]
    dist.broadcast_object_list(box, src=0)  # torch's own transport of plain data between the run's ranks
    return box[0]
