"""`shardscope plan`'s answers: a row per strategy, which fits, which to use.

Reads top-down: model spec (`model.spec`) -> mesh (`mesh`) -> bytes per strategy (`formulas`) ->
rows, `fits`, `recommend` (here) -> printing (`cli.plan`); planned beside measured is report/'s
`plan_vs_run`. Nothing here imports the Trainer or loads a weight. Sizes are bytes per GPU; GPU capacities are GiB (2**30).
"""
from __future__ import annotations

from .formulas import Row, activation_bytes, counts, strategy_row
from .mesh import LibraryKnobs, Setup, row_meshes, run_dict, tp_mesh, tp_rows
from ..model.spec import ModelSpec, model_spec
from .trace import regime_for
from ..strategy import STRATEGIES, TP_STRATEGIES, simplicity_order, strategy_record, tier
from ..units import gb, gpu_size

__all__ = ["Setup", "LibraryKnobs", "model_spec", "strategy_row", "estimate", "plan_dict", "recommend",
           "convention_table"]

def usable_bytes(setup: Setup) -> float | None:
    """GPU memory left for the run once `setup.headroom` is kept free (None: no GPU memory given)."""
    return None if setup.gpu_memory_bytes is None else setup.gpu_memory_bytes * (1 - setup.headroom)


def fit_rule(setup: Setup) -> str:
    """The fit rule in words, as `plan` prints it."""
    return (f"fits: peak <= {1 - setup.headroom:g} x GPU memory, the {setup.headroom:.0%} left for the CUDA caching "
            "allocator's fragmentation, the CUDA context and NCCL buffers (--headroom; docs/planner.md)")


def host_fits(cpu_bytes: int, setup: Setup) -> bool | None:
    """Whether a row's CPU bytes (offload), for every GPU of a node, fit the host memory given; None when no host
    memory was given. `plan` shows such a row as fitting (unchecked); `fit` never picks it (fit/search.py)."""
    if setup.cpu_memory_bytes is None:
        return None
    return cpu_bytes * setup.gpus_per_node <= setup.cpu_memory_bytes


def fits(row: Row, setup: Setup) -> bool | None:
    """Whether the row fits the usable GPU memory (and, for offload rows, the given CPU memory)."""
    usable = usable_bytes(setup)
    if usable is None:
        return None
    return row.peak_bytes <= usable and host_fits(row.cpu_bytes, setup) is not False


