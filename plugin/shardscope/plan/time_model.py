"""The step-time model `plan`, `fit` and `report` share: seconds per optimizer step of one planner row, by part.

    compute      = matmul x (1 + recompute_share with activation checkpointing)
                   + the overlapped collectives' hidden seconds x comm_sm_share (their kernels take SMs and memory
                   bandwidth from the matmuls while they run beside them)
                   matmul = micro_batch x accumulation x tokens x flops_per_token / (tp x flops_per_s)
                   flops_per_token = 6 x N_trained + 4 x N_frozen + 12 x layers x hidden x tokens
    exposed_comm = per planner comm term (bytes each rank sends, ring convention): seconds = bytes / bus bandwidth
                   of its kind + calls x ring hops x latency; what the library cannot hide (`exposure`):
                   DDP: the last gradient bucket (25 MB) after backward, and what backward cannot cover;
                   ZeRO-3 / FSDP: per micro-batch and pass, the first unit's gather, then whatever of each unit's
                   gather (backward: gather + reduce-scatter on the same link) the previous unit's compute cannot
                   hide (prefetch one unit ahead; DeepSpeed fetches per sub-module); ZeRO-1/2, TP: all of it;
                   a sequence split's all-to-all (Ulysses) exposed, its ring (torch CP) beside compute;
                   of the hideable part only `hidden_share[kind]` hides (datasheet 100%); a run's measured share
                   replaces the structure: that share of each overlapped term hides while compute lasts
    library      = ZeRO-3 / FSDP's own work: library_bytes x s/byte (datasheet: one copy, read + write, at HBM
                   speed; calibrated: a run of that library measures all its per-module work per byte) + the
                   host's per-module work where it exceeds a pass's GPU time (the host runs ahead of the GPU)
    optimizer    = trainable parameters this rank steps x (optimizer_s_per_param, + zero_step_s_per_param for
                   DeepSpeed ZeRO) (offload rows: 0, their CPU step is in offload)
    offload      = PCIe copies of the offloaded states + the CPU optimizer step (`offload_seconds`)
    overhead     = accumulation x overhead_s (per micro-batch: launches, Python, data)
    step_time_s  = compute + exposed_comm + library + optimizer + offload + overhead

`Hardware` is what a GPU's datasheet says (built by `plan.calibration.figures.hardware(gpu, precision)`, where the
H100 fallback is decided); `Figures` holds every figure the model uses with where it came from (`sources`): the
datasheet and the stated constants below (`datasheet_figures`) or measured runs (plan/calibration/). Nothing here
imports torch. docs/fit.md explains each term and its source.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..strategy import family, strategy_record

PARTS = ("compute", "exposed_comm", "library", "optimizer", "offload", "overhead")
KIND_OF_TERM = {"grad_all_reduce": "all_reduce", "param_all_gather": "all_gather",
                "grad_reduce_scatter": "reduce_scatter", "tp_all_reduce": "all_reduce",
                "tp_logits_all_gather": "all_gather", "sp_all_to_all": "all_to_all", "cp_ring": "send_recv"}
TP_TERMS = ("tp_all_reduce", "tp_logits_all_gather")
# A sequence split's own terms (plan/sequence.py): Ulysses' all-to-alls feed attention and wait for it (exposed);
# torch's ring attention passes K/V while the current chunk computes (beside compute, like a prefetched gather).
SPLIT_TERMS = {"sp_all_to_all": False, "cp_ring": True}
# A gathering library's own collectives: the planner's terms, and the counted kinds (ZeRO's reduce to each
# partition's owner is its reduce-scatter)
LIBRARY_COMM = ("param_all_gather", "grad_reduce_scatter", "all_gather", "reduce_scatter", "reduce")
GATHERING_LIBRARIES = {"deepspeed": "DeepSpeed ZeRO-3", "fsdp": "FSDP"}

# ---------------------------------------------------------------------------- constants, each with its source
# Per GPU: HBM bytes/s, streaming multiprocessors, (NVLink or the card's peer link, PCIe) GB/s one direction (a GPU
# without an entry: plan/calibration/figures.py's ASSUMED_GPU).
DATASHEETS = {
    "H200": (4.8e12, 132, 450, 64, "NVLink 4 900 GB/s both directions; PCIe 5.0 x16"),
    "H100-NVL": (3.9e12, 132, 300, 64, "NVLink bridge 600 GB/s both directions; PCIe 5.0 x16"),
    "H100-PCIE": (2.0e12, 114, 64, 64, "no NVLink switch: PCIe 5.0 x16"),
    "H100": (3.35e12, 132, 450, 64, "NVLink 4 900 GB/s both directions; PCIe 5.0 x16"),
    "A100-40": (1.555e12, 108, 300, 32, "NVLink 3 600 GB/s both directions; PCIe 4.0 x16"),  # before "A100"
    "A100": (2.0e12, 108, 300, 32, "NVLink 3 600 GB/s both directions; PCIe 4.0 x16"),  # the 80 GB part (2,039 SXM)
    "V100": (0.9e12, 80, 150, 16, "NVLink 2 300 GB/s both directions; PCIe 3.0 x16"),
    "L40S": (0.864e12, 142, 32, 32, "no NVLink: PCIe 4.0 x16"),
    "L4": (0.3e12, 58, 32, 32, "no NVLink: PCIe 4.0 x16"),
    "A10": (0.6e12, 72, 32, 32, "no NVLink: PCIe 4.0 x16"),
    "T4": (0.32e12, 40, 16, 16, "no NVLink: PCIe 3.0 x16"),
    "TITAN-RTX": (0.672e12, 72, 50, 16, "NVLink bridge 100 GB/s both directions; PCIe 3.0 x16"),
}
# torch's fused AdamW on the fp32 parameters the Trainer's mixed precision keeps: read and write the parameter and
# both moments (3 x 8), read the fp32 gradient (4). A 16-bit copy of the weights is DeepSpeed's (below), not torch's.
ADAM_BYTES_PER_PARAM = 28
# ZeRO's step around the update: the 16-bit gradient into the fp32 partition (read 2, write 4), the updated fp32
# master back into the 16-bit weights (read 4, write 2)
ZERO_STEP_BYTES_PER_PARAM = 12
COPY_BYTES_PER_BYTE = 2  # a library copy reads and writes each byte once (FSDP2's copy-out after the all-gather and
#                          copy-in before the reduce-scatter; DeepSpeed's gather buffer and gradient bucket copies)
# NCCL's default number of SMs (channels) a collective runs on, one thread block each, an SM not shared with compute
# kernels (NCCL's maintainers: "the default number of SMs is 16", NVIDIA/nccl#1649; one SM per channel, NVIDIA/nccl#689)
NCCL_CHANNELS = 16
HOP_LATENCY_S = {"node": 5e-6, "network": 10e-6}  # per ring step of one collective call
DDP_BUCKET_BYTES = 25 * 2 ** 20  # torch DDP's bucket_cap_mb default: the last bucket reduces after backward
# Full activation recompute, published as a step-time ratio: MPT-1B on 8 x A100-40 (llm-foundry's benchmark table,
# 19,264 vs 15,733 tokens/s/GPU: 1.22x); the matmul FLOPs of one more forward would be 1.33x. The forward's share of
# the step's compute time that recompute adds again. That row is in sample (benchmarks/published_ratios.py counts
# it in no tally); out of sample, an H200 measured 0.22 (DDP) and 0.20 (FSDP2) at the compute-bound 4 x 2,048 shape
# of llama-3.2-1b (benchmarks/results/gpu_check.md, section 3).
RECOMPUTE_SHARE = 0.23
# The host's per-module work of each gathering library (hooks, bookkeeping, issuing the collectives), seconds per
# module per pass, measured by benchmarks/library_host_cost.py (results/library_host_cost.md) on a 2-core CPU:
HOST_S_PER_MODULE = {"fsdp": 99e-6, "deepspeed": 108e-6}
# The model's error: over n comparisons, the nearest-rank 80th percentile of the absolute differences (`error_of`).
# Datasheet figures: on the ratio of two settings' step times against published same-setting GPU measurements, over
# the comparisons out of sample (benchmarks/results/published_ratios.md, with n; a test holds the two equal). Calibrated
# figures: a bar, not a measurement: the time benchmark holds its CPU runs to it and measures the same statistic on
# its held-out set (benchmarks/results/time_prediction.md). `fit` calls candidates closer than this a tie.
ERROR_QUANTILE = 0.80
ERROR_STATISTIC = "the nearest-rank 80th percentile of the absolute differences"
DATASHEET_ERROR = 0.197
CALIBRATED_BAR = 0.15
SOURCES = {
    "network_bytes_per_s": "assumed: one 200 Gb/s HDR InfiniBand adapter per GPU (DGX A100 datasheet: 8 x 200 Gb/s)",
    "cpu_adam_params_per_s": "assumed: order of magnitude of DeepSpeedCPUAdam per rank (no published per-rank rate)",
    "overhead_s": "assumed: kernel launches, Python and the data loader per micro-batch",
    "hidden_share": "structure of the overlap (first unit, per-unit excess, last bucket); nothing further assumed",
    "recompute_share": "published full-recompute step time 1.22x (MPT-1B on 8 x A100-40, llm-foundry's benchmark "
                       "table); an H200 measured 0.20-0.22 (benchmarks/results/gpu_check.md)",
    "latency_s": "assumed: 5 us per ring step inside a node, 10 us across nodes",
    "library_host_s": "measured on a 2-core CPU: benchmarks/results/library_host_cost.md",
}


@dataclass(frozen=True)
class Hardware:
    """What a GPU's datasheet and the stated assumptions say about the machine (all printed, all in --json)."""

    gpu: str
    peak_flops: float                 # dense peak FLOP/s at the training dtype
    peak_source: str
    mfu: float = 0.40                 # fraction of that peak the matmuls reach
    nvlink_bytes_per_s: float = 450e9
    network_bytes_per_s: float = 25e9  # per GPU across nodes (SOURCES)
    pcie_bytes_per_s: float = 32e9
    cpu_adam_params_per_s: float = 1e9  # CPU optimizer step, per rank (SOURCES)
    micro_step_overhead_s: float = 0.005
    link_source: str = ""
    hbm_bytes_per_s: float = 3.35e12
    sms: int = 132
    datasheet: str = ""               # whose datasheet the HBM, SM and link figures are ("assumed (H100's)")


