"""A profiled run's folder (its shardscope_summary.json) read as the step-time model's figures: `run_sources`.

From a run folder's shardscope_summary.json (mean over ranks; the timed step's `time_breakdown` parts
scaled by median plain step / timed step, so the profiler's own cost is spread over the parts), with
C = forward_s + backward_s - library_s the step's compute and F = forward_s:
    flops_per_s            = training FLOPs per step per rank (`throughput`: TFLOP/s x window seconds / steps,
                             no recompute counted) / (C, less F with checkpointing: the forward recomputed)
    recompute_share        = F / C (a run without checkpointing), F / (C - F) (with): one forward again, timed
    library_s_per_byte     = {library: library_s / library_bytes}, from a ZeRO-3 or FSDP run (`library_s`: their
                             per-module work inside forward and backward; library_bytes: the counted all-gather,
                             reduce-scatter and reduce bytes per step as whole tensors, `time_model.library_bytes`)
    bus_bytes_per_s[kind]  = sent bytes per step of all counted collectives (`comm`) / comm_s, for each kind run
                             (kinds under 1% of the sent bytes left out)
    hidden_share[kind]     = (comm_s - exposed_comm_s) / (comm_s x the overlapped kinds' share of sent bytes),
                             for each kind the strategy runs beside compute (`time_model.overlapped`), at most 1
    optimizer_s_per_param  = optimizer_s (for ZeRO: optimizer_update_s, the torch optimizer's step inside DeepSpeed's)
                             / (trainable params / (dp_shard x tp))
    zero_step_s_per_param  = (optimizer_s - optimizer_update_s) / the same, from a DeepSpeed ZeRO run: its step's
                             copies and bookkeeping around the update
    overhead_s             = (data_wait_s + other_s) / gradient_accumulation_steps
    and, since a run's own times already hold them: no collective latency or contention on top of its measured
    bandwidth and compute, no datasheet copies or host work for the libraries (a run of the library measures them)
From the summary's `link_probe` (each kind timed once at the end of the run, `measure.collective_timing`): bus
bandwidth per kind, a source after the run's own figures.
"""
from __future__ import annotations

from pathlib import Path

from ...errors import UsageError
from ...safe_io import load_json
from ...strategy import family, strategy_from_summary
from ...summary import SUMMARY_FILE, upgraded
from ..time_model import gathers, library_bytes, overlapped

# What a run's own times already hold: its measured compute and bandwidths include any latency and contention, and
# a library's run measures its copies and host work (per byte); nothing on top of them.
INSIDE_A_RUN = {"comm_sm_share": 0.0, "latency_s": {}, "copy_s_per_byte": 0.0, "library_host_s": {}}
TERM_OF_KIND = {"all_reduce": "grad_all_reduce", "all_gather": "param_all_gather",
                "reduce_scatter": "grad_reduce_scatter"}
MINOR = 0.01  # kinds below this share of a run's sent bytes get no figure of their own
RUN_STRATEGY = "strategy"  # in a run's figures: the strategy it ran (not a figure; its rows take them first)


def run_sources(path) -> list[tuple[str, dict]]:
    """[(source, figures)] a run folder's summary (or the summary file itself) measured: the run's, then its link
    probe's bus bandwidths when it has one (`figures.calibrate` takes them for the kinds the run did not issue)."""
    path = Path(path)
    summary = path / SUMMARY_FILE if path.is_dir() else path
    doc = upgraded(load_json(summary, "run summary"))
    ran = {RUN_STRATEGY: strategy_from_summary(doc)}  # from_summary refuses a summary without one
    out = [(str(path), {**ran, **from_summary(doc, summary)})]
    probe = doc.get("link_probe") if isinstance(doc, dict) else None
    if probe:
        try:
            out.append((f"{path}'s link probe", {**ran, "bus_bytes_per_s": {
                k: float(v) for k, v in probe["bus_bytes_per_s"].items() if k in TERM_OF_KIND and float(v) > 0}}))
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            raise UsageError(f"--calibrate {summary}: malformed 'link_probe' ({type(error).__name__}: {error})") \
                from None
    return out


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def timed_ranks(doc: dict) -> list[dict]:
    """The summary's ranks that have both a timed step's breakdown and a measured median step."""
    return [r for r in doc.get("ranks") or [] if r.get("time_breakdown") and r.get("step_seconds")]


