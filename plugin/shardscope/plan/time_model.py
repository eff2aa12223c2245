"""The step-time model `plan` and `fit` share: seconds per optimizer step of one planner row, by part.

    compute      = micro_batch x accumulation x tokens x flops_per_token / (tp x flops_per_s)
                   flops_per_token = 6 x N_trained + 4 x N_frozen + 12 x layers x hidden x tokens
                   (+ 2 x N + 4 x layers x hidden x tokens with activation checkpointing: the forward again)
                   + for ZeRO-3 and FSDP: library_bytes x library_s_per_byte[library] (their per-module gather
                   and release work, measured by a run of that library; none without one), library_bytes =
                   whole-tensor bytes through the row's all-gathers and reduce-scatters per step (`library_bytes`)
    exposed_comm = per planner comm term (bytes each rank sends, ring convention): seconds = bytes / bus bandwidth
                   of its collective kind; a term the library runs beside compute (`OVERLAPPED`) hides the share
                   `hidden_share[kind]` of its seconds behind compute, the rest is exposed, and so is whatever
                   hidden time exceeds compute; tensor-parallel terms are never hidden
    optimizer    = trainable parameters this rank steps (trainable / shard degree) x (optimizer_s_per_param,
                   + zero_step_s_per_param for DeepSpeed ZeRO: its step's copies and bookkeeping around the
                   update) (offload rows: 0, their CPU step is in offload)
    offload      = PCIe copies of the offloaded states + the CPU optimizer step (`offload_seconds`)
    overhead     = accumulation x overhead_s (per micro-batch: launches, Python, data)
    step_time_s  = compute + exposed_comm + optimizer + offload + overhead

`Hardware` is what a GPU's datasheet says (`hardware(gpu, precision)`: dense peak FLOP/s from
`units.PEAK_TFLOPS`, NVLink/PCIe from `LINKS`); `Figures` holds every figure the model uses with where it came
from: the datasheet (`datasheet_figures`) or measured runs (`plan.calibration`). Nothing here imports torch.
docs/fit.md states why each strategy family overlaps what.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UsageError
from ..strategy import family
from ..units import peak_flops

PARTS = ("compute", "exposed_comm", "optimizer", "offload", "overhead")
OFFLOAD = ("zero2_offload", "zero3_offload", "fsdp_offload")
KIND_OF_TERM = {"grad_all_reduce": "all_reduce", "param_all_gather": "all_gather",
                "grad_reduce_scatter": "reduce_scatter", "tp_all_reduce": "all_reduce",
                "tp_logits_all_gather": "all_gather"}
TP_TERMS = ("tp_all_reduce", "tp_logits_all_gather")
# A gathering library's own collectives: the planner's terms, and the counted kinds (ZeRO's reduce to each
# partition's owner is its reduce-scatter)
LIBRARY_COMM = ("param_all_gather", "grad_reduce_scatter", "all_gather", "reduce_scatter", "reduce")
NODE_LOCAL = ("fsdp_hybrid_shard", "hsdp_tp")  # their gathers / reduce-scatters stay inside a node
# Per GPU, HBM bandwidth in bytes/s (datasheets): the GPU optimizer step is memory-bound.
HBM = {"H200": 4.8e12, "H100-NVL": 3.9e12, "H100": 3.35e12, "A100": 2.0e12, "V100": 0.9e12, "L40S": 0.864e12,
       "L4": 0.3e12, "T4": 0.32e12, "A10": 0.6e12}
ADAM_BYTES_PER_PARAM = 36  # fused AdamW: read and write fp32 master, both moments (24), read fp32 grad, write 16-bit
# ZeRO's step around the update: the 16-bit gradient into the fp32 partition (read 2, write 4), the updated fp32
# master back into the 16-bit weights (read 4, write 2)
ZERO_STEP_BYTES_PER_PARAM = 12

# Per GPU, GB/s one direction (datasheets): NVLink (or PCIe where the card has none) and its PCIe link.
LINKS = {
    "A100": (300, 32, "NVLink 3 600 GB/s both directions; PCIe 4.0 x16"),
    "H100-NVL": (300, 64, "NVLink bridge 600 GB/s both directions; PCIe 5.0 x16"),
    "H100": (450, 64, "NVLink 4 900 GB/s both directions; PCIe 5.0 x16"),
    "H200": (450, 64, "NVLink 4 900 GB/s both directions; PCIe 5.0 x16"),
    "V100": (150, 16, "NVLink 2 300 GB/s both directions; PCIe 3.0 x16"),
    "T4": (16, 16, "no NVLink: PCIe 3.0 x16"),
}
PCIE4 = (32, 32, "no NVLink: PCIe 4.0 x16")  # L4, L40S, A10, A10G, RTX cards


@dataclass(frozen=True)
class Hardware:
    """What a GPU's datasheet and the stated assumptions say about the machine (all printed, all in --json)."""

    gpu: str
    peak_flops: float                 # dense peak FLOP/s at the training dtype
    peak_source: str
    mfu: float = 0.40                 # fraction of that peak the matmuls reach
    nvlink_bytes_per_s: float = 450e9
    network_bytes_per_s: float = 25e9  # per GPU across nodes (200 Gb/s InfiniBand HDR per GPU)
    pcie_bytes_per_s: float = 32e9
    cpu_adam_params_per_s: float = 1e9  # CPU optimizer step, per rank (DeepSpeedCPUAdam order of magnitude)
    micro_step_overhead_s: float = 0.005
    link_source: str = ""


