"""`shardscope plan`'s answers: a row per strategy, which fits, which to use, and planned vs measured.

Reads top-down: model spec (`model_spec`) -> mesh (`mesh`) -> bytes per strategy (`formulas`) ->
rows, `fits`, `recommend` (here) -> printing (`plan_cli`). Nothing here imports the Trainer or loads a
weight. Sizes are bytes per GPU; GPU capacities are GiB (2**30).
"""
from __future__ import annotations

import os
from dataclasses import asdict, replace
from pathlib import Path

from .errors import UsageError
from .formulas import Row, activation_bytes, counts, strategy_row
from .mesh import Setup, setup_for_mesh, tp_degree
from .model_spec import ModelSpec, live_config, model_spec, resolve_model, spec_from_config, spec_from_count
from .step_trace import regime_for, traces_for
from .strategy import PRECISION_ALIASES, PRECISIONS, STRATEGIES, TP_STRATEGIES, family, strategy_from_summary
from .summary import COMPONENTS, read_summary
from .units import gb, gpu_size

__all__ = ["Setup", "model_spec", "strategy_row", "estimate", "recommend", "plan_vs_run", "convention_table"]

TIERS = (("ddp",), ("fsdp_shard_grad_op", "zero2"), ("fsdp_hybrid_shard",), ("fsdp_full_shard", "zero3"),
         ("hsdp_tp",), ("tp",), ("fsdp_tp",), ("zero2_offload",), ("fsdp_offload", "zero3_offload"))


def usable_bytes(setup: Setup) -> float | None:
    """GPU memory left for the run once `setup.headroom` is kept free (None: no GPU memory given)."""
    return None if setup.gpu_memory_bytes is None else setup.gpu_memory_bytes * (1 - setup.headroom)


def fit_rule(setup: Setup) -> str:
    """The fit rule in words, as `plan` prints it."""
    return (f"fits: peak <= {1 - setup.headroom:g} x GPU memory, the {setup.headroom:.0%} left for the CUDA caching "
            "allocator's fragmentation, the CUDA context and NCCL buffers (--headroom; docs/planner.md)")


def fits(row: Row, setup: Setup) -> bool | None:
    """Whether the row fits the usable GPU memory (and, for offload rows, the given CPU memory)."""
    usable = usable_bytes(setup)
    if usable is None:
        return None
    cpu_ok = setup.cpu_memory_bytes is None or row.cpu_bytes * setup.gpus_per_node <= setup.cpu_memory_bytes
    return row.peak_bytes <= usable and cpu_ok


def recommend(rows: list[Row], setup: Setup) -> dict:
    """The fastest strategy that fits with headroom, in the order DDP -> ZeRO-2/SHARD_GRAD_OP ->
    (HYBRID_SHARD on several nodes) -> ZeRO-3/FULL_SHARD -> (HSDP x TP on several nodes) -> TP
    (when it spans all the GPUs: world = t) -> FSDP x TP -> ZeRO-2 offload -> ZeRO-3/FSDP offload;
    within a tier `setup.prefer` ("fsdp" or "deepspeed") goes first. TP comes after full sharding:
    FSDP over the same N ranks already divides the model states by N; what TP adds is smaller
    activations (the attention/MLP internals / t) and smaller gathered units (/ t), for per-layer
    all-reduces of the activations. The TP rows are skipped at degree 1 (absent without a TP plan)."""
    if setup.gpu_memory_bytes is None:
        return {"strategy": None, "reason": "no GPU memory given (--gpu NAME or --gpu-memory SIZE)"}
    by_name = {r.strategy: r for r in rows}
    usable = usable_bytes(setup)
    tried = []
    for tier in TIERS:
        if tier == ("fsdp_hybrid_shard",) and setup.nodes == 1:
            continue  # one node: identical to full shard
        if tier[0] in TP_STRATEGIES:
            row = by_name.get(tier[0])
            if row is None or row.mesh["tp"] == 1:  # estimate() leaves out rows that repeat a mesh
                continue
            if tier == ("tp",) and row.mesh["tp"] != setup.world_size:
                continue  # TP alone uses t GPUs of one node, not all of them
        names = sorted(tier, key=lambda s: family(s) != setup.prefer)
        for name in names:
            row = by_name[name]
            if row.fits:
                why = (f"{name} needs {gb(row.total_bytes)} GB per GPU of {gb(usable)} GB usable "
                       f"= {gpu_size(setup.gpu_memory_bytes)} less {setup.headroom:.0%} headroom")
                if name in TP_STRATEGIES:
                    mesh = row.mesh
                    why += (f", tensor parallel {mesh['tp']} x FSDP {mesh['dp_shard']}"
                            + (f" x replicas {mesh['dp_replicate']}" if mesh["dp_replicate"] > 1 else ""))
                if tried:
                    why += "; faster options do not fit: " + ", ".join(tried)
                return {"strategy": name, "reason": why, "not_chosen": not_chosen(name, tier, rows, setup)}
            tried.append(f"{name} {gb(row.total_bytes)} GB")
    hint = "" if setup.activation_checkpointing else ", activation checkpointing"
    return {"strategy": None, "reason": f"nothing fits in {gb(usable)} GB usable per GPU; try more GPUs, "
                                         f"a smaller micro-batch{hint} or LoRA"}