def model_error(fig: "Figures") -> float:
    """The model's error for these figures: measured compute means calibrated (module constants above)."""
    return CALIBRATED_BAR if fig.sources.get("flops_per_s", "").startswith("measured") else DATASHEET_ERROR


def error_of(differences) -> float:
    """`ERROR_STATISTIC` of `differences` (fractions, signed): the ceil(0.8 n)-th smallest absolute value of n."""
    ordered = sorted(abs(d) for d in differences)
    return ordered[max(math.ceil(ERROR_QUANTILE * len(ordered)), 1) - 1]


@dataclass(frozen=True)
class Figures:
    """What the model assumes about the machine; `sources[name]` says where each figure came from."""

    flops_per_s: float                      # achieved per rank, forward + backward
    bus_bytes_per_s: dict                   # collective kind -> sent bytes/s per rank inside a node
    network_bytes_per_s: float              # per GPU across nodes
    hidden_share: dict                      # collective kind -> share of its hideable seconds that hide
    optimizer_s_per_param: float            # per parameter this rank steps: the torch optimizer's update
    overhead_s: float                       # per micro-batch
    pcie_bytes_per_s: float
    cpu_adam_params_per_s: float
    zero_step_s_per_param: float = 0.0      # DeepSpeed ZeRO's step around the update, per parameter stepped
    library_s_per_byte: dict = field(default_factory=dict)  # "deepspeed"/"fsdp" -> measured per-module work per byte
    sources: dict = field(default_factory=dict)
    recompute_share: float = 1 / 3          # checkpointing adds this share of the matmul time again
    comm_sm_share: float = 0.0              # compute lost per second of collective hidden beside it
    latency_s: dict = field(default_factory=dict)          # "node"/"network" -> seconds per ring step
    copy_s_per_byte: float = 0.0            # a library's copies per byte gathered or reduce-scattered (no run of it)
    library_host_s: dict = field(default_factory=dict)     # library -> host seconds per module per pass
    own: dict = field(default_factory=dict)  # strategy -> {figure: value} its own calibration run measured, first

    def bus(self, kind: str) -> float:
        return self.bus_bytes_per_s.get(kind) or min(self.bus_bytes_per_s.values())