def hardware(gpu: str | None, precision: str, peak_tflops: float | None = None, **overrides) -> Hardware:
    """The stated assumptions for a GPU name (`units.GPUS`); `peak_tflops` where the table has none."""
    dtype = {"fp32": "fp32", "fp16-mixed": "fp16"}.get(precision, "bf16")
    name = gpu or "unknown GPU"
    if peak_tflops is not None:
        peak, source = peak_tflops * 1e12, "--peak-tflops"
    else:
        peak = peak_flops((gpu or "").replace("-", " "), dtype)
        source = f"{name} datasheet, {dtype}"
        if peak is None:
            raise UsageError(f"no dense peak FLOP/s known for {name} at {dtype}: give --peak-tflops "
                             "(the step-time ranking needs it), or --gpu with a known GPU")
    key = next((k for k in LINKS if k in (gpu or "").upper().replace(" ", "-")), None)  # "NVIDIA H100 NVL" too
    nvlink, pcie, link_source = LINKS[key] if key else PCIE4 if gpu else (450, 64, "unknown GPU: H100 links assumed")
    values = dict(gpu=name, peak_flops=peak, peak_source=source, nvlink_bytes_per_s=nvlink * 1e9,
                  pcie_bytes_per_s=pcie * 1e9, link_source=link_source)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return Hardware(**values)


def overlapped(strategy: str, term: str) -> bool:
    """Whether the library runs this collective beside compute (docs/fit.md, "Exposed communication"):
    DDP's bucketed all-reduce during backward; ZeRO-3 and FSDP's prefetched all-gathers and their
    reduce-scatters during backward (and HSDP's replica all-reduce); not ZeRO-1/2 (gradients reduced after
    backward with DeepSpeed's default overlap_comm false, parameters all-gathered after the optimizer step),
    not tensor parallelism (each all-reduce feeds the next layer)."""
    if term in TP_TERMS:
        return False
    if strategy.startswith(("zero1", "zero2")):
        return False
    return family(strategy) in ("torch", "fsdp", "deepspeed", "tp")


@dataclass(frozen=True)
class Figures:
    """What the model assumes about the machine; `sources[name]` says where each figure came from."""

    flops_per_s: float                      # achieved per rank, forward + backward
    bus_bytes_per_s: dict                   # collective kind -> sent bytes/s per rank inside a node
    network_bytes_per_s: float              # per GPU across nodes
    hidden_share: dict                      # collective kind -> share of an overlapped collective hidden
    optimizer_s_per_param: float            # per parameter this rank steps: the torch optimizer's update
    overhead_s: float                       # per micro-batch
    pcie_bytes_per_s: float
    cpu_adam_params_per_s: float
    zero_step_s_per_param: float = 0.0      # DeepSpeed ZeRO's step around the update, per parameter stepped
    library_s_per_byte: dict = field(default_factory=dict)  # "deepspeed"/"fsdp" -> its own work inside forward
    sources: dict = field(default_factory=dict)                # and backward, s per byte gathered or reduce-scattered

    def bus(self, kind: str) -> float:
        return self.bus_bytes_per_s.get(kind) or min(self.bus_bytes_per_s.values())


