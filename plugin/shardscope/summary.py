"""The run summary (`shardscope_summary.json`): its name, schema, atomic writing, safe reading, and the
reduction of per-rank figures over ranks.

Written by the profiler (rank 0, at the end of training; `profiler.ShardingProfiler`, the callback's too); read by
`compare`, `report` and
`plan --against`. A reader never sees a half-written file: the writer renames a complete temporary
file into place. A missing, truncated or foreign file is one `UsageError` naming the file and key.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from .errors import UsageError
from .safe_io import atomic_write_text, load_json
from .strategy import PRECISION_ALIASES, PRECISIONS, STRATEGIES, TP_STRATEGIES, strategy_from_summary, tp_strategy

SUMMARY_FILE = "shardscope_summary.json"
SCHEMA_VERSION = 1
FIT_ATTRIBUTE = "shardscope_fit"  # what fit_training_args sets on the TrainingArguments: the summary's `fit`
COMPONENTS = ("params_bytes", "grads_bytes", "optimizer_bytes")
MAX_BYTES = 64 * 2 ** 20  # a summary is a few KB per rank; anything larger is not one

# Top-level keys (the profiler's docstring documents the per-rank keys and logged metrics).
FIELDS = {
    "schema_version": "version of this layout (absent before version 1: read as 1)",
    "shardscope_version": "the package version that wrote it",
    "strategy": "the planner's strategy name (ddp, zero3, fsdp_full_shard, tp, ...) or 'single'",
    "strategy_detail": "what the strategy was read from (ZeRO stage, offload, FSDP version, ...); under ZeRO "
                       "`reduce_bucket_size` (elements), ZeRO-1/2 `overlap_comm` and `allgather_bucket_size`, ZeRO-3 "
                       "`prefetch_bucket_size`, `stage3_param_persistence_threshold` and `stage3_max_reuse_distance`, "
                       "as the run's ZeRO optimizer was built with them (plan_vs_run plans with those its Setup "
                       "takes); with a long-sequence "
                       "split `sequence_parallel` {kind: cp or sp, degree, backend, group: the ranks sharing this "
                       "rank's sequences}",
    "mesh": "{dp_replicate, dp_shard, tp}: how the ranks are split, plus cp or sp (the sequence split's degree) "
            "when one is used",
    "live_plan": "on a GPU: the planner's peak for this run at its first training batch's shape (earlier "
                 "versions wrote `preflight_plan`: `read_summary` reads it as live_plan)",
    "fit": "fit_training_args' decision, when the run used it: {budget_bytes, per_device_train_batch_size, "
           "gradient_accumulation_steps, gradient_checkpointing, predicted_peak_bytes, ...}; else null",
    "world_size": "ranks in the run",
    "num_nodes": "nodes in the run",
    "model": "{name_or_path, params_total, trainable_params}",
    "frozen_models": "optional: {name: {params_total}} of models held but not trained (DPO's reference, reward and "
                     "teacher models); per rank `frozen_models` {name: bytes} and `frozen_models_bytes`",
    "device": "cpu, or the CUDA device name",
    "precision": "fp32, bf16 or fp16, as the Trainer was configured",
    "precision_verdict": "{configured, effective, ok, reason}: the configured mode against what the tensors are",
    "global_step": "optimizer steps taken",
    "gradient_accumulation_steps": "optional: micro-batches per optimizer step",
    "state_locations": "devices each state category was found on",
    "memory_details_rank0": "rank 0's memory readings at the end",
    "ranks": "one object per rank: params_bytes, grads_bytes, optimizer_bytes, peak_memory_bytes, throughput, "
             "dtypes {params, grads, optimizer, master_params}, master_params_bytes, compute_dtype, "
             "comm {kind: {calls, bytes, sent_bytes}}, comm_sent_bytes_per_step, time_breakdown (optional, issue 21), "
             "step_seconds {median, p10, p90, steps} (the measured optimizer steps of the throughput window: instrumented "
             "steps excluded), "
             "peak_tensor_bytes, peak_breakdown, peak_phase, peak_step {micro_batch, seq_len, image_size, "
             "gradient_checkpointing} (the instrumented step of the largest peak), worst_step {step, tokens, "
             "padded_tokens, peak_tensor_bytes} (of the measured steps: the memory step and each later step with more "
             "padded tokens than any measured, measure/step_log.py), padding_waste (padded / real tokens fed - 1), "
             "measured_steps [{step, tokens, padded_tokens, peak_tensor_bytes}], last_step {tokens, padded_tokens}, ...",
    "straggler": "optional: {busiest_rank, step_s, busy_s, spread} across ranks on the timed step (busiest_rank: "
                 "the most busy seconds on that one step); where every rank measured its compute (CPU ranks), also "
                 "compute_s and wall_s per rank, windows, slow_windows per rank, straggler_rank (the verdict over "
                 "the logged windows, or null) and waiting_share {rank: share} (measure/stragglers.py)",
    "instruments": "optional: {instrument: 'ok' or why it stopped} for what the profiler installs (throughput, "
                   "state_bytes, precision, memory, collectives, step_time, watchdog, batch_feed); the fields of one that "
                   "stopped are null",
}
REQUIRED = ("world_size", "strategy", "ranks")
# Keys earlier versions wrote under another name: {old: new} at the top level and inside `straggler` (issue 51).
RENAMED = {"preflight_plan": "live_plan"}
RENAMED_IN_STRAGGLER = {"slowest_rank": "busiest_rank", "rank": "straggler_rank"}
# per rank: the measured steps' seconds {median, p10, p90, steps}, apart from plan's predicted `step_time_s` (a float)
RENAMED_IN_RANKS = {"step_time_s": "step_seconds"}


def upgraded(summary: dict) -> dict:
    """`summary` with the keys earlier versions wrote under another name (`RENAMED`, `RENAMED_IN_STRAGGLER`,
    `RENAMED_IN_RANKS`) under today's: every reader reads one name. A summary already written with today's names is
    returned as it is."""
    out = _renamed(summary, RENAMED)
    if isinstance(out.get("straggler"), dict):
        out["straggler"] = _renamed(out["straggler"], RENAMED_IN_STRAGGLER)
    if isinstance(out.get("ranks"), list):
        out["ranks"] = [_renamed(r, RENAMED_IN_RANKS) if isinstance(r, dict) else r for r in out["ranks"]]
    return out


def _renamed(mapping: dict, names: dict) -> dict:
    """`mapping` with each old key under its new name (where both are there, the new name's value is kept)."""
    return {names.get(k, k): v for k, v in mapping.items() if k not in names or names[k] not in mapping}


def write_summary(path: str | Path, summary: dict) -> Path:
    """Write `summary` (plus `schema_version`) as JSON atomically (safe_io: a temporary file renamed into
    place, umask permissions); NaN or an infinity is an error, never written as non-JSON."""
    path = Path(path)
    text = json.dumps({"schema_version": SCHEMA_VERSION, **summary}, indent=2, allow_nan=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(path, text, "summary")


def read_summary(path: str | Path) -> dict:
    """Load a summary through safe_io's bounded JSON reader (a regular UTF-8 file of at most MAX_BYTES, so a
    FIFO never hangs it; NaN, infinities, integers past 64 bits and deep nesting refused), its renamed keys under
    today's names (`upgraded`). One-line
    `UsageError` naming the file and key when it is unusable, from a newer schema, or lacks what the tools need."""
    path = Path(path)
    summary = load_json(path, "summary", MAX_BYTES)
    if not isinstance(summary, dict):
        raise UsageError(f"summary '{path}' is not a JSON object")
    summary = upgraded(summary)
    version = summary.get("schema_version", 1)
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise UsageError(f"summary '{path}': key 'schema_version' ({version!r}) is newer than this shardscope "
                         f"reads ({SCHEMA_VERSION}); upgrade shardscope")
    for key in REQUIRED:
        if key not in summary:
            raise UsageError(f"summary '{path}' has no key '{key}'")
    if not isinstance(summary["world_size"], int) or summary["world_size"] < 1:
        raise UsageError(f"summary '{path}': key 'world_size' must be a positive integer")
    if not isinstance(summary["ranks"], list) or not summary["ranks"]:
        raise UsageError(f"summary '{path}': key 'ranks' must be a non-empty list")
    for i, rank in enumerate(summary["ranks"]):
        for key in COMPONENTS:
            value = rank.get(key) if isinstance(rank, dict) else None
            if not _is_count(value):
                raise UsageError(f"summary '{path}': key 'ranks[{i}].{key}' is missing or not a byte count")
    return summary


def run_of(summary: dict, path) -> dict:
    """The run a summary (as `read_summary` returns it) records, as the planner reads it, each key checked (one-line
    `UsageError` naming the file and key): {strategy, world_size, num_nodes, precision (the planner's names),
    grad_accum_steps (None where not recorded), mesh (a TP run's, held to world_size and strategy; else None)}.
    report/'s plan_vs_run and time_prediction read a run through it."""
    where = f"summary '{path}'"
    strategy = strategy_from_summary(summary)
    if strategy is None:
        raise UsageError(f"{where}: key 'strategy' ({summary['strategy']!r}) is not one of {', '.join(STRATEGIES)}")
    world, nodes = summary["world_size"], summary.get("num_nodes") or 1
    if count_or_none(nodes) is None:
        raise UsageError(f"{where}: key 'num_nodes' must be a positive integer, got {nodes!r}")
    precision = PRECISION_ALIASES.get(str(summary.get("precision", "fp32")).lower())
    if precision is None:
        raise UsageError(f"{where}: key 'precision' ({summary.get('precision')!r}) is not one of "
                         f"{', '.join(PRECISIONS)}")
    accum = summary.get("gradient_accumulation_steps")
    if "gradient_accumulation_steps" in summary and not count_or_none(accum):
        raise UsageError(f"{where}: key 'gradient_accumulation_steps' must be a positive integer, got {accum!r}")
    mesh = summary.get("mesh") if strategy in TP_STRATEGIES else None
    if strategy in TP_STRATEGIES:
        if not isinstance(mesh, dict) or not all(count_or_none(mesh.get(k)) for k in ("dp_replicate", "dp_shard", "tp")):
            raise UsageError(f"{where}: key 'mesh' must give positive integers dp_replicate, dp_shard and tp for "
                             f"strategy {strategy}, got {mesh!r}")
        degrees = mesh["dp_replicate"] * mesh["dp_shard"] * mesh["tp"]
        if degrees != world:
            raise UsageError(f"{where}: key 'mesh' ({mesh['dp_replicate']} x {mesh['dp_shard']} x {mesh['tp']} = "
                             f"{degrees}) disagrees with world_size {world}")
        if tp_strategy(mesh) != strategy:
            raise UsageError(f"{where}: key 'strategy' ({strategy}) disagrees with key 'mesh' {mesh} (which is "
                             f"{tp_strategy(mesh)})")
    return {"strategy": strategy, "world_size": world, "num_nodes": nodes, "precision": precision,
            "grad_accum_steps": accum, "mesh": mesh}


def step_shape(rank: dict, where: str) -> dict | None:
    """A rank's measured step shape (`peak_step`): {micro_batch, seq_len, image_size, gradient_checkpointing}, None
    where it is not recorded; one-line `UsageError` naming `where` (the key) when it is malformed."""
    step = rank.get("peak_step")
    if step is None:
        return None
    shape = {k: step.get(k) if isinstance(step, dict) else None
             for k in ("micro_batch", "seq_len", "image_size", "gradient_checkpointing")}
    if not count_or_none(shape["micro_batch"]) or not all(
            v is None or count_or_none(v) is not None for v in (shape["seq_len"], shape["image_size"])):
        raise UsageError(f"{where} must give a positive integer micro_batch and non-negative integers (or null) "
                         f"seq_len and image_size, got {step!r}")
    return shape


def count_or_none(value):
    """A count read from a summary (an integer, not a bool, in [0, 2**63)), or None."""
    return value if isinstance(value, int) and _is_count(value) else None


def _is_count(value) -> bool:
    """A finite, non-negative number of a plausible size (under 2**63: what a tensor can hold)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and 0 <= value < 2 ** 63)


def numbers(values) -> list:
    """The finite numbers among `values` (None, NaN and non-numbers left out)."""
    return [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]


def spread(values) -> dict:
    values = numbers(values)
    return {"min": min(values), "max": max(values)} if values else {"min": None, "max": None}


def reduce_ranks(ranks: list[dict], keys, tp: int = 1) -> dict:
    """Across ranks: {key: {min, max, mean}} for each of `keys` that some rank has, plus the global
    `samples_per_s` / `tokens_per_s` (sum over ranks / tp: the tp ranks of a tensor-parallel group
    share one batch, so each data-parallel replica counts once)."""
    out = {}
    for key in keys:
        values = numbers(r.get(key) for r in ranks)
        if values:
            out[key] = {"min": min(values), "max": max(values), "mean": sum(values) / len(values)}
    for key in ("samples_per_s", "tokens_per_s"):
        values = numbers(r.get(key) for r in ranks)
        out[f"global_{key}"] = sum(values) / tp if values else None
    return out