def datasheet_figures(hw: Hardware) -> Figures:
    """Figures from a `Hardware`: datasheet peak x MFU, the GPU's link for every kind, the optimizer and the
    libraries' copies at HBM speed, the constants above with their sources."""
    kinds = ("all_reduce", "all_gather", "reduce_scatter")
    hbm = f"{hw.datasheet}: {{}} B/param at {hw.hbm_bytes_per_s / 1e12:g} TB/s HBM"
    peak = f"{hw.peak_source}: dense peak {hw.peak_flops / 1e12:g} TFLOP/s at MFU {hw.mfu:.0%}"
    sources = {**SOURCES, "flops_per_s": peak, "bus_bytes_per_s": hw.link_source,
               "optimizer_s_per_param": hbm.format(ADAM_BYTES_PER_PARAM),
               "zero_step_s_per_param": hbm.format(ZERO_STEP_BYTES_PER_PARAM),
               "comm_sm_share": f"{NCCL_CHANNELS} NCCL channels (one SM each) of {hw.sms} SMs ({hw.datasheet})",
               "copy_s_per_byte": f"one copy, read + write, at {hw.hbm_bytes_per_s / 1e12:g} TB/s HBM ({hw.datasheet})",
               "pcie_bytes_per_s": hw.link_source}
    return Figures(hw.peak_flops * hw.mfu, dict.fromkeys(kinds, hw.nvlink_bytes_per_s), hw.network_bytes_per_s,
                   dict.fromkeys(kinds, 1.0), ADAM_BYTES_PER_PARAM / hw.hbm_bytes_per_s, hw.micro_step_overhead_s,
                   hw.pcie_bytes_per_s, hw.cpu_adam_params_per_s, ZERO_STEP_BYTES_PER_PARAM / hw.hbm_bytes_per_s,
                   sources=sources, recompute_share=RECOMPUTE_SHARE, comm_sm_share=NCCL_CHANNELS / hw.sms,
                   latency_s=dict(HOP_LATENCY_S), copy_s_per_byte=COPY_BYTES_PER_BYTE / hw.hbm_bytes_per_s,
                   library_host_s=dict(HOST_S_PER_MODULE))