def recommend(rows: list[Row], setup: Setup) -> dict:
    """The fastest strategy that fits with headroom, in the registry's simplicity order (strategy.py's
    `simplicity_order`): DDP -> ZeRO-2/SHARD_GRAD_OP -> ZeRO-1 (whole gradients on every GPU: it fits where
    ZeRO-2 fits) -> (HYBRID_SHARD on several nodes) -> ZeRO-3/FULL_SHARD -> (HSDP x TP on several nodes) -> TP
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
    for name in simplicity_order(setup.prefer):
        row = by_name.get(name)
        if row is None or strategy_record(name).repeats(row.mesh) or (
                name in TP_STRATEGIES and name not in chosen_tp_rows(setup, row.mesh.tp)):
            continue  # hybrid on one node is full shard; the TP rows a run on every GPU can use
        if row.fits:
            why = (f"{name} needs {gb(row.peak_bytes)} GB per GPU of {gb(usable)} GB usable "
                   f"= {gpu_size(setup.gpu_memory_bytes)} less {setup.headroom:.0%} headroom")
            if name in TP_STRATEGIES:
                mesh = row.mesh
                why += (f", tensor parallel {mesh.tp} x FSDP {mesh.dp_shard}"
                        + (f" x replicas {mesh.dp_replicate}" if mesh.dp_replicate > 1 else ""))
            if tried:
                why += "; faster options do not fit: " + ", ".join(tried)
            return {"strategy": name, "reason": why, "not_chosen": not_chosen(name, tier(name), rows, setup)}
        tried.append(f"{name} {gb(row.peak_bytes)} GB")
    hint = "" if setup.activation_checkpointing else ", activation checkpointing"
    return {"strategy": None, "reason": f"nothing fits in {gb(usable)} GB usable per GPU; try more GPUs, "
                                         f"a smaller micro-batch{hint} or LoRA"}


def chosen_tp_rows(setup: Setup, t: int, strategies=TP_STRATEGIES) -> tuple[str, ...]:
    """The TP rows (`mesh.tp_rows`) a run on every GPU can use at degree t (what `recommend` picks from and `fit`
    searches): none at t = 1 (they repeat ddp / fsdp) or where t does not divide the GPUs per node (a TP group
    stays in one node), and only those whose mesh spans every GPU (tp alone where t is the world: elsewhere it leaves
    GPUs idle)."""
    if t < 2 or setup.gpus_per_node % t:
        return ()
    return tuple(s for s in tp_rows(setup, t, strategies) if tp_mesh(s, setup, t).ranks == setup.world_size)


def not_chosen(pick: str, tier: tuple, rows: list[Row], setup: Setup) -> dict:
    """One line each on why a fitting alternative lost: the other strategy of the pick's tier, and the
    TP rows a run on every GPU can use (`chosen_tp_rows`) that fit."""
    out = {}
    for row in rows:
        if row.strategy == pick or not row.fits:
            continue
        if row.strategy in tier:
            out[row.strategy] = (f"fits too ({gb(row.peak_bytes)} GB), same tier of the decision tree; "
                                 f"--prefer {setup.prefer}{' (the default)' * (setup.prefer == 'fsdp')} "
                                 f"puts {pick} first")
        elif row.strategy in chosen_tp_rows(setup, row.mesh.tp):
            out[row.strategy] = (f"fits too ({gb(row.peak_bytes)} GB) but ranks after sharding: FSDP over the "
                                 f"same GPUs divides model states as well, and TP all-reduces activations in "
                                 f"every layer; pick it when activations or gathered layers do not fit")
    return out


class Note(str):
    """A note of `estimate`: its text (what --json writes) and its kind: "footnoted" when the printed table's
    footnotes already say it, else "note"."""

    def __new__(cls, text: str, kind: str = "note"):
        note = super().__new__(cls, text)
        note.kind = kind
        return note


def estimate(spec: ModelSpec, setup: Setup, traces: dict | None = None, knobs: LibraryKnobs | None = None) -> dict:
    """Rows (`Row` objects) for every strategy, the recommendation, and what they were computed from; `plan_dict`
    writes it as --json does. `traces`: compute regime -> plan.trace.StepTrace (see `plan.trace.regime_for`);
    without one a row's activations come from the formula and are approximate. `knobs`: what the libraries decide
    (their defaults when None). The run goes down once: the rows' meshes (mesh), their bytes (formulas), then
    which fit and which to use (here)."""
    setup.validate()
    knobs = knobs or LibraryKnobs()
    meshes = row_meshes(spec, setup, STRATEGIES)
    c = counts(spec, setup)
    act = activation_bytes(spec, setup)
    t = next((mesh.tp for s, mesh in meshes.items() if s in TP_STRATEGIES), None)
    act_tp = activation_bytes(spec, setup, t) if t else None
    traces = traces or {}
    rows = [strategy_row(s, spec, setup, c, (act_tp if s in TP_STRATEGIES else act)["total"],
                         traces.get(regime_for(s, setup.precision)), knobs=knobs, mesh=mesh)
            for s, mesh in meshes.items()]
    for row in rows:
        row.fits = fits(row, setup)
    tp_info = _tp_facts(spec, setup, t, act_tp, c) if t else None
    return {
        "rows": rows,
        "recommendation": recommend(rows, setup),
        "model": _model_facts(spec, c),
        "setup": setup,
        "knobs": knobs,
        "activations": act,
        "tp": tp_info,
        "notes": [*_standing_notes(bool(traces)), *_notes(spec, setup, meshes, c)],
    }


def plan_dict(result: dict) -> dict:
    """`estimate`'s result as --json writes it: each row's `as_dict`, the run as one dict (`mesh.run_dict`: the
    user's fields and the libraries'), the rest as it is."""
    out = {key: value for key, value in result.items() if key != "knobs"}
    out["rows"] = [row.as_dict() for row in result["rows"]]
    out["setup"] = run_dict(result["setup"], result["knobs"])
    return out


def _tp_facts(spec: ModelSpec, setup: Setup, t: int, act_tp: dict, c) -> dict:
    """The TP degree of the tp/fsdp_tp/hsdp_tp rows, where it comes from, and their activations."""
    assumed = " assumed" if any(a.startswith("heads=") for a in spec.assumed) else ""
    return {"degree": t, "source": "--tp" if setup.tp_size is not None else
            f"default: gcd(GPUs per node {setup.gpus_per_node}, heads{assumed} {spec.num_heads}, "
            f"KV heads {spec.heads[1]}) = {t}" + ("; give --heads or --tp" if assumed and t == 1 else ""),
            "activations": act_tp, "approximate": not c.tensors}


def _notes(spec: ModelSpec, setup: Setup, meshes: dict, c) -> list[Note]:
    """What the rows leave out or assume: TP rows absent or repeating a mesh, DeepSpeed's bf16, experts."""
    notes = []
    if not spec.tp_plan:
        notes.append(Note(f"no tp/fsdp_tp/hsdp_tp rows: {spec.tp_note}"))
    else:
        same = [s for s in TP_STRATEGIES if strategy_record(s).distinct and s not in meshes]
        if same:
            notes.append(Note("rows " + " and ".join(same) + " left out: on this setup their mesh is the one of the "
                              "row above them"))
        if not c.tensors:
            notes.append(Note("tp/fsdp_tp/hsdp_tp rows from --params are approximate: totals / (tp x dp_shard)",
                              "footnoted"))
        if spec.tp_note:
            notes.append(Note(spec.tp_note))
    if setup.precision == "bf16-pure":
        notes.append(Note("DeepSpeed has no pure-bf16 mode (ZeRO keeps an fp32 master copy whenever bf16 is on): "
                          "zero* rows are planned as bf16-mixed"))
    if spec.num_experts:
        notes.append(Note(moe_note(spec)))
    if spec.tp_whole_expert_params and any(s in TP_STRATEGIES for s in meshes):
        notes.append(Note(tp_experts_note(spec)))
    if spec.published_quantization:
        notes.append(Note(f"weights published in {spec.published_quantization} (the config's quantization_config) "
                          "are trained dequantised (transformers dequantises them to load a model for training): "
                          f"counted as the {spec.params_total:,} parameters transformers builds, at the training "
                          "precision"))
    return notes