def datasheet_figures(hw: Hardware) -> Figures:
    """Figures from a `Hardware` (datasheet peak x MFU, NVLink for every kind, every overlapped collective
    fully hidden, the optimizer at HBM speed)."""
    key = next((k for k in HBM if k in hw.gpu.upper().replace(" ", "-")), None)
    hbm = HBM[key] if key else HBM["H100"]
    source = f"datasheet ({hw.gpu})"
    kinds = ("all_reduce", "all_gather", "reduce_scatter")
    peak = f"{hw.peak_source}: dense peak {hw.peak_flops / 1e12:g} TFLOP/s at MFU {hw.mfu:.0%}"
    return Figures(hw.peak_flops * hw.mfu, dict.fromkeys(kinds, hw.nvlink_bytes_per_s), hw.network_bytes_per_s,
                   dict.fromkeys(kinds, 1.0), ADAM_BYTES_PER_PARAM / hbm, hw.micro_step_overhead_s,
                   hw.pcie_bytes_per_s, hw.cpu_adam_params_per_s, ZERO_STEP_BYTES_PER_PARAM / hbm,
                   sources={"flops_per_s": peak, "bus_bytes_per_s": f"{hw.link_source or source}",
                    "hidden_share": f"assumed: {source}", "optimizer_s_per_param": f"{source}: {ADAM_BYTES_PER_PARAM} "
                    f"B/param at {hbm / 1e12:g} TB/s HBM", "overhead_s": f"assumed: {source}",
                    "zero_step_s_per_param": f"{source}: {ZERO_STEP_BYTES_PER_PARAM} B/param at {hbm / 1e12:g} TB/s"})


def flops_per_token(spec, model: dict, tokens: int, checkpointing: bool) -> float:
    """Model FLOPs per token (formula in the module docstring); `model` is `estimate`'s "model" entry;
    an untied input embedding is a lookup, left out."""
    embedding = spec.untied_embedding_params
    base = max(spec.params_total - embedding, 0)
    trained = model["trainable_params"] if model["trainable_params"] != model["params_total"] else base
    frozen = base if trained != base else 0
    attention = 12 * spec.num_layers * spec.hidden_size * tokens
    total = 6 * trained + 4 * frozen + attention
    if checkpointing:
        total += 2 * (trained + frozen) + attention / 3
    return total


def comm_seconds(row, setup, fig: Figures) -> tuple[float, float]:
    """(exposed-for-sure, hideable) seconds of the row's (`formulas.Row`) collectives."""
    exposed = hideable = 0.0
    for term, nbytes in row.comm.items():
        kind = KIND_OF_TERM.get(term, "all_reduce")
        across = setup.nodes > 1 and term not in TP_TERMS and (row.strategy not in NODE_LOCAL
                                                               or term == "grad_all_reduce")
        seconds = nbytes / (fig.network_bytes_per_s if across else fig.bus(kind))
        share = fig.hidden_share.get(kind, 1.0) if overlapped(row.strategy, term) else 0.0
        exposed += (1 - share) * seconds
        hideable += share * seconds
    return exposed, hideable


def offload_seconds(row, model: dict, setup, fig: Figures) -> float:
    """PCIe copies per step + the CPU optimizer step over this rank's trainable shard s(T):
    zero2_offload: A grads down + params up once (s(T) x (A x g + p)); zero3_offload, fsdp_offload:
    the parameter shard up for every forward and backward and the grads down, A x s(P) x (2p + g)."""
    if row.strategy not in OFFLOAD:
        return 0.0
    n, A = row.shard_degree, setup.grad_accum_steps
    p, g = row.per_param.weights, row.per_param.grads
    t_shard, p_shard = model["trainable_params"] / n, model["params_total"] / n
    copies = t_shard * (A * g + p) if row.strategy == "zero2_offload" else A * p_shard * (2 * p + g)
    return copies / fig.pcie_bytes_per_s + t_shard / fig.cpu_adam_params_per_s


def gathers(strategy: str) -> bool:
    """Whether the strategy's library gathers and releases parameters module by module (ZeRO-3, FSDP)."""
    return strategy.startswith("zero3") or family(strategy) == "fsdp"


def library_bytes(comm: dict, shards: int) -> float:
    """Bytes of whole tensors a ZeRO-3 or FSDP rank's library gathers and reduce-scatters per step: the bytes it
    sends in them (`comm`: planned terms or counted kinds, ring convention) over the ring's (n - 1) / n. Its
    per-module work (copies in and out of the collectives' buffers) scales with them."""
    sent = sum(v for k, v in comm.items() if k in LIBRARY_COMM)
    return sent * shards / (shards - 1) if shards > 1 else 0.0