# ---------------------------------------------------------------------------- the model
def flops_per_token(spec, model: dict, tokens: int, checkpointing: bool) -> float:
    """Model FLOPs per token (formula in the module docstring; + one forward again with checkpointing, the
    convention MFU/HFU figures count); `model` is `estimate`'s "model" entry; an untied input embedding is a lookup;
    a mixture of experts counts the experts a token is routed to (`active_without_input_embedding`), not all."""
    embedding = spec.untied_embedding_params
    base = spec.active_without_input_embedding or max(spec.params_total - embedding, 0)
    trained = model["trainable_params"] if model["trainable_params"] != model["params_total"] else base
    frozen = base if trained != base else 0
    attention = 12 * spec.num_layers * spec.hidden_size * tokens
    total = 6 * trained + 4 * frozen + attention
    if checkpointing:
        total += 2 * (trained + frozen) + attention / 3
    return total


def overlapped(strategy: str, term: str) -> bool:
    """Whether the library runs this collective beside compute (docs/fit.md, "Exposed communication"):
    DDP's bucketed all-reduce during backward; ZeRO-3 and FSDP's prefetched all-gathers and their
    reduce-scatters during backward (and HSDP's replica all-reduce); not ZeRO-1/2 (gradients reduced after
    backward with DeepSpeed's default overlap_comm false, parameters all-gathered after the optimizer step),
    not tensor parallelism (each all-reduce feeds the next layer); a sequence split's as `SPLIT_TERMS` says."""
    if term in TP_TERMS:
        return False
    if term in SPLIT_TERMS:
        return SPLIT_TERMS[term]
    return strategy_record(strategy).overlapped