def scaled_breakdown(ranks: list[dict]) -> dict:
    """The timed step's `time_breakdown`, each part scaled by median plain step / timed step, mean over `ranks`."""
    return {k: mean(r["time_breakdown"][k] * r["step_seconds"]["median"] / r["time_breakdown"]["step_s"]
                    for r in ranks) for k in ranks[0]["time_breakdown"]}


def from_summary(doc, where) -> dict:
    """Figures from a summary (formulas in the module docstring); a summary without them: one UsageError line."""
    try:
        ranks = timed_ranks(doc)
        if not ranks:
            raise UsageError(f"--calibrate {where}: no rank has both 'time_breakdown' and 'step_seconds' (profile "
                             "with a timed step and more than one plain step)")
        strategy = strategy_from_summary(doc)  # the planner's name, as report reads the same summary
        if strategy is None:
            raise UsageError(f"--calibrate {where}: 'strategy' is {doc.get('strategy')!r}, not a strategy name "
                             "(the profiler could not tell the run's strategy)")
        part = scaled_breakdown(ranks)
        accumulation = int(doc.get("gradient_accumulation_steps") or 1)
        out = {"overhead_s": (part["data_wait_s"] + part["other_s"]) / accumulation}
        flops = [r["throughput"]["tflops_per_device"] * 1e12 * r["throughput"]["seconds"] / r["step_seconds"]["steps"]
                 for r in ranks if (r.get("throughput") or {}).get("tflops_per_device")]
        library = part.get("library_s", 0.0) if gathers(strategy) else 0.0  # (older summaries: none)
        compute, forward = part["forward_s"] + part["backward_s"] - library, part["forward_s"]
        matmul = compute - forward if (ranks[0].get("peak_step") or {}).get("gradient_checkpointing") else compute
        if flops and matmul > 0:
            out["flops_per_s"] = mean(flops) / matmul
            out["recompute_share"] = forward / matmul
        out.update(INSIDE_A_RUN)
        mesh = doc.get("mesh") or {}
        moved = mean(library_bytes(counted_sent(r), mesh.get("dp_shard") or 1) for r in ranks)
        if library > 0 and moved > 0:
            out["library_s_per_byte"] = {family(strategy): library / moved}
        out.update(comm_figures(strategy, ranks, part))
        shard = (mesh.get("dp_shard") or 1) * (mesh.get("tp") or 1)
        stepped = (doc["model"].get("trainable_params") or doc["model"]["params_total"]) / shard
        zero = family(strategy) == "deepspeed" and "optimizer_update_s" in part
        update = part["optimizer_update_s"] if zero else part["optimizer_s"]  # without ZeRO: the same phase
        out["optimizer_s_per_param"] = update / stepped
        if zero:
            out["zero_step_s_per_param"] = (part["optimizer_s"] - update) / stepped
        return out
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        raise UsageError(f"--calibrate {where}: malformed summary ({type(error).__name__}: {error})") from None


def counted_sent(rank: dict) -> dict:
    """{collective kind: sent bytes per step} the profiler counted on a rank."""
    return {kind: entry.get("sent_bytes", 0) for kind, entry in (rank.get("comm") or {}).items()
            if isinstance(entry, dict)}


def comm_figures(strategy: str, ranks: list, part: dict) -> dict:
    """Bus bandwidth per kind run, and the hidden share of the kinds this strategy overlaps."""
    sent = {k: mean(counted_sent(r).get(k, 0) for r in ranks) for k in TERM_OF_KIND}
    total = sum(sent.values())
    sent = {k: v for k, v in sent.items() if v > MINOR * total}  # a profiler's or logger's few bytes say nothing
    if not sent or part["comm_s"] <= 0:
        return {}
    total = sum(sent.values())
    out = {"bus_bytes_per_s": dict.fromkeys(sent, total / part["comm_s"])}
    hideable = [k for k in sent if overlapped(strategy, TERM_OF_KIND[k])]
    if hideable:
        share = sum(sent[k] for k in hideable) / total
        hidden = (part["comm_s"] - part["exposed_comm_s"]) / (part["comm_s"] * share)
        out["hidden_share"] = dict.fromkeys(hideable, max(0.0, min(1.0, hidden)))
    return out
