"""Planned beside measured: the planner's row for a run summary's strategy, world size, precision and model next
to each rank's measured bytes and peak (`plan --against`, `report`). Reads the summary (the top-level `summary`)
and plans with plan/; the bridge from a finished run to the planner."""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from ..errors import UsageError
from ..model.spec import ModelSpec, model_spec, resolve_model, spec_from_count
from ..plan.formulas import strategy_row
from ..plan.mesh import LibraryKnobs, Setup, setup_for_mesh
from ..plan.sequence import comm_terms
from ..plan.trace import regime_for
from ..strategy import strategy_record
from ..summary import COMPONENTS, count_or_none, read_summary, run_of, step_shape


def plan_vs_run(summary_path: str | Path, spec: ModelSpec | None = None, setup: Setup | None = None,
                model: str | None = None, knobs: LibraryKnobs | None = None) -> dict:
    """Planner estimate for the summary's strategy, world size, precision and model beside each
    rank's measured bytes: per component planned, measured, rel_diff = (measured - planned)/planned.
    Where a rank's summary has a measured peak (`peak_breakdown`) and its step's shape (`peak_step`), its
    `peak` holds the planned peak of that same step (micro-batch, sequence or image size, checkpointing,
    traced from `model` or the summary's model when it is a local folder or shipped name) beside it. `knobs`: what
    the libraries decide, where the summary does not say (the ZeRO and FSDP settings it holds win)."""
    summary = read_summary(summary_path)
    run = run_of(summary, summary_path)
    strategy, world, nodes = run["strategy"], run["world_size"], run["num_nodes"]
    info = summary.get("model") or {}
    spec, model = _spec_of_run(summary_path, info, spec, model)
    setup = _setup_of_run(summary, run, setup)
    knobs = _knobs_of_run(summary, strategy, knobs or LibraryKnobs())
    row = _with_split_comm(summary, spec, setup, strategy_row(strategy, spec, setup, knobs=knobs))
    planned = {k: getattr(row, k) for k in COMPONENTS}
    planned["model_states_bytes"] = row.model_states_bytes
    if setup.reference_model:
        planned["frozen_models_bytes"] = row.frozen_bytes
    peaks = _PlannedPeaks(strategy, spec, setup, knobs, model)
    ranks = _ranks(summary_path, summary, planned, peaks)
    trainable = info.get("trainable_params")
    planned_peak = next((r["peak"]["planned"]["peak_bytes"] for r in ranks if r["peak"]), row.peak_bytes)
    return {"summary": str(summary_path), "strategy": strategy, "world_size": world, "num_nodes": nodes,
            "mesh": row.mesh.as_dict(), "precision": run["precision"], "model": spec.name,
            "planned_total_bytes": planned_peak,
            "bucket_elements": knobs.bucket_elements, "trace_note": peaks.note,
            "grad_accum_steps": setup.grad_accum_steps, "planned_comm": row.comm,
            "planned_comm_bytes_per_step": row.comm_bytes_per_step,
            "params_total_planned": spec.params_total, "params_total_measured": info.get("params_total"),
            "trainable_params_measured": trainable, "ranks": ranks}


def _with_split_comm(summary: dict, spec: ModelSpec, setup: Setup, row):
    """`row` with a sequence-parallel run's `sp_all_to_all` term, at the whole sequence (the measured step's slice x
    sp) and its micro-batch and checkpointing. (A cp run's summary has not been seen on CPU: torch's context
    parallelism does not run there, so what its step shape records is not assumed here.)"""
    degree = (summary.get("mesh") or {}).get("sp", 1)
    step = next((r["peak_step"] for r in summary["ranks"] if isinstance(r.get("peak_step"), dict)), None)
    if not isinstance(degree, int) or degree < 2 or not step or not isinstance(step.get("seq_len"), int):
        return row
    at = replace(setup, seq_len=step["seq_len"] * degree, micro_batch=int(step.get("micro_batch") or 1),
                 activation_checkpointing=bool(step.get("gradient_checkpointing")))
    terms = comm_terms(spec, at, "sp", degree)
    return replace(row, comm={**row.comm, **terms}, comm_bytes_per_step=row.comm_bytes_per_step + sum(terms.values()))


def _spec_of_run(summary_path, info: dict, spec: ModelSpec | None, model: str | None) -> tuple[ModelSpec, str | None]:
    """The run's model: `spec` if given, else its config (a local folder or shipped name) or its parameter count."""
    if spec is None:
        source = info.get("name_or_path")
        if source and (os.path.isdir(source) or resolve_model(source) != source):
            spec, model = model_spec(source), model or source
        elif info.get("params_total"):
            spec = spec_from_count(info["params_total"])
        else:
            raise UsageError(f"summary '{summary_path}': key 'model.name_or_path' is not a local folder; "
                             f"pass --model")
    return spec, model