def gathers(strategy: str) -> bool:
    """Whether the strategy's library gathers and releases parameters module by module (ZeRO-3, FSDP)."""
    return bool(strategy_record(strategy).gathers)


def library_bytes(comm: dict, shards: int) -> float:
    """Bytes of whole tensors a ZeRO-3 or FSDP rank's library gathers and reduce-scatters per step: the bytes it
    sends in them (`comm`: planned terms or counted kinds, ring convention) over the ring's (n - 1) / n. Its
    per-module work (copies in and out of the collectives' buffers) scales with them."""
    sent = sum(v for k, v in comm.items() if k in LIBRARY_COMM)
    return sent * shards / (shards - 1) if shards > 1 else 0.0


def modules(spec, strategy: str) -> int:
    """What a gathering library gathers one at a time: FSDP's units (each block, the root), DeepSpeed's
    sub-modules with parameters (each linear layer, two norms per block, the embedding and the final norm)."""
    if strategy_record(strategy).gathers == "units":
        return max(len(spec.unit_numels), 1)
    linears = sum(count for *_, count in spec.linear_shapes) or 7 * spec.num_layers
    return linears + 2 * spec.num_layers + 2


def term_seconds(row, setup, fig: Figures, term: str, nbytes: float, calls: float) -> float:
    """One term's seconds: bytes at its link's bandwidth + calls x the ring's steps x the hop latency."""
    across = setup.nodes > 1 and term not in TP_TERMS and term not in SPLIT_TERMS and (
        not strategy_record(row.strategy).node_local or term == "grad_all_reduce")
    kind = KIND_OF_TERM.get(term, "all_reduce")
    group = row.shard_degree if kind != "all_reduce" and row.shard_degree > 1 else setup.world_size // row.mesh.tp
    hops = max(group - 1, 0) * (2 if kind == "all_reduce" else 1)
    latency = fig.latency_s.get("network" if across else "node", 0.0)
    return nbytes / (fig.network_bytes_per_s if across else fig.bus(kind)) + calls * hops * latency


def pipelined(comm_s: float, compute_s: float, units: int) -> float:
    """Exposed seconds of a pass whose `units` each gather before they compute, the next unit's collective issued
    while this one computes: the first unit's in full, then each unit's excess over its predecessor's compute."""
    per_comm, per_compute = comm_s / units, compute_s / units
    return per_comm + (units - 1) * max(0.0, per_comm - per_compute)


