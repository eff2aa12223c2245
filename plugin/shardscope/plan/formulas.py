"""Bytes per rank of every strategy family, each formula written out once (docs/planner.md derives them).

Model states (params, grads, optimizer) are exact counts of what a rank holds in steady state (after
the optimizer step); activations are an estimate; buffers are temporaries (gathered layers,
communication buckets, DeepSpeed's fp32 gradient partition during the step). `comm_bytes_per_step`
is computed from ring-collective formulas, not measured.

Mixed-precision AdamW is 16 B/param (2 B 16-bit weights + 2 B grads + 12 B optimizer = 4 B fp32
master + 8 B moments), 18 B with fp32 gradients; `optimizer_bytes` includes the master weights.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ..errors import UsageError
from .mesh import LibraryKnobs, Setup, tp_degree, tp_mesh
from ..model.spec import LORA_DEFAULT_TARGETS, ModelSpec
from .peak import formula_moments, step_peak
from ..strategy import Mesh, Strategy, strategy_record
from ..units import ceil_div

# A row's `activations_source` where no trace applies (TP rows, untraceable models, --params)
FORMULA = "formula (approximate)"


@dataclass(frozen=True)
class ElementBytes:
    param: int    # model weights as held by the rank
    grad: int     # gradients as held between backward and step
    master: int   # separate fp32 master copy owned by the optimizer (0: the params are the master)
    moments: float  # optimizer moments per trainable parameter (AdamW: 2 x state dtype)
    compute: int  # dtype of gathered (unsharded) params and of activations


def element_bytes(precision: str, fam: str, optimizer: str = "adamw", fp32_grads: bool = False,
                  zero_stage: int = 0) -> ElementBytes:
    """Bytes per element of each model state.

    | precision | torch DDP / FSDP              | DeepSpeed ZeRO                       |
    | fp32      | 4 param, 4 grad, 0 master     | 4, 4, +4 fp32 partition copy (ZeRO-1/2   |
    |           |                               | `single_partition_of_fp32_groups`, ZeRO-3 `fp32_partitioned_groups_flat`: clones) |
    | *-mixed   | 4, 4, 0 (autocast; accelerate | 2, 2 (4 with fp32_grads), +4 master  |
    |           | upcasts FSDP flat params)     |                                      |
    | bf16-pure | 2, 2, 0                       | no such mode: planned as bf16-mixed (ZeRO always |
    |           |                               | keeps an fp32 master; `estimate` notes it) |
    Moments: adamw 2 x state dtype (fp32 for DeepSpeed; param dtype for torch); adamw-8bit 2 x
    (1 + 4/256) (bitsandbytes blockwise, fp32 absmax per 256); sgd 0 (Trainer's SGD has no
    momentum); sgd-momentum 1 x state dtype. The 16-bit compute dtype is used for gathered layers
    and activations under mixed/pure 16-bit, fp32 otherwise.
    """
    half = precision != "fp32"
    if fam == "deepspeed":  # bf16-pure is planned as bf16-mixed: what DeepSpeed runs with bf16 on
        param = 2 if half else 4
        grad = 4 if (fp32_grads or not half) else 2
        master = 4  # ZeRO keeps its own fp32 partition (a clone even when training in fp32)
        state = 4
    else:
        param = grad = 2 if precision == "bf16-pure" else 4
        master, state = 0, param
    moments = {"adamw": 2 * state, "adamw-8bit": 2 * (1 + 4 / 256), "sgd": 0, "sgd-momentum": state}[optimizer]
    return ElementBytes(param, grad, master, moments, 2 if half else 4)


@dataclass(frozen=True)
class PerParam:
    """Bytes per trainable parameter by state: the B/param convention (16 for mixed-precision AdamW,
    18 with DeepSpeed's fp32 gradient copy in the step, 8 for bf16-pure torch AdamW)."""

    weights: int
    grads: int
    master: int
    moments: float
    total: float


def per_param(eb: ElementBytes) -> PerParam:
    return PerParam(eb.param, eb.grad, eb.master, eb.moments, eb.param + eb.grad + eb.master + eb.moments)


def zero2_grad_partition(c: Counts, n: int) -> int:
    """Gradient elements the heaviest ZeRO-2 rank keeps in its contiguous buffer (`grads_in_partition`).

    DeepSpeed flattens each param group (the Trainer's two: weights with decay, then 1-D biases/norms)
    padded to a multiple of 2N, cuts it into N equal partitions, and gives a rank every tensor that
    starts inside its partition plus the one straddling its start, each *whole*
    (stage_1_and_2.get_partition_info; copy_grads_in_partition sizes the buffer by their numel). Without
    a tensor list: the plain partition.
    """
    if not c.tensors:
        return ceil_div(c.trainable, 2 * n) * 2
    groups = [[d * r for d, r, train in c.tensors if train and r > 1],
              [d * r for d, r, train in c.tensors if train and r == 1]]
    per_rank = [0] * n
    for sizes in (g for g in groups if g):
        size = ceil_div(sum(sizes), 2 * n) * 2
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        for rank in range(n):
            lo, hi = rank * size, (rank + 1) * size
            per_rank[rank] += sum(k for k, at in zip(sizes, starts) if lo <= at < hi or at < lo < at + k)
    return max(per_rank)


# ----------------------------------------------------------------------------- activations
def activation_bytes(spec: ModelSpec, setup: Setup, tp: int = 1) -> dict:
    """Estimated activation memory per GPU for one micro-batch (an estimate, not a count).

    s = tokens per sample (text: seq_len; vision: (image/patch)^2 + CLS/registers), b = micro-batch,
    h = hidden, a = heads, L = layers, V = vocab, e = compute bytes (2 for 16-bit, 4 for fp32).
    Per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation", no tensor parallelism):
        layer = s*b*h*(34 + 5*a*s/h) * e/2 bytes   (the 5as/h attention-score term only for eager
                                                  attention; SDPA/flash attention keeps no s x s)
    No checkpointing: L * layer. Checkpointing: L * s*b*h*e (each layer's input) + one layer
    (recomputed during backward). Text adds logits: b*s*V*4 (fp32 upcast for the loss) plus
    b*s*V*e when e = 2 (the 16-bit logits). Vision adds b*num_labels*4.

    Tensor parallelism of degree t (`tp`; Korthikanti et al. Table 2, tensor parallel without
    sequence parallelism): layer = s*b*h*(10 + 24/t + 5*a*s/(h*t)) * e/2. Only the attention and MLP
    internals are split; the 10*s*b*h part (layer norms, dropouts, the inputs of the attention and
    MLP blocks) stays whole on every TP rank, because transformers does not wire sequence parallelism
    yet (`DistributedConfig(enable_sequence_parallel=...)` is reserved). Checkpointed layer inputs
    (s*b*h*e) are not split either, and the logits stay whole: lm_head's `colwise_gather_output`
    all-gathers them before the loss. t = 1 gives the 34 above.
    """
    if spec.kind == "vision":
        image = setup.image_size or spec.image_size
        s = (image // spec.patch_size) ** 2 + spec.extra_tokens
    else:
        s = setup.seq_len
    b, h, a, L = setup.micro_batch, spec.hidden_size, spec.num_heads, spec.num_layers
    e = 2 if setup.precision != "fp32" else 4
    scores = 5 * a * s / (h * tp) if setup.attention == "eager" else 0
    layer = s * b * h * (10 + 24 / tp + scores) * e / 2
    layers = L * s * b * h * e + layer if setup.activation_checkpointing else L * layer
    if spec.kind == "vision":
        head = b * spec.num_labels * 4
    else:
        head = b * s * spec.vocab_size * (4 + (e if e == 2 else 0))
    return {"tokens_per_sample": s, "per_layer": int(layer), "layers": int(layers), "head": int(head),
            "total": int(layers + head), "tp": tp}



# ----------------------------------------------------------------------------- model states
@dataclass(frozen=True)
class Counts:
    """Parameter counts after LoRA: every tensor (dim 0, rest, trainable) and the FSDP1 units."""

    tensors: tuple[tuple[int, int, bool], ...]  # () when counted from --params
    total: int
    trainable: int
    units: tuple[int, ...]
    n_trainable_tensors: int
    tp_layout: tuple[tuple[tuple[int, ...], int, bool], ...] = ()  # aligned with `tensors`; LoRA adapters whole


def lora_params(spec: ModelSpec, rank: int, targets=LORA_DEFAULT_TARGETS) -> list[tuple[int, int]]:
    """LoRA adds A (rank x in) and B (out x rank) per targeted Linear: their shapes, one per tensor.
    `all-linear` targets every Linear except the output head (lm_head / classifier)."""
    out = []
    for leaf, fan_in, fan_out, count in spec.linear_shapes:
        hit = leaf not in ("lm_head", "classifier") if "all-linear" in targets else leaf in targets
        if hit:
            out += [(rank, fan_in), (fan_out, rank)] * count
    return out


def counts(spec: ModelSpec, setup: Setup) -> Counts:
    """Every tensor of the model with LoRA's adapters added; only the adapters train under LoRA."""
    base = tuple((d, r, not setup.lora_rank) for d, r in spec.tensor_shapes)
    layout = spec.tp_layout if len(spec.tp_layout) == len(base) else tuple(((d, r), -1, False)
                                                                             for d, r in spec.tensor_shapes)
    if not setup.lora_rank:
        return Counts(base, spec.params_total, spec.params_total, spec.unit_numels, spec.num_tensors, layout)
    lora = lora_params(spec, setup.lora_rank, setup.lora_targets)
    if not lora:
        raise UsageError(f"no Linear layer of {spec.name} matches LoRA targets {','.join(setup.lora_targets)}")
    added = sum(d * r for d, r in lora)
    tensors = base + tuple((d, r, True) for d, r in lora) if base else ()
    blocks = spec.unit_numels[:-1] or spec.unit_numels
    units = tuple(u + added // len(blocks) for u in blocks) + (spec.unit_numels[-1:] if spec.unit_numels[:-1] else ())
    # LoRA adapters are not in the model's TP plan: counted whole on every TP rank (not measured).
    layout = layout + tuple(((d, r), -1, False) for d, r in lora) if base else ()
    return Counts(tensors, spec.params_total + added, added, units, len(lora), layout)


def shard_tensors(c: Counts, n: int, trainable_only: bool = False, by_rows: bool = False) -> int:
    """Each tensor partitioned on its own: ZeRO-3 pads the flattened tensor, ceil(numel/n);
    FSDP2 (`by_rows`) splits dim 0, ceil(dim0/n) * rest. Without a tensor list: ceil(total/n)."""
    if not c.tensors:
        return ceil_div(c.trainable if trainable_only else c.total, n)
    return sum(ceil_div(d, n) * r if by_rows else ceil_div(d * r, n)
               for d, r, train in c.tensors if train or not trainable_only)


def chunk(size: int, parts: int, index: int) -> int:
    """Rows that chunk `index` of `size` split into `parts` gets (torch.chunk / DTensor Shard / FSDP2:
    chunks of ceil(size / parts), the last ones shorter or empty)."""
    k = ceil_div(size, parts)
    return max(0, min(k, size - index * k))


def tp_fsdp_shard(c: Counts, t: int, s: int, trainable_only: bool = False, tp_grads: bool = False) -> int:
    """Elements of the heaviest rank's (rank 0's) storage under TP degree t then FSDP2 over s ranks.

    Per tensor: the TP plan's dim split in t (colwise / embedding_rowwise: dim 0, rowwise: the last
    dim, replicated: whole), then FSDP2 splits the local TP shard's dim 0 in s padded chunks of
    ceil(rows / s) rows. `tp_grads` (TP without FSDP): gradients, whole for the tensors whose
    gradient DTensor comes back Replicate (embedding_rowwise). Without a tensor list (`--params`):
    ceil(total / (t * s)), approximate.
    """
    if not c.tensors:
        return ceil_div(c.trainable if trainable_only else c.total, t * s)
    total = 0
    for (_, _, train), (shape, dim, grad_whole) in zip(c.tensors, c.tp_layout):
        if trainable_only and not train:
            continue
        local = list(shape) or [1]
        if dim >= 0 and not (tp_grads and grad_whole):
            local[dim] = chunk(local[dim], t, 0)
        total += ceil_div(local[0], s) * math.prod(local[1:])
    return total



@dataclass
class Row:
    """One strategy's bytes per rank (see `strategy_row`); totals are derived."""

    strategy: str
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    buffers_bytes: int
    frozen_bytes: int = 0                     # a frozen copy of the model (`Setup.reference_model`): its params
    peak_bytes: int = 0                       # the rank's worst moment in a step (plan/peak.py; what `fits` compares)
    peak_breakdown: dict = field(default_factory=dict)  # by part at that moment (plan/peak.py)
    peak_phase: str = ""                      # forward, backward or optimizer step
    activations_source: str = FORMULA         # "traced" (1 and 2 layers scaled), "simulated" (full depth), FORMULA
    fits: bool | None = None
    cpu_bytes: int = 0
    model_states_bytes: int = 0
    buffers_detail: dict = field(default_factory=dict)
    shard_degree: int = 1
    mesh: Mesh = field(default_factory=Mesh)  # written as its `as_dict`: {"dp_replicate", "dp_shard", "tp"}
    per_param: PerParam | None = None         # B per trainable param: weights, grads, master, moments
    comm_bytes_per_step: int = 0              # computed: bytes each rank sends per optimizer step
    comm: dict = field(default_factory=dict)  # its terms
    approximate: bool = False                 # TP rows from --params: totals / (t x s)
    step_time_s: float | None = None          # plan/time_model.py's step time, where `plan` annotates the row
    step_time_parts: dict | None = None       # its parts

    def __post_init__(self):
        self.model_states_bytes = self.params_bytes + self.grads_bytes + self.optimizer_bytes

    def as_dict(self) -> dict:
        """The row as --json writes it: its fields, and `total_bytes` (= peak_bytes, the name plan --json used before
        peak_bytes) where that key has always stood."""
        out = {}
        for key, value in asdict(self).items():
            out[key] = self.mesh.as_dict() if key == "mesh" else value
            if key == "frozen_bytes":
                out["total_bytes"] = self.peak_bytes
        return out


def strategy_row(strategy: str, spec: ModelSpec, setup: Setup, c: Counts | None = None,
                 activations: int | None = None, trace=None, *, knobs: LibraryKnobs | None = None,
                 mesh: dict | None = None) -> Row:
    """Per-rank bytes of one strategy: its model states, buffers, CPU bytes, communication and the peak of its
    step (with `trace`, plan/trace.py's `StepTrace` of its compute regime; else the activation formula), with what
    the libraries decide (`knobs`, their defaults when None) and the row's `mesh` (`plan/mesh.py`'s `row_meshes`;
    None: computed here). The formula of each family, its terms and its sources: docs/planner.md, "The formulas as
    the code computes them"."""
    ctx = family_row(strategy, spec, setup, c or counts(spec, setup), knobs or LibraryKnobs(), mesh)
    act = activation_bytes(spec, setup, ctx.mesh.tp)["total"] if activations is None else activations
    row, cpu, detail = ctx.states()
    comm = {k: int(v) for k, v in ctx.comm().items()}
    if trace is not None and not isinstance(ctx, TpRow):
        moments, source = trace.at(spec.num_layers), "simulated" if trace.simulated else "traced"
    else:
        moments, source = formula_moments(act, setup.activation_checkpointing), FORMULA
    peak = step_peak(row, detail, moments, ctx.held(row, detail))
    # A frozen reference is built and sharded like the trained model, in the dtype its parameters are held in
    # (fp32 under torch mixed precision, 16-bit DeepSpeed partitions), with no grads or optimizer state; it is
    # held through the whole step, so it adds to the worst moment.
    frozen = row["params_bytes"] if setup.reference_model else 0
    if frozen:
        peak["peak_bytes"] += frozen
        peak["peak_breakdown"] = {**peak["peak_breakdown"], "frozen": frozen}
    return Row(strategy=strategy, frozen_bytes=frozen, activations_bytes=peak["peak_breakdown"]["activations"],
               per_param=per_param(ctx.eb),
               buffers_bytes=int(sum(detail.values())), cpu_bytes=int(cpu), buffers_detail=detail,
               shard_degree=ctx.shards, mesh=ctx.mesh, comm_bytes_per_step=sum(comm.values()), comm=comm,
               approximate=isinstance(ctx, TpRow) and not ctx.c.tensors, peak_bytes=peak["peak_bytes"],
               peak_breakdown=peak["peak_breakdown"], peak_phase=peak["peak_phase"], activations_source=source, **row)


def family_row(strategy: str, spec: ModelSpec, setup: Setup, c: Counts, knobs: LibraryKnobs,
               mesh: Mesh | None = None) -> "FamilyRow":
    """The context of one strategy's row: its family's class (`row_class`) with the counts, element bytes and mesh."""
    record = strategy_record(strategy)
    if mesh is None:
        mesh = tp_mesh(strategy, setup, tp_degree(spec, setup) if record.family == "tp" else 1)
    eb = element_bytes(setup.precision, record.family, setup.optimizer, knobs.fp32_grads, record.zero_stage)
    return row_class(record)(strategy, spec, setup, knobs, c, eb, mesh)


def row_class(record: Strategy) -> type["FamilyRow"]:
    """The formulas of a record: its family's `FamilyRow` (DeepSpeed's by ZeRO stage: 3 partitions parameters)."""
    if record.family == "deepspeed":
        return Zero3Row if record.zero_stage == 3 else Zero12Row
    return {"torch": TorchRow, "fsdp": FsdpRow, "tp": TpRow}[record.family]


@dataclass
class FamilyRow:
    """What one strategy row's formulas need (the model, the run, what the libraries decide, the counts, the element
    bytes, the mesh); one
    subclass per family gives `states` (GPU model states, CPU bytes, buffers), `comm` (bytes each rank sends per
    optimizer step, by collective) and `shards` (the ranks that divide the model states)."""

    strategy: str
    spec: ModelSpec
    setup: Setup
    knobs: LibraryKnobs
    c: Counts
    eb: ElementBytes
    mesh: Mesh

    shards = 1

    @property
    def record(self) -> Strategy:
        return strategy_record(self.strategy)

    def states(self) -> tuple[dict, int, dict]:
        raise NotImplementedError

    def comm(self) -> dict:
        raise NotImplementedError

    def held(self, row: dict, detail: dict) -> dict:
        """What `plan/peak.py`'s `step_peak` adds to the states (see its docstring): what a rank gathers to compute
        and the fresh gradient of the unit or layer being reduced, the gradients it holds at the end of backward
        where they are not its shard (ZeRO-1), and what it carries from earlier micro-batches into a later one."""
        record, spec, setup, c, eb = self.record, self.spec, self.setup, self.c, self.eb
        fam, g, held = record.family, eb.grad, {}
        if fam == "fsdp":
            unit = detail["unit_grad"]  # the largest unit in the compute dtype (FsdpRow.states)
            held = {"gathered": detail.get("gathered_params", unit), "gathered_end": unit,
                    "reduce_copy": detail["reduce_scatter_input"], "fresh_unit": unit}
        elif detail.get("gathered_units"):  # TP + FSDP2
            held = {"gathered": detail["gathered_units"] // 2, "reduce_copy": detail.get("unit_grad", 0)}
        elif record.zero_stage == 3:  # carried: the gradient partitions' flat buffer, allocated when DeepSpeed
            # starts (`grad_partitions_flat_buffer`) and held at every moment, whatever the accumulation (seen on
            # an H200: benchmarks/results/gpu_check.md)
            return {"gathered": spec.largest_layer_params * eb.param + detail["kept_gathered"],
                    "fresh_unit": spec.largest_layer_params * g, "carried": row["grads_bytes"]}
        if record.zero_stage == 1:  # whole gradients until the step, as torch's
            held["backward_grads"] = c.trainable * g
        if setup.grad_accum_steps == 1 or fam == "tp":
            return held
        if fam == "torch" or record.zero_stage == 1:  # torch's AccumulateGrad adds each fresh gradient into .grad
            return {**held, "carried": c.trainable * g}
        if fam == "fsdp":  # unsharded, reduce-scattered unit by unit in the last micro-batch
            return {**held, "carried": c.trainable * eb.compute}
        return {**held, "carried": row["grads_bytes"], "carried_kept": record.zero_stage == 2 and not record.offload}


class TorchRow(FamilyRow):
    """ddp: everything whole on every rank, plus the reducer's bucket copy of the grads."""

    def states(self):
        setup, c, eb = self.setup, self.c, self.eb
        row = dict(params_bytes=c.total * eb.param, grads_bytes=c.trainable * eb.grad,
                   optimizer_bytes=int(c.trainable * (eb.master + eb.moments))
                   + _step_tensors(setup, c.n_trainable_tensors))
        detail = {"ddp_buckets": 0 if self.knobs.ddp_bucket_view or setup.world_size == 1 else c.trainable * eb.grad}
        return row, 0, detail

    def comm(self):
        return {"grad_all_reduce": 2 * _ring(self.setup.world_size) * self.c.trainable * self.eb.grad}


class Zero12Row(FamilyRow):
    """zero1, zero2, zero2_offload: one flat partition of the trainable params, padded to 2N."""

    @property
    def shards(self) -> int:
        return self.setup.world_size

    def states(self):
        record, spec, setup, c, eb = self.record, self.spec, self.setup, self.c, self.eb
        n, g = self.shards, eb.grad
        shard = ceil_div(c.trainable, 2 * n) * 2
        optim = int(shard * (eb.master + eb.moments)) + _step_tensors(setup, self.knobs.zero_param_groups)
        detail = {"reduce_buckets": (2 if _overlap(self.knobs, 2) else 1) * _bucket(spec, self.knobs) * g}
        if record.offload:  # the optimizer and its gradients
            return dict(params_bytes=c.total * eb.param, grads_bytes=0, optimizer_bytes=0), \
                shard * (4 + eb.param) + optim, detail
        detail["fp32_grad_copy_in_step"] = shard * 4 if g < 4 else 0
        grads = zero2_grad_partition(c, n) if record.zero_stage == 2 else shard
        if record.zero_stage == 2:  # the flat partition DeepSpeed's end-of-backward epilogue builds for the step
            detail["flat_grad_partition"] = shard * g
        return dict(params_bytes=c.total * eb.param, grads_bytes=grads * g, optimizer_bytes=optim), 0, detail

    def comm(self):
        c, N, A = self.c, self.setup.world_size, self.setup.grad_accum_steps
        # stage 1 all-reduces whole gradients once per step; stage 2 all-reduces buckets every micro-batch
        # (use_multi_rank_bucket_allreduce)
        per_step = 1 if self.record.zero_stage == 1 else A
        return {"grad_all_reduce": 2 * _ring(N) * c.trainable * self.eb.grad * per_step,
                "param_all_gather": _ring(N) * c.total * self.eb.param}


class Zero3Row(FamilyRow):
    """zero3, zero3_offload: each tensor partitioned on its own; small tensors stay whole (persistent).
    zero3_offload moves what `knobs.zero3_offload` says: parameters, optimizer (with its gradients), or all."""

    @property
    def shards(self) -> int:
        return self.setup.world_size

    def states(self):
        spec, setup, c, eb = self.spec, self.setup, self.c, self.eb
        n, p, g = self.shards, eb.param, eb.grad
        pshard, tshard = shard_tensors(c, n), shard_tensors(c, n, trainable_only=True)
        knobs = self.knobs
        optim = int(tshard * (eb.master + eb.moments)) + _step_tensors(setup, knobs.zero_param_groups)
        gathered, regather = _zero3_gathered(spec, knobs, c)
        # what stays gathered from forward into backward beyond the layer in use (not re-gathered: see comm)
        kept = max(0, int((1 - regather) * gathered) - spec.largest_layer_params) * p
        detail = {"gathered_layer": spec.largest_layer_params * (p + g), "kept_gathered": kept,
                  "reduce_bucket": _bucket(spec, knobs) * g,  # + its reduce-scatter output at the end of backward
                  "reduce_scatter_output": ceil_div(min(_bucket(spec, knobs), c.trainable), n) * g}
        # Tensors at or below the persistence threshold also stay whole on every rank, on the GPU.
        persistent = (c.total - gathered) * p
        on_gpu = dict(params_bytes=pshard * p + persistent, grads_bytes=tshard * g, optimizer_bytes=optim)
        cpu, moved = 0, self.moved()
        if "params" in moved:  # offload_param
            on_gpu["params_bytes"], cpu = persistent, pshard * p
        if "optimizer" in moved:  # offload_optimizer
            on_gpu.update(grads_bytes=0, optimizer_bytes=0)
            return on_gpu, cpu + tshard * (g + 4) + optim, detail
        # DeepSpeed's step builds fp32 gradients one sub-group (sub_group_size elements) at a time
        detail["fp32_grad_copy_in_step"] = min(tshard, knobs.zero_sub_group_size) * 4
        return on_gpu, cpu, detail

    def moved(self) -> tuple[str, ...]:
        """What the record offloads that `knobs.zero3_offload` ("all", "params", "optimizer") moves."""
        return tuple(k for k in self.record.offload if self.knobs.zero3_offload in ("all", k))

    def comm(self):
        c, N, A = self.c, self.setup.world_size, self.setup.grad_accum_steps
        gathered, regather = _zero3_gathered(self.spec, self.knobs, c)
        persistent = c.total - gathered
        return {"param_all_gather": _ring(N) * (A * (1 + regather) * gathered + persistent) * self.eb.param,
                "grad_reduce_scatter": A * _ring(N) * c.trainable * self.eb.grad}


class FsdpRow(FamilyRow):
    """fsdp_*: FSDP2 shards each tensor by rows, FSDP1 one flat parameter per unit."""

    @property
    def shards(self) -> int:
        return self.mesh.dp_shard

    def states(self):
        record, spec, setup, c, eb = self.record, self.spec, self.setup, self.c, self.eb
        n = self.shards
        if self.knobs.fsdp_version == 1:  # one padded flat parameter per unit
            pshard = sum(ceil_div(u, n) for u in c.units)
            tshard = pshard if c.trainable == c.total else ceil_div(c.trainable, n)
        else:
            pshard = shard_tensors(c, n, by_rows=True)
            tshard = shard_tensors(c, n, trainable_only=True, by_rows=True)
        optim = int(tshard * (eb.master + eb.moments)) + _step_tensors(setup, c.n_trainable_tensors)
        unit, e = max(_fsdp_units(spec, self.knobs, c)), eb.compute
        if record.sharding == "SHARD_GRAD_OP":  # gathered in forward, kept through backward
            detail = {"gathered_params": c.total * e, "unit_grad": unit * e}
        else:
            detail = {"gathered_units": 2 * unit * e, "unit_grad": unit * e}
        detail["reduce_scatter_input"] = unit * e  # FSDP2 copies the unit's grads in; the output is the rank's shard
        if record.offload:
            return dict(params_bytes=0, grads_bytes=0, optimizer_bytes=0), \
                pshard * eb.param + tshard * eb.grad + optim, detail
        return dict(params_bytes=pshard * eb.param, grads_bytes=tshard * eb.grad, optimizer_bytes=optim), 0, detail

    def comm(self):
        spec, setup, c, n, e = self.spec, self.setup, self.c, self.shards, self.eb.compute
        root = c.units[-1] if len(c.units) > 1 else 0
        once = root - (spec.untied_embedding_params if self.knobs.fsdp_version == 2 else 0)
        gathered = c.total if self.record.sharding == "SHARD_GRAD_OP" else 2 * c.total - once
        comm = {"param_all_gather": setup.grad_accum_steps * _ring(n) * gathered * e,
                "grad_reduce_scatter": _ring(n) * c.trainable * e}
        if self.mesh.dp_replicate > 1:  # hybrid: the shards' gradients all-reduced across the replicas
            comm["grad_all_reduce"] = 2 * _ring(self.mesh.dp_replicate) * ceil_div(c.trainable, n) * e
        return comm


class TpRow(FamilyRow):
    """tp, fsdp_tp, hsdp_tp: each tensor split as the TP plan says, then FSDP2 over dp_shard."""

    @property
    def shards(self) -> int:
        return self.mesh.tp * self.mesh.dp_shard

    def states(self):
        setup, c, eb = self.setup, self.c, self.eb
        t, S, R = self.mesh.tp, self.mesh.dp_shard, self.mesh.dp_replicate
        pshard, tshard = tp_fsdp_shard(c, t, S), tp_fsdp_shard(c, t, S, trainable_only=True)
        gshard = tshard if R * S > 1 else tp_fsdp_shard(c, t, 1, trainable_only=True, tp_grads=True)
        row = dict(params_bytes=pshard * eb.param, grads_bytes=gshard * eb.grad,
                   optimizer_bytes=int(tshard * (eb.master + eb.moments))
                   + _step_tensors(setup, c.n_trainable_tensors))
        detail = {}
        if R * S > 1:  # transformers applies FSDP2 over (dp_replicate, fsdp) when dp_size > 1
            unit = ceil_div(max(c.units), t)
            detail = {"gathered_units": 2 * unit * eb.param, "unit_grad": unit * eb.grad}
        return row, 0, detail

    def comm(self):
        c, p, g, A = self.c, self.eb.param, self.eb.grad, self.setup.grad_accum_steps
        t, S, R = self.mesh.tp, self.mesh.dp_shard, self.mesh.dp_replicate
        comm = _tp_comm(self.spec, self.setup, t, self.eb.compute)
        if R * S > 1:
            ptp, ttp = tp_fsdp_shard(c, t, 1), tp_fsdp_shard(c, t, 1, trainable_only=True)
            comm["param_all_gather"] = 2 * A * _ring(S) * ptp * p
            comm["grad_reduce_scatter"] = _ring(S) * ttp * g
            if R > 1:
                comm["grad_all_reduce"] = 2 * _ring(R) * tp_fsdp_shard(c, t, S, trainable_only=True) * g
        return comm


def _fsdp_units(spec: ModelSpec, knobs: LibraryKnobs, c: Counts) -> tuple[int, ...]:
    """FSDP's wrap units; accelerate gives FSDP2 an untied input embedding a unit of its own (out of the root)."""
    embedding = spec.untied_embedding_params
    if knobs.fsdp_version != 2 or not embedding or len(c.units) < 2 or c.units[-1] <= embedding:
        return c.units
    return c.units[:-1] + (embedding, c.units[-1] - embedding)


def _step_tensors(setup: Setup, tensors: int) -> int:
    """AdamW's 4-byte `step` count per state entry (a trainable tensor, or a ZeRO param group)."""
    return 4 * tensors if setup.optimizer == "adamw" else 0


def _bucket(spec: ModelSpec, knobs: LibraryKnobs) -> int:
    """DeepSpeed's reduce bucket in elements: the config's, else the Trainer's "auto" hidden^2."""
    return knobs.bucket_elements if knobs.bucket_elements is not None else spec.hidden_size ** 2


def _overlap(knobs: LibraryKnobs, stage: int) -> bool:
    """DeepSpeed's overlap_comm: the config's, else its default (on for ZeRO-3 only)."""
    return knobs.zero_overlap_comm if knobs.zero_overlap_comm is not None else stage == 3


def _zero3_threshold(spec: ModelSpec, knobs: LibraryKnobs) -> int:
    """stage3_param_persistence_threshold: tensors at or below it stay whole on every rank."""
    threshold = knobs.zero3_persistence_threshold
    return threshold if threshold is not None else 10 * spec.hidden_size


def _zero3_gathered(spec: ModelSpec, knobs: LibraryKnobs, c: Counts) -> tuple[int, float]:
    """ZeRO-3's G, elements gathered to compute (all but the persistent tensors), and r, the fraction backward
    re-gathers: modelled r = max(0, 1 - D/(2G)) with D = stage3_max_reuse_distance (`knobs`; DeepSpeed's 1e9 unless
    the run says otherwise): a tensor released after its forward is gathered again in backward."""
    gathered = c.total - sum(d * r for d, r, _ in c.tensors if d * r <= _zero3_threshold(spec, knobs))
    return gathered, max(0.0, 1 - knobs.zero3_max_reuse_distance / (2 * gathered)) if gathered else 0.0


def _ring(k: int) -> float:
    """Bytes each rank sends per byte all-gathered / reduce-scattered over k ranks (ring algorithm)."""
    return (k - 1) / k


def _colwise_per_layer(spec: ModelSpec) -> int:
    """Column-parallel Linears per block (dim 0 split, embedding and head left out), from the TP layout;
    5 (q, k, v, gate, up: Llama-like) without one."""
    head = (spec.vocab_size, spec.hidden_size)
    colwise = [shape for shape, dim, _ in spec.tp_layout if dim == 0 and len(shape) == 2 and shape != head]
    return len(colwise) // spec.num_layers if colwise and spec.num_layers else 5


def _tp_comm(spec: ModelSpec, setup: Setup, t: int, e: int) -> dict:
    """Tensor-parallel traffic per rank per optimizer step (see `strategy_row`): activation
    all-reduces of b*s*h*e bytes and lm_head's all-gather of the b*s*V*e logits, over t ranks."""
    if t == 1:
        return {}
    tokens = setup.micro_batch * activation_bytes(spec, setup)["tokens_per_sample"] * setup.grad_accum_steps
    per_layer = 2 + _colwise_per_layer(spec) + (2 if setup.activation_checkpointing else 0)
    all_reduces = per_layer * spec.num_layers + 2
    out = {"tp_all_reduce": 2 * (t - 1) / t * all_reduces * tokens * spec.hidden_size * e}
    if spec.vocab_size:
        out["tp_logits_all_gather"] = (t - 1) / t * tokens * spec.vocab_size * e
    return out