def not_chosen(pick: str, tier: tuple, rows: list[Row], setup: Setup) -> dict:
    """One line each on why a fitting alternative lost: the other strategy of the pick's tier, and the
    TP rows (degree > 1) that fit."""
    out = {}
    for row in rows:
        if row.strategy == pick or not row.fits:
            continue
        if row.strategy in tier:
            out[row.strategy] = (f"fits too ({gb(row.total_bytes)} GB), same tier of the decision tree; "
                                 f"--prefer {setup.prefer}{' (the default)' * (setup.prefer == 'fsdp')} "
                                 f"puts {pick} first")
        elif row.strategy in TP_STRATEGIES and row.mesh["tp"] > 1:
            out[row.strategy] = (f"fits too ({gb(row.total_bytes)} GB) but ranks after sharding: FSDP over the "
                                 f"same GPUs divides model states as well, and TP all-reduces activations in "
                                 f"every layer; pick it when activations or gathered layers do not fit")
    return out


def estimate(spec: ModelSpec, setup: Setup, traces: dict | None = None) -> dict:
    """Rows for every strategy, the recommendation, and what they were computed from. `traces`: compute
    regime -> step_trace.StepTrace (see `step_trace.regime_for`); without one a row's activations come
    from the formula and are approximate."""
    setup.validate()
    c = counts(spec, setup)
    act = activation_bytes(spec, setup)
    notes = []
    if spec.tp_plan:
        t = tp_degree(spec, setup)
        act_tp = activation_bytes(spec, setup, t)
        # fsdp_tp is tp when tp spans every GPU, hsdp_tp is fsdp_tp on one node: show each mesh once
        same = {"fsdp_tp": setup.world_size == t, "hsdp_tp": setup.nodes == 1}
        strategies = tuple(s for s in STRATEGIES if not same.get(s))
        if any(same.values()):
            notes.append("rows " + " and ".join(s for s, dup in same.items() if dup) + " left out: on this setup "
                         "their mesh is the one of the row above them")
        kv = spec.num_kv_heads or spec.num_heads
        assumed = " assumed" if any(a.startswith("heads=") for a in spec.assumed) else ""
        tp_info = {"degree": t, "source": "--tp" if setup.tp_size is not None else
                   f"default: gcd(GPUs per node {setup.gpus_per_node}, heads{assumed} {spec.num_heads}, "
                   f"KV heads {kv}) = {t}" + ("; give --heads or --tp" if assumed and t == 1 else ""),
                   "activations": act_tp, "approximate": not c.tensors}
        if not c.tensors:
            notes.append("tp/fsdp_tp/hsdp_tp rows from --params are approximate: totals / (tp x dp_shard)")
        if spec.tp_note:
            notes.append(spec.tp_note)
    else:
        if setup.tp_size is not None:
            tp_degree(spec, setup)  # raises: no plan
        strategies = tuple(s for s in STRATEGIES if s not in TP_STRATEGIES)
        tp_info, act_tp = None, None
        notes.append(f"no tp/fsdp_tp/hsdp_tp rows: {spec.tp_note}")
    if setup.precision == "bf16-pure":
        notes.append("DeepSpeed has no pure-bf16 mode (ZeRO keeps an fp32 master copy whenever bf16 is on): "
                     "zero* rows are planned as bf16-mixed")
    if spec.num_experts:
        notes.append(moe_note(spec))
    traces = traces or {}
    rows = [strategy_row(s, spec, setup, c, (act_tp if s in TP_STRATEGIES else act)["total"],
                         traces.get(regime_for(s, setup.precision))) for s in strategies]
    for row in rows:
        row.fits = fits(row, setup)
    return {
        "rows": [asdict(r) for r in rows],
        "recommendation": recommend(rows, setup),
        "model": {"name": spec.name, "params_total": c.total, "trainable_params": c.trainable,
                  "exact": spec.exact, "assumed": list(spec.assumed), "largest_layer_params": spec.largest_layer_params,
                  "largest_unit_params": max(c.units), "hidden_size": spec.hidden_size, "num_layers": spec.num_layers,
                  "vocab_size": spec.vocab_size, "tied_embeddings": spec.tied_embeddings,
                  **({"params_active": spec.params_active, "num_experts": spec.num_experts,
                      "experts_per_token": spec.experts_per_token} if spec.num_experts else {})},
        "setup": {**asdict(setup), "world_size": setup.world_size},
        "activations": act,
        "tp": tp_info,
        "notes": ["model states (params, grads, optimizer) are exact counts; " + (
                      "activations and temporaries traced from the model's code on fake tensors (step_trace)"
                      if traces else "activations from a written-out formula: approximate"),
                  "peak_bytes: the worst moment of a step (forward, backward or optimizer step), not the sum of "
                  "everything; see docs/planner.md",
                  "optimizer_bytes includes fp32 master weights; bytes per GPU; see docs/planner.md",
                  "comm_bytes_per_step is computed from ring-collective formulas (held within 5% of the collectives the "
                  "profiler counts on 2-rank runs; see docs/planner.md)", *notes],
    }