def exposure(row, spec, setup, fig: Figures, micro_compute: float) -> tuple[float, float]:
    """(exposed, hidden) seconds of the row's collectives per step (module docstring); `micro_compute`: one
    micro-batch's compute, a third of it forward (the matmul FLOPs), the rest backward."""
    A, exposed, hidden = setup.grad_accum_steps, 0.0, 0.0
    forward = micro_compute / (1 + fig.recompute_share if setup.activation_checkpointing else 1) / 3
    backward = micro_compute - forward
    comm = dict(row.comm)
    if gathers(row.strategy) and row.shard_degree > 1:
        units = modules(spec, row.strategy)
        gathered, reduced = comm.pop("param_all_gather", 0.0), comm.pop("grad_reduce_scatter", 0.0)
        once = strategy_record(row.strategy).sharding == "SHARD_GRAD_OP"  # gathers for forward only, keeps it
        g = term_seconds(row, setup, fig, "param_all_gather", gathered, A * units * (1 if once else 2)) / A
        reduce_every_micro = family(row.strategy) == "deepspeed"  # ZeRO-3 reduce-scatters every micro-batch
        r = term_seconds(row, setup, fig, "grad_reduce_scatter", reduced, (A if reduce_every_micro else 1) * units)
        r_micro = r / A if reduce_every_micro else r
        g_fwd = g if once else g / 2
        for micro in range(A):
            r_here = r_micro if reduce_every_micro or micro == A - 1 else 0.0
            for comm_s, compute_s in ((g_fwd, forward), (g - g_fwd + r_here, backward)):
                out = pipelined(comm_s, compute_s, units)
                exposed, hidden = exposed + out, hidden + comm_s - out
    for term, nbytes in comm.items():
        if term in SPLIT_TERMS:  # the split's own, per layer and pass: exposed, or beside that micro-batch's compute
            seconds = term_seconds(row, setup, fig, term, nbytes, A * 2 * spec.num_layers)
            beside = min(seconds, A * micro_compute) if SPLIT_TERMS[term] else 0.0
            exposed, hidden = exposed + seconds - beside, hidden + beside
            continue
        bucketed = term == "grad_all_reduce" and overlapped(row.strategy, term)
        whole = nbytes / max(2 * (1 - 1 / max(setup.world_size, 2)), 1e-9)
        calls = math.ceil(whole / DDP_BUCKET_BYTES) if bucketed else A
        seconds = term_seconds(row, setup, fig, term, nbytes, calls)
        if not bucketed:
            exposed += seconds
            continue
        last = seconds * min(1.0, DDP_BUCKET_BYTES / whole) if whole else 0.0  # after backward: nothing to hide it
        beside = min(seconds - last, backward)
        exposed, hidden = exposed + seconds - beside, hidden + beside
    kinds = {KIND_OF_TERM.get(t, "all_reduce") for t in row.comm if overlapped(row.strategy, t)}
    share = min((fig.hidden_share.get(k, 1.0) for k in kinds), default=1.0)
    return exposed + (1 - share) * hidden, share * hidden


def measured_exposure(row, setup, fig: Figures, compute: float) -> tuple[float, float]:
    """(exposed, hidden) with hidden shares a run measured: of each overlapped term that share hides, as long as
    the step's compute lasts; the rest is exposed (what the run itself showed, so it predicts itself)."""
    exposed = hideable = 0.0
    for term, nbytes in row.comm.items():
        seconds = term_seconds(row, setup, fig, term, nbytes, 0)
        share = fig.hidden_share.get(KIND_OF_TERM.get(term, "all_reduce"), 1.0) if overlapped(row.strategy, term) \
            else 0.0
        exposed, hideable = exposed + (1 - share) * seconds, hideable + share * seconds
    return exposed + max(0.0, hideable - compute), min(hideable, compute)


def library_seconds(row, spec, setup, fig: Figures, micro_compute: float) -> float:
    """ZeRO-3 / FSDP's own work per step (module docstring): per byte moved, and the host's excess per pass."""
    if not gathers(row.strategy) or row.shard_degree < 2:
        return 0.0
    lib = family(row.strategy)
    per_byte = fig.library_s_per_byte.get(lib, fig.copy_s_per_byte)
    host = modules(spec, row.strategy) * fig.library_host_s.get(lib, 0.0)
    passes = (micro_compute / 3, micro_compute * 2 / 3)
    return (library_bytes(row.comm, row.shard_degree) * per_byte
            + setup.grad_accum_steps * sum(max(0.0, host - gpu) for gpu in passes))