def _setup_of_run(summary: dict, run: dict, setup: Setup | None) -> Setup:
    """The Setup the run was (`summary.run_of`): its GPUs, precision, accumulation, TP mesh and whether it held a
    frozen reference model."""
    world, nodes = run["world_size"], run["num_nodes"]
    setup = replace(setup or Setup(), gpus_per_node=max(1, world // nodes), nodes=nodes, precision=run["precision"])
    setup = replace(setup, grad_accum_steps=run["grad_accum_steps"] or setup.grad_accum_steps)
    if run["mesh"]:
        _, setup = setup_for_mesh(setup, run["mesh"])
    # A run that held a frozen copy of the model (DPO's reference) is planned with one: compared as its own part.
    return replace(setup, reference_model=all(v is not None for v in _references(summary)))


def _knobs_of_run(summary: dict, strategy: str, knobs: LibraryKnobs) -> LibraryKnobs:
    """`knobs` with the ZeRO / FSDP settings the run's profiler read (`strategy_detail`)."""
    detail, record = summary.get("strategy_detail") or {}, strategy_record(strategy)
    if record.zero_stage == 3 and isinstance(detail.get("stage3_param_persistence_threshold"), (int, float)):
        knobs = replace(knobs, zero3_persistence_threshold=int(detail["stage3_param_persistence_threshold"]))
    if record.zero_stage == 3 and count_or_none(detail.get("stage3_max_reuse_distance")) is not None:
        knobs = replace(knobs, zero3_max_reuse_distance=int(detail["stage3_max_reuse_distance"]))
    if record.family == "fsdp" and detail.get("fsdp_version") in (1, 2, "1", "2"):
        knobs = replace(knobs, fsdp_version=int(detail["fsdp_version"]))
    if record.family == "deepspeed":  # the buckets the run's ZeRO optimizer was built with (the profiler reads them)
        if count_or_none(detail.get("reduce_bucket_size")):
            knobs = replace(knobs, bucket_elements=detail["reduce_bucket_size"])
        if isinstance(detail.get("overlap_comm"), bool):
            knobs = replace(knobs, zero_overlap_comm=detail["overlap_comm"])
    return knobs


def _references(summary: dict) -> list:
    """Per rank, the bytes of the frozen reference model it held (DPO's), or None."""
    return [count_or_none((r.get("frozen_models") or {}).get("reference")) for r in summary["ranks"]]


def _ranks(summary_path, summary: dict, planned: dict, peaks: "_PlannedPeaks") -> list[dict]:
    """Per rank: each planned component beside the measured one, and the planned peak of its measured step."""
    ranks = []
    for i, (rank, frozen) in enumerate(zip(summary["ranks"], _references(summary))):
        measured = {k: rank[k] for k in COMPONENTS}
        measured["model_states_bytes"] = sum(measured.values())
        if "frozen_models_bytes" in planned:
            measured["frozen_models_bytes"] = frozen
        ranks.append({"rank": rank.get("rank"), "components": [
            {"component": k, "planned": planned[k], "measured": measured[k],
             "rel_diff": (measured[k] - planned[k]) / planned[k] if planned[k] else None} for k in planned],
            "peak_memory_bytes": rank.get("peak_memory_bytes"), "memory_kind": rank.get("memory_kind"),
            "comm_sent_bytes_per_step": rank.get("comm_sent_bytes_per_step"), "comm": rank.get("comm"),
            "peak": peaks.beside(rank, f"summary '{summary_path}': key 'ranks[{i}].peak_step'")})
    return ranks


class _PlannedPeaks:
    """The planned peak of each step shape a run's ranks measured (traced once per shape)."""

    def __init__(self, strategy: str, spec: ModelSpec, setup: Setup, knobs: LibraryKnobs, model: str | None):
        self.strategy, self.spec, self.setup, self.knobs, self.model = strategy, spec, setup, knobs, model
        self.rows, self.note = {}, None

    def beside(self, rank: dict, where: str) -> dict | None:
        """{step, planned {peak_bytes, peak_breakdown, peak_phase, activations_source}, measured {peak_tensor_bytes,
        peak_breakdown, peak_phase}, error = (planned - measured) / measured (as the 5% bound reads)}, or None
        when the rank has no measured peak or step shape."""
        breakdown = rank.get("peak_breakdown")
        if not isinstance(breakdown, dict) or count_or_none(rank.get("peak_tensor_bytes")) is None:
            return None
        shape = step_shape(rank, where)
        if shape is None:
            return None
        key = tuple(shape.values())
        if key not in self.rows:
            setup = replace(self.setup, micro_batch=shape["micro_batch"], image_size=shape["image_size"],
                            activation_checkpointing=bool(shape["gradient_checkpointing"]),
                            seq_len=self.setup.seq_len if shape["seq_len"] is None else shape["seq_len"])
            traces = {}
            if self.model:
                from ..plan.trace_cache import cached_traces_for

                traces, self.note = cached_traces_for(self.model, setup)
            else:
                self.note = "no model config to trace: activations from the formula (approximate)"
            self.rows[key] = strategy_row(self.strategy, self.spec, setup, knobs=self.knobs,
                                          trace=traces.get(regime_for(self.strategy, setup.precision)))
        row, measured = self.rows[key], rank["peak_tensor_bytes"]
        return {"step": shape, "planned": {k: getattr(row, k) for k in ("peak_bytes", "peak_breakdown", "peak_phase",
                                                                         "activations_source")},
                "measured": {"peak_tensor_bytes": measured, "peak_breakdown": breakdown,
                             "peak_phase": rank.get("peak_phase")},
                "error": (row.peak_bytes - measured) / measured if measured else None}