def moe_note(spec: ModelSpec) -> str:
    """What a mixture of experts changes: memory holds every expert; ZeRO-3 and the experts' modules."""
    note = (f"mixture of experts: every GPU's model states hold all {spec.num_experts} experts per layer "
            f"({spec.params_total:,} params) though a token uses {spec.experts_per_token} "
            f"({spec.params_active:,} active); ZeRO-3: ")
    if spec.zero3_leaf_module:
        return note + (f"mark {spec.zero3_leaf_module} a leaf module (accelerate yaml deepspeed_config: "
                       f"deepspeed_moe_layer_cls_names: {spec.zero3_leaf_module}, or deepspeed.utils."
                       "set_z3_leaf_modules), else ranks routing tokens to different experts fetch different "
                       "modules and the step can hang")
    return note + ("this transformers keeps a layer's experts in one fused module, gathered whole in each forward, "
                   "so no leaf-module setting is needed (deepspeed_moe_layer_cls_names is for per-expert modules)")


def convention_table(params: float = 7e9, gpus: int = 4) -> dict:
    """The 12 B/param rule of thumb (2 weights + 2 grads + 8 Adam moments) beside the planner's
    16 B/param (+4 B fp32 master weights), model states only, per GPU:
        none = (p+g+k)*P;  ZeRO-1 = (p+g)*P + k*P/N;  ZeRO-2 = p*P + (g+k)*P/N;  ZeRO-3 = (p+g+k)*P/N
    7e9 on 4 GPUs: 84 / 42 / 31.5 / 21 GB (k=8) and 112 / 49 / 38.5 / 28 GB (k=12)."""
    def row(p, g, k):
        return {"none": (p + g + k) * params, "zero1": (p + g) * params + k * params / gpus,
                "zero2": p * params + (g + k) * params / gpus, "zero3": (p + g + k) * params / gpus}
    return {"params": params, "gpus": gpus,
            "rule-of-thumb-12": {"bytes_per_param": "2+2+8", **row(2, 2, 8)},
            "planner-16": {"bytes_per_param": "2+2+12", **row(2, 2, 12)},
            "explanation": ("the 12 B/param rule of thumb leaves out the 4 B fp32 master copy of the weights that "
                            "mixed-precision Adam updates (bf16 alone cannot hold small updates); the ZeRO "
                            "paper's K=12 is 4 master + 4 momentum + 4 variance, so 2+2+12 = 16 B/param, "
                            "18 with fp32 gradients. Sharded terms differ by 4 B x P/N.")}