def offload_seconds(row, model: dict, setup, fig: Figures) -> float:
    """PCIe copies per step + the CPU optimizer step over this rank's trainable shard s(T):
    zero2_offload: A grads down + params up once (s(T) x (A x g + p)); zero3_offload, fsdp_offload:
    the parameter shard up for every forward and backward and the grads down, A x s(P) x (2p + g)."""
    offload = strategy_record(row.strategy).offload
    if not offload:
        return 0.0
    n, A = row.shard_degree, setup.grad_accum_steps
    p, g = row.per_param.weights, row.per_param.grads
    t_shard, p_shard = model["trainable_params"] / n, model["params_total"] / n
    copies = A * p_shard * (2 * p + g) if "params" in offload else t_shard * (A * g + p)
    return copies / fig.pcie_bytes_per_s + t_shard / fig.cpu_adam_params_per_s


def step_time(row, spec, model: dict, setup, tokens: int, fig: Figures) -> dict:
    """{"step_time_s", "step_time_parts": {part: seconds}, "flops_per_token"} of one planner row (`formulas.Row`) at
    `setup` (its micro-batch, accumulation and checkpointing); a row whose strategy had a calibration run of its own
    takes that run's figures first (`Figures.own`)."""
    fig = replace(fig, **fig.own[row.strategy], own={}) if row.strategy in fig.own else fig
    matmul = setup.micro_batch * tokens * flops_per_token(spec, model, tokens, False) / (row.mesh.tp * fig.flops_per_s)
    micro = matmul * (1 + fig.recompute_share if setup.activation_checkpointing else 1)
    if fig.sources.get("hidden_share", "").startswith("measured"):
        exposed, hidden = measured_exposure(row, setup, fig, setup.grad_accum_steps * micro)
    else:
        exposed, hidden = exposure(row, spec, setup, fig, micro)
    steps_here = "optimizer" not in strategy_record(row.strategy).offload
    per_param = fig.optimizer_s_per_param + (fig.zero_step_s_per_param if family(row.strategy) == "deepspeed" else 0)
    parts = {"compute": setup.grad_accum_steps * micro + hidden * fig.comm_sm_share, "exposed_comm": exposed,
             "library": library_seconds(row, spec, setup, fig, micro),
             "optimizer": model["trainable_params"] / row.shard_degree * per_param * steps_here,
             "offload": offload_seconds(row, model, setup, fig), "overhead": setup.grad_accum_steps * fig.overhead_s}
    return {"step_time_s": sum(parts.values()), "step_time_parts": parts,
            "flops_per_token": flops_per_token(spec, model, tokens, setup.activation_checkpointing)}


def annotate_rows(result: dict, spec, setup, fig: Figures | None) -> None:
    """Each `plan` row gets `step_time_s` and `step_time_parts` at the plan's micro-batch, accumulation and
    checkpointing (None without a GPU name or --calibrate); the result, the assumptions in words."""
    tokens = result["activations"]["tokens_per_sample"]
    for row in result["rows"]:
        if fig is not None:
            predicted = step_time(row, spec, result["model"], setup, tokens, fig)
            row.step_time_s, row.step_time_parts = predicted["step_time_s"], predicted["step_time_parts"]
    result["step_time_assumptions"] = describe(fig) if fig else ["no step time: give --gpu NAME or --calibrate"]