def tp_experts_note(spec: ModelSpec) -> str:
    """Where transformers' TP plan splits no routed expert (gpt-oss: the embeddings and the head only)."""
    share = spec.tp_whole_expert_params / spec.params_total
    return (f"tp rows: transformers' tensor-parallel plan for this model splits none of its routed experts "
            f"({spec.tp_whole_expert_params:,} params, {share:.0%} of the model): every TP rank holds all "
            f"{spec.num_experts} experts of every layer whole, so TP divides only the rest")


def _model_facts(spec: ModelSpec, c) -> dict:
    return {"name": spec.name, "params_total": c.total, "trainable_params": c.trainable,
            "exact": spec.exact, "assumed": list(spec.assumed), "largest_layer_params": spec.largest_layer_params,
            "largest_unit_params": max(c.units), "hidden_size": spec.hidden_size, "num_layers": spec.num_layers,
            "vocab_size": spec.vocab_size, "tied_embeddings": spec.tied_embeddings,
            **({"params_active": spec.params_active,
                "params_active_without_input_embedding": spec.active_without_input_embedding,
                "num_experts": spec.num_experts, "experts_per_token": spec.experts_per_token}
               if spec.num_experts else {})}


def _standing_notes(traced: bool) -> list[Note]:
    """The notes every plan carries (the printed table's footnotes say them)."""
    return [Note(text, "footnoted") for text in (
        "model states (params, grads, optimizer) are exact counts; " + (
            "activations and temporaries traced from the model's code on fake tensors (plan/trace.py)"
            if traced else "activations from a written-out formula: approximate"),
        "peak_bytes: the worst moment of a step (forward, backward or optimizer step), not the sum of "
        "everything; see docs/planner.md",
        "optimizer_bytes includes fp32 master weights; bytes per GPU; see docs/planner.md",
        "comm_bytes_per_step is computed from ring-collective formulas (held within 5% of the collectives the "
        "profiler counts on 2-rank runs; see docs/planner.md)")]


def active_words(spec: ModelSpec) -> str:
    """The active parameters in both conventions publishers use: with the input embedding (Mistral, Qwen) and
    without it (OpenAI's gpt-oss card), the second only where the embedding is its own tensor."""
    words = f"{spec.params_active:,} active with the input embedding"
    if spec.untied_embedding_params:
        words += f", {spec.active_without_input_embedding:,} without"
    return words


def moe_note(spec: ModelSpec) -> str:
    """What a mixture of experts changes: memory holds every expert; ZeRO-3 and the experts' modules."""
    note = (f"mixture of experts: every GPU's model states hold all {spec.num_experts} experts per layer "
            f"({spec.params_total:,} params) though a token uses {spec.experts_per_token} "
            f"({active_words(spec)}); ZeRO-3: ")
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