def plan_vs_run(summary_path: str | Path, spec: ModelSpec | None = None, setup: Setup | None = None,
                model: str | None = None) -> dict:
    """Planner estimate for the summary's strategy, world size, precision and model beside each
    rank's measured bytes: per component planned, measured, rel_diff = (measured - planned)/planned.
    Where a rank's summary has a measured peak (`peak_breakdown`) and its step's shape (`peak_step`), its
    `peak` holds the planned peak of that same step (micro-batch, sequence or image size, checkpointing,
    traced from `model` or the summary's model when it is a local folder or shipped name) beside it."""
    summary = read_summary(summary_path)
    strategy = strategy_from_summary(summary)
    if strategy is None:
        raise UsageError(f"summary '{summary_path}': key 'strategy' ({summary['strategy']!r}) is not one of "
                         f"{', '.join(STRATEGIES)}")
    world, nodes = int(summary["world_size"]), int(summary.get("num_nodes") or 1)
    precision = PRECISION_ALIASES.get(str(summary.get("precision", "fp32")).lower())
    if precision is None:
        raise UsageError(f"summary '{summary_path}': key 'precision' ({summary.get('precision')!r}) is not one of "
                         f"{', '.join(PRECISIONS)}")
    info = summary.get("model") or {}
    if spec is None:
        source = info.get("name_or_path")
        if source and (os.path.isdir(source) or resolve_model(source) != source):
            spec, model = model_spec(source), model or source
        elif info.get("params_total"):
            spec = spec_from_count(info["params_total"])
        else:
            raise UsageError(f"summary '{summary_path}': key 'model.name_or_path' is not a local folder; "
                             f"pass --model")
    setup = replace(setup or Setup(), gpus_per_node=max(1, world // nodes), nodes=nodes, precision=precision)
    accum = summary.get("gradient_accumulation_steps", setup.grad_accum_steps)
    if not isinstance(accum, int) or isinstance(accum, bool) or accum < 1:
        raise UsageError(f"summary '{summary_path}': key 'gradient_accumulation_steps' must be a positive integer, "
                         f"got {accum!r}")
    setup = replace(setup, grad_accum_steps=accum)
    mesh = summary.get("mesh")
    if strategy in TP_STRATEGIES:
        if not isinstance(mesh, dict) or not all(isinstance(mesh.get(k), int) and mesh[k] >= 1
                                                 for k in ("dp_replicate", "dp_shard", "tp")):
            raise UsageError(f"summary '{summary_path}': key 'mesh' must give positive integers dp_replicate, "
                             f"dp_shard and tp for strategy {strategy}, got {mesh!r}")
        degrees = mesh["dp_replicate"] * mesh["dp_shard"] * mesh["tp"]
        if degrees != world:
            raise UsageError(f"summary '{summary_path}': key 'mesh' ({mesh['dp_replicate']} x {mesh['dp_shard']} x "
                             f"{mesh['tp']} = {degrees}) disagrees with world_size {world}")
        by_mesh, setup = setup_for_mesh(setup, mesh)
        if by_mesh != strategy:
            raise UsageError(f"summary '{summary_path}': key 'strategy' ({strategy}) disagrees with key 'mesh' "
                             f"{mesh} (which is {by_mesh})")
    detail = summary.get("strategy_detail") or {}
    if strategy.startswith("zero3") and isinstance(detail.get("stage3_param_persistence_threshold"), (int, float)):
        setup = replace(setup, zero3_persistence_threshold=int(detail["stage3_param_persistence_threshold"]))
    if strategy.startswith("fsdp") and detail.get("fsdp_version") in (1, 2, "1", "2"):
        setup = replace(setup, fsdp_version=int(detail["fsdp_version"]))
    if strategy.startswith("zero"):  # the buckets the run's ZeRO optimizer was built with (the profiler reads them)
        if _count_or_none(detail.get("reduce_bucket_size")):
            setup = replace(setup, bucket_elements=detail["reduce_bucket_size"])
        if isinstance(detail.get("overlap_comm"), bool):
            setup = replace(setup, zero_overlap_comm=detail["overlap_comm"])
    # A run that held a frozen copy of the model (DPO's reference) is planned with one: compared as its own part.
    reference = [_count_or_none((r.get("frozen_models") or {}).get("reference")) for r in summary["ranks"]]
    setup = replace(setup, reference_model=all(v is not None for v in reference))
    row = strategy_row(strategy, spec, setup)
    planned = {k: getattr(row, k) for k in COMPONENTS}
    planned["model_states_bytes"] = row.model_states_bytes
    if setup.reference_model:
        planned["frozen_models_bytes"] = row.frozen_bytes
    ranks, peaks = [], _PlannedPeaks(strategy, spec, setup, model)
    for i, (rank, frozen) in enumerate(zip(summary["ranks"], reference)):
        measured = {k: rank[k] for k in COMPONENTS}
        measured["model_states_bytes"] = sum(measured.values())
        if setup.reference_model:
            measured["frozen_models_bytes"] = frozen
        ranks.append({"rank": rank.get("rank"), "components": [
            {"component": k, "planned": planned[k], "measured": measured[k],
             "rel_diff": (measured[k] - planned[k]) / planned[k] if planned[k] else None} for k in planned],
            "peak_memory_bytes": rank.get("peak_memory_bytes"), "memory_kind": rank.get("memory_kind"),
            "comm_sent_bytes_per_step": rank.get("comm_sent_bytes_per_step"), "comm": rank.get("comm"),
            "peak": peaks.beside(rank, f"summary '{summary_path}': key 'ranks[{i}].peak_step'")})
    trainable = info.get("trainable_params")
    planned_peak = next((r["peak"]["planned"]["peak_bytes"] for r in ranks if r["peak"]), row.total_bytes)
    return {"summary": str(summary_path), "strategy": strategy, "world_size": world, "num_nodes": nodes,
            "mesh": row.mesh, "precision": precision, "model": spec.name, "planned_total_bytes": planned_peak,
            "bucket_elements": setup.bucket_elements, "trace_note": peaks.note,
            "grad_accum_steps": setup.grad_accum_steps, "planned_comm": row.comm,
            "planned_comm_bytes_per_step": row.comm_bytes_per_step,
            "params_total_planned": spec.params_total, "params_total_measured": info.get("params_total"),
            "trainable_params_measured": trainable, "ranks": ranks}


class _PlannedPeaks:
    """The planned peak of each step shape a run's ranks measured (traced once per shape)."""

    def __init__(self, strategy: str, spec: ModelSpec, setup: Setup, model: str | None):
        self.strategy, self.spec, self.setup, self.model, self.rows, self.note = strategy, spec, setup, model, {}, None

    def beside(self, rank: dict, where: str) -> dict | None:
        """{step, planned {peak_bytes, peak_breakdown, peak_phase, activations_source}, measured {peak_tensor_bytes,
        peak_breakdown, peak_phase}, error = (planned - measured) / measured (as the 5% bound reads)}, or None
        when the rank has no measured peak or step shape."""
        step, breakdown = rank.get("peak_step"), rank.get("peak_breakdown")
        if step is None or not isinstance(breakdown, dict) or _count_or_none(rank.get("peak_tensor_bytes")) is None:
            return None
        shape = {k: step.get(k) if isinstance(step, dict) else None
                 for k in ("micro_batch", "seq_len", "image_size", "gradient_checkpointing")}
        if not _count_or_none(shape["micro_batch"]) or not all(
                v is None or _count_or_none(v) is not None for v in (shape["seq_len"], shape["image_size"])):
            raise UsageError(f"{where} must give a positive integer micro_batch and non-negative integers (or null) "
                             f"seq_len and image_size, got {step!r}")
        key = tuple(shape.values())
        if key not in self.rows:
            setup = replace(self.setup, micro_batch=shape["micro_batch"], image_size=shape["image_size"],
                            activation_checkpointing=bool(shape["gradient_checkpointing"]),
                            seq_len=self.setup.seq_len if shape["seq_len"] is None else shape["seq_len"])
            traces = {}
            if self.model:
                from .trace_cache import cached_traces_for

                traces, self.note = cached_traces_for(self.model, setup)
            else:
                self.note = "no model config to trace: activations from the formula (approximate)"
            self.rows[key] = strategy_row(self.strategy, self.spec, setup,
                                          trace=traces.get(regime_for(self.strategy, setup.precision)))
        row, measured = self.rows[key], rank["peak_tensor_bytes"]
        return {"step": shape, "planned": {k: getattr(row, k) for k in ("peak_bytes", "peak_breakdown", "peak_phase",
                                                                         "activations_source")},
                "measured": {"peak_tensor_bytes": measured, "peak_breakdown": breakdown,
                             "peak_phase": rank.get("peak_phase")},
                "error": (row.peak_bytes - measured) / measured if measured else None}


def _count_or_none(value):
    """A byte count read from a summary, or None (missing, not a number)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def preflight_plan(model, strategy: str | None, mesh: dict | None, world: int, nodes: int, precision: str | None,
                   gpu_memory_bytes: int, inputs: dict | None = None) -> dict | None:
    """The planner's row for a live run as its first training batch goes in: its strategy, world size, precision
    ("bf16", "fp16", "fp32"), TP mesh, LoRA adapters and checkpointing, and the batch's shape (`inputs`: the
    forward's keyword arguments, input_ids or pixel_values). The step is traced at that shape as `plan --model`
    traces it (`step_trace.traces_for`; a fake-tensor trace costs the same at any micro-batch); where tracing
    fails the row's `activations_source` says approximate, and without a batch (no inputs) the plan is model
    states and buffers only, a lower bound.
    {strategy, peak_bytes, total_bytes, peak_phase, activations_source, micro_batch, seq_len, fits,
    gpu_memory_bytes, usable_bytes, recommendation, warning (when it does not fit)}, or None for a strategy it
    has no row for."""
    from .peak import step_shape

    config, lora = live_config(model)
    shape = step_shape(model, (), inputs or {})
    setup = Setup(gpus_per_node=max(1, world // nodes), nodes=nodes, gpu_memory_bytes=gpu_memory_bytes,
                  precision={"bf16": "bf16-mixed", "fp16": "fp16-mixed"}.get(precision, "fp32"),
                  micro_batch=shape["micro_batch"] or 1, seq_len=shape["seq_len"] or 0,
                  image_size=shape["image_size"], activation_checkpointing=shape["gradient_checkpointing"], **lora)
    if mesh and mesh.get("tp", 1) > 1:
        strategy, setup = setup_for_mesh(setup, mesh)
    batch = shape["micro_batch"] is not None
    plan = estimate(spec_from_config(config), setup, traces_for(config, setup)[0] if batch else None)
    row = next((r for r in plan["rows"] if r["strategy"] == strategy), None)
    if row is None:
        return None
    usable, best = usable_bytes(setup), plan["recommendation"]
    out = {"strategy": strategy, "peak_bytes": row["peak_bytes"], "total_bytes": row["total_bytes"],
           "peak_phase": row["peak_phase"], "activations_source": row["activations_source"],
           "micro_batch": setup.micro_batch, "seq_len": setup.seq_len, "fits": row["fits"],
           "gpu_memory_bytes": setup.gpu_memory_bytes, "usable_bytes": int(usable), "recommendation": best}
    if row["fits"] is False:
        out["warning"] = (f"the planner's peak for {strategy} at micro-batch {setup.micro_batch} is "
                          f"{gb(row['peak_bytes'])} GB per GPU ({row['peak_phase']}; activations "
                          f"{row['activations_source']}), more than the {gb(usable)} GB usable on this GPU; "
                          f"recommended: {best['strategy']} ({best['reason']})")
    return out