def step_time(row, spec, model: dict, setup, tokens: int, fig: Figures) -> dict:
    """{"step_time_s", "step_time_parts": {part: seconds}, "flops_per_token"} of one planner row (`formulas.Row`) at
    `setup` (its micro-batch, accumulation and checkpointing)."""
    fpt = flops_per_token(spec, model, tokens, setup.activation_checkpointing)
    samples = setup.micro_batch * setup.grad_accum_steps
    compute = samples * tokens * fpt / (row.mesh["tp"] * fig.flops_per_s)
    if gathers(row.strategy):
        compute += library_bytes(row.comm, row.shard_degree) * fig.library_s_per_byte.get(family(row.strategy), 0)
    exposed, hideable = comm_seconds(row, setup, fig)
    offload = offload_seconds(row, model, setup, fig)
    steps_here = row.strategy not in OFFLOAD
    per_param = fig.optimizer_s_per_param + (fig.zero_step_s_per_param if family(row.strategy) == "deepspeed" else 0)
    optimizer = model["trainable_params"] / row.shard_degree * per_param * steps_here
    parts = {"compute": compute, "exposed_comm": exposed + max(0.0, hideable - compute), "optimizer": optimizer,
             "offload": offload, "overhead": setup.grad_accum_steps * fig.overhead_s}
    return {"step_time_s": sum(parts.values()), "step_time_parts": parts, "flops_per_token": fpt}


def describe(fig: Figures) -> list[str]:
    """The assumptions in words, each with its source ("measured on RUN" or the datasheet)."""
    s = fig.sources
    bus = ", ".join(f"{k} {v / 1e9:.3g}" for k, v in sorted(fig.bus_bytes_per_s.items()))
    hidden = ", ".join(f"{k} {v:.0%}" for k, v in sorted(fig.hidden_share.items()))
    return [f"compute: {fig.flops_per_s / 1e12:.4g} TFLOP/s per rank for forward + backward ({s['flops_per_s']}); "
            "flops/token = 6 x trained + 4 x frozen matmul params + 12 x layers x hidden x tokens, + one forward "
            "again with checkpointing",
            f"collectives, bus bandwidth per rank: {bus} GB/s inside a node ({s['bus_bytes_per_s']}); network "
            f"{fig.network_bytes_per_s / 1e9:g}"
            f" GB/s across nodes, PCIe {fig.pcie_bytes_per_s / 1e9:g} GB/s for offload",
            f"overlap: share hidden behind compute of a collective the strategy runs beside it: {hidden} "
            f"({s['hidden_share']}); ZeRO-1/2's and tensor-parallel collectives are exposed (docs/fit.md)",
            f"optimizer: {fig.optimizer_s_per_param * 1e9:.3g} ns per parameter this rank steps "
            f"({s['optimizer_s_per_param']}), DeepSpeed ZeRO's step + {fig.zero_step_s_per_param * 1e9:.3g} ns around "
            f"it ({s['zero_step_s_per_param']}); offload: CPU step at {fig.cpu_adam_params_per_s / 1e9:g} G params/s",
            f"overhead: {fig.overhead_s * 1e3:.3g} ms per micro-batch ({s['overhead_s']})"] + (
        [f"library work inside forward + backward (ZeRO-3, FSDP), per byte of whole tensors gathered or "
         f"reduce-scattered: {', '.join(f'{k} {v * 1e9:.3g} ns' for k, v in sorted(fig.library_s_per_byte.items()))} "
         f"({s['library_s_per_byte']})"] if fig.library_s_per_byte else []) + unmeasured_library_work(fig)


GATHERING_LIBRARIES = {"deepspeed": "DeepSpeed ZeRO-3", "fsdp": "FSDP"}


def unmeasured_library_work(fig: Figures) -> list[str]:
    """With measured compute, the gathering libraries none of the runs measured (their rows count no library work)."""
    missing = [name for key, name in GATHERING_LIBRARIES.items() if key not in fig.library_s_per_byte]
    if not missing or not fig.sources["flops_per_s"].startswith("measured"):
        return []
    return [f"library work of {' and '.join(missing)}: not counted, no run of it was given (a DDP run cannot time "
            "it): those rows are predicted short by it; add a run of that library to --calibrate"]