# ---------------------------------------------------------------------------- the assumptions in words
def describe(fig: Figures) -> list[str]:
    """The assumptions in words, each with its source ("measured on RUN", a datasheet, or "assumed")."""
    s = fig.sources
    bus = ", ".join(f"{k} {v / 1e9:.3g}" for k, v in sorted(fig.bus_bytes_per_s.items()))
    hidden = ", ".join(f"{k} {v:.0%}" for k, v in sorted(fig.hidden_share.items()))
    lat = ", ".join(f"{k} {v * 1e6:.3g} us" for k, v in sorted(fig.latency_s.items())) or "none"
    host = ", ".join(f"{k} {v * 1e6:.3g} us" for k, v in sorted(fig.library_host_s.items())) or "none"
    lines = [
        f"compute: {fig.flops_per_s / 1e12:.4g} TFLOP/s per rank for forward + backward ({s['flops_per_s']}); "
        "flops/token = 6 x trained + 4 x frozen matmul params + 12 x layers x hidden x tokens; checkpointing adds "
        f"{fig.recompute_share:.0%} of the matmul time again ({s.get('recompute_share', 'one more forward')})",
        f"collectives, bus bandwidth per rank: {bus} GB/s inside a node ({s['bus_bytes_per_s']}); network "
        f"{fig.network_bytes_per_s / 1e9:g} GB/s across nodes ({s.get('network_bytes_per_s', '-')}); latency per "
        f"ring step: {lat} ({s.get('latency_s', '-')})",
        f"overlap: what the library cannot hide is exposed (first unit, each unit's excess over its predecessor's "
        f"compute, DDP's last bucket); of the rest, hidden: {hidden} ({s['hidden_share']}); compute lost while a "
        f"collective runs beside it: {fig.comm_sm_share:.0%} of its time ({s.get('comm_sm_share', '-')})",
        f"optimizer: {fig.optimizer_s_per_param * 1e9:.3g} ns per parameter this rank steps "
        f"({s['optimizer_s_per_param']}), DeepSpeed ZeRO's step + {fig.zero_step_s_per_param * 1e9:.3g} ns around "
        f"it ({s['zero_step_s_per_param']}); offload: PCIe {fig.pcie_bytes_per_s / 1e9:g} GB/s, CPU step at "
        f"{fig.cpu_adam_params_per_s / 1e9:g} G params/s ({s.get('cpu_adam_params_per_s', '-')})",
        f"overhead: {fig.overhead_s * 1e3:.3g} ms per micro-batch ({s['overhead_s']})"]
    if fig.library_s_per_byte:
        lines.append("library work inside forward + backward (ZeRO-3, FSDP), per byte of whole tensors gathered or "
                     f"reduce-scattered: {', '.join(f'{k} {v * 1e9:.3g} ns' for k, v in sorted(fig.library_s_per_byte.items()))} "
                     f"({s['library_s_per_byte']})")
    if fig.copy_s_per_byte or fig.library_host_s:
        lines.append(f"library copies (ZeRO-3, FSDP): {fig.copy_s_per_byte * 1e12:.3g} ps per byte gathered or "
                     f"reduce-scattered ({s.get('copy_s_per_byte', '-')}); host work per module and pass: {host} "
                     f"({s.get('library_host_s', '-')}), exposed where it exceeds the pass's GPU time")
    if fig.own:
        lines.append(f"rows of {', '.join(sorted(fig.own))}: the figures of their own strategy's calibration run "
                     "first, the other runs' after (such a row reproduces the run it was calibrated from)")
    return lines + unmeasured_library_work(fig)


def unmeasured_library_work(fig: Figures) -> list[str]:
    """With measured compute, the gathering libraries none of the runs measured (their rows count no library work)."""
    missing = [name for key, name in GATHERING_LIBRARIES.items() if key not in fig.library_s_per_byte]
    if not missing or not fig.sources["flops_per_s"].startswith("measured") or fig.copy_s_per_byte:
        return []
    return [f"library work of {' and '.join(missing)}: not counted, no run of it was given (a DDP run cannot time "
            "it): those rows are predicted short by it; `shardscope calibrate` runs one of each library"]
