"""The strategy registry (one record per strategy), the run's mesh, the precision vocabulary, and which strategy a
summary or a config file is using.

One owner for what every tool shares about a strategy: the planner's rows and their order, the time model's
terms, the shipped configs, detection from a config, a summary or a live run, doctor's findings. A new strategy
is one `Strategy` record here plus its formulas (plan/formulas.py's `FamilyRow` of its family);
tests/test_strategy_registry.py names what a record still lacks. Nothing here imports torch or transformers at
import time.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from .units import as_int

DIMS = ("dp_replicate", "dp_shard", "tp", "cp", "sp")


@dataclass(frozen=True)
class Mesh:
    """The degrees a run's ranks are split into (torchtitan's `ParallelDims`): data-parallel replicas x data-parallel
    shards x tensor-parallel, and a sequence split's cp (torch context parallelism) or sp (DeepSpeed Ulysses);
    ranks laid out row-major over (dp_replicate, dp_shard, tp), as transformers' and accelerate's meshes are.
    Written as `as_dict` wherever JSON holds a mesh (`plan --json`, `fit --json`, the summary's `mesh`)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1
    sp: int = 1

    @property
    def dp(self) -> int:
        """Ranks that see different batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def ranks(self) -> int:
        """The ranks it spans."""
        return self.dp * self.tp * self.cp * self.sp

    def as_dict(self) -> dict:
        """{"dp_replicate", "dp_shard", "tp"}, plus cp or sp where a sequence is split."""
        out = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}
        return {**out, **{k: getattr(self, k) for k in ("cp", "sp") if getattr(self, k) > 1}}

    @classmethod
    def of(cls, mesh) -> "Mesh":
        """A mesh from its dict (a summary's, a config's) or itself; missing degrees are 1."""
        return mesh if isinstance(mesh, Mesh) else cls(**{k: int(mesh.get(k) or 1) for k in DIMS})


@dataclass(frozen=True)
class Strategy:
    """One strategy: who shards what, how its ranks are laid out, where it ranks, how it is launched and named."""

    name: str
    family: str                # who owns the optimizer and the sharding: "torch" (DDP), "deepspeed", "fsdp", "tp"
    dims: tuple[str, ...]      # the mesh dimensions its ranks span (`mesh_on`)
    simplicity: int            # its tier in `recommend`'s decision tree and `fit`'s tie rule (`simplicity_order`)
    config: str                # the shipped accelerate yaml `accelerate launch --config_file` reads
    zero_stage: int = 0        # DeepSpeed ZeRO's stage (0: not DeepSpeed)
    sharding: str = ""         # FSDP's sharding strategy (torch's ShardingStrategy names); "" for other families
    offload: tuple[str, ...] = ()  # what it moves to the CPU: "params", "optimizer" (the step runs there)
    gathers: str = ""          # what it gathers, one at a time, to compute: "units" (FSDP's wrap units),
    #                            "submodules" (DeepSpeed's modules with parameters); "" when it keeps weights whole
    overlapped: bool = True    # its library reduces gradients beside backward (ZeRO-1/2: after it, overlap_comm off)
    autocast: bool = True      # computes under autocast over fp32 weights (DeepSpeed, FSDP: on 16-bit weights)
    distinct: str = ""         # the mesh dimension that must exceed 1 for its mesh to differ from a simpler record's
    multinode_config: str = ""  # the shipped accelerate yaml for several nodes, where it has its own
    library_config: str = ""   # the library's own shipped file (the `deepspeed` launcher's ds/ JSON)

    @property
    def node_local(self) -> bool:
        """Shards inside a node and replicates across nodes: its gathers and reduce-scatters stay on a node's links."""
        return {"dp_replicate", "dp_shard"} <= set(self.dims)

    def mesh_on(self, world: int, nodes: int, t: int = 1) -> Mesh:
        """Its mesh on `world` ranks over `nodes` nodes at tensor-parallel degree t: replicas across nodes and shards
        inside each where it spans both, else all the data-parallel ranks in the one it spans; tp: t (world = t when
        it spans nothing else)."""
        t = t if "tp" in self.dims else 1
        if self.node_local:
            return Mesh(nodes, world // (nodes * t), t)
        return Mesh(dp_replicate=world // t if "dp_replicate" in self.dims else 1,
                    dp_shard=world // t if "dp_shard" in self.dims else 1, tp=t)

    def repeats(self, mesh: Mesh) -> bool:
        """Whether its mesh is a simpler record's on this run (its `distinct` dimension at 1): hybrid sharding on one
        node is full sharding, FSDP x TP with TP on every GPU is TP."""
        return bool(self.distinct) and getattr(mesh, self.distinct) == 1


# name, family, mesh dimensions, simplicity tier, shipped accelerate yaml; then what differs from the defaults.
# Order: the rows' order in `plan`'s table (`STRATEGIES`).
RECORDS = (
    Strategy("ddp", "torch", ("dp_replicate",), 1, "ddp", multinode_config="ddp_multinode"),
    Strategy("zero1", "deepspeed", ("dp_shard",), 3, "zero1", zero_stage=1, overlapped=False, autocast=False,
             library_config="ds/zero1"),
    Strategy("zero2", "deepspeed", ("dp_shard",), 2, "zero2", zero_stage=2, overlapped=False, autocast=False,
             library_config="ds/zero2"),
    Strategy("zero2_offload", "deepspeed", ("dp_shard",), 9, "zero2_offload", zero_stage=2, offload=("optimizer",),
             overlapped=False, autocast=False, library_config="ds/zero2_offload"),
    Strategy("zero3", "deepspeed", ("dp_shard",), 5, "zero3", zero_stage=3, gathers="submodules", autocast=False,
             multinode_config="zero3_multinode", library_config="ds/zero3"),
    Strategy("zero3_offload", "deepspeed", ("dp_shard",), 10, "zero3_offload", zero_stage=3,
             offload=("params", "optimizer"), gathers="submodules", autocast=False, library_config="ds/zero3_offload"),
    Strategy("fsdp_full_shard", "fsdp", ("dp_shard",), 5, "fsdp_full_shard", sharding="FULL_SHARD", gathers="units",
             autocast=False),
    Strategy("fsdp_shard_grad_op", "fsdp", ("dp_shard",), 2, "fsdp_shard_grad_op", sharding="SHARD_GRAD_OP",
             gathers="units", autocast=False),
    Strategy("fsdp_hybrid_shard", "fsdp", ("dp_replicate", "dp_shard"), 4, "fsdp_hybrid_shard",
             sharding="HYBRID_SHARD", gathers="units", autocast=False, distinct="dp_replicate"),
    Strategy("fsdp_offload", "fsdp", ("dp_shard",), 10, "fsdp_offload", sharding="FULL_SHARD",
             offload=("params", "optimizer"), gathers="units", autocast=False),
    # transformers DistributedConfig(tp_size, fsdp_size, dp_replicate_size): torch AdamW on DTensors
    Strategy("tp", "tp", ("tp",), 7, "tp"),
    Strategy("fsdp_tp", "tp", ("dp_shard", "tp"), 8, "fsdp_tp", distinct="dp_shard"),
    Strategy("hsdp_tp", "tp", ("dp_replicate", "dp_shard", "tp"), 6, "hsdp_tp", distinct="dp_replicate"),
)
REGISTRY = {r.name: r for r in RECORDS}
STRATEGIES = tuple(REGISTRY)
TP_STRATEGIES = tuple(r.name for r in RECORDS if "tp" in r.dims)
OFFLOAD = tuple(r.name for r in RECORDS if r.offload)
# FSDP's sharding as configs spell it (FSDP1's name or number, FSDP2's reshard_after_forward) -> torch's name
SHARDINGS = {"FULL_SHARD": "FULL_SHARD", "TRUE": "FULL_SHARD", "1": "FULL_SHARD", "SHARD_GRAD_OP": "SHARD_GRAD_OP",
             "FALSE": "SHARD_GRAD_OP", "2": "SHARD_GRAD_OP", "NO_SHARD": "NO_SHARD", "3": "NO_SHARD",
             "HYBRID_SHARD": "HYBRID_SHARD", "4": "HYBRID_SHARD", "HYBRID_SHARD_ZERO2": "HYBRID_SHARD"}
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-pure")
OPTIMIZERS = ("adamw", "adamw-8bit", "sgd", "sgd-momentum")
# How runs and configs spell a precision -> the planner's name (a summary's "bf16" -> "bf16-mixed").
PRECISION_ALIASES = {"no": "fp32", "fp32": "fp32", "float32": "fp32", "bf16": "bf16-mixed",
                     "fp16": "fp16-mixed", "bf16-mixed": "bf16-mixed", "fp16-mixed": "fp16-mixed",
                     "bf16-pure": "bf16-pure", "bf16-true": "bf16-pure"}


def strategy_record(name: str) -> Strategy:
    """The record of a strategy, or of a sequence-split row of it (plan/sequence.py's "zero3/sp4": zero3's)."""
    return REGISTRY[name.partition("/")[0]]


def family(strategy: str) -> str:
    """Who owns the optimizer and the sharding: "torch" (DDP, and a run with no library: "single"), "deepspeed",
    "fsdp" or "tp"."""
    record = REGISTRY.get(strategy.partition("/")[0])
    return record.family if record else "torch"


@functools.cache
def simplicity_order(prefer: str = "fsdp") -> tuple[str, ...]:
    """Every strategy, simplest first: by tier (`Strategy.simplicity`), `prefer`'s family ("fsdp" or "deepspeed")
    first inside a tier. `recommend` walks it; `fit` breaks ties with it."""
    return tuple(r.name for r in sorted(RECORDS, key=lambda r: (r.simplicity, r.family != prefer)))


def tier(name: str) -> tuple[str, ...]:
    """The strategies of `name`'s simplicity tier (a tier: FSDP's and DeepSpeed's ways to the same sharding)."""
    return tuple(r.name for r in RECORDS if r.simplicity == REGISTRY[name].simplicity)


def named(library: str, *, zero_stage: int = 0, sharding: str = "", offload: bool = False) -> str | None:
    """The record a library's settings describe, or None: offloaded, the library's offload record of that stage
    (FSDP's whatever its sharding) where there is one, else the record without offload (ZeRO-1 has no offload
    record: planned as ZeRO-1)."""
    def first(offloaded: bool, **want) -> str | None:
        return next((r.name for r in RECORDS if bool(r.offload) == offloaded and r.family == library
                     and all(getattr(r, k) == v for k, v in want.items())), None)

    found = first(True, zero_stage=zero_stage) if offload else None
    return found or first(False, zero_stage=zero_stage, **({"sharding": sharding} if sharding else {}))


def tp_strategy(mesh) -> str:
    """The TP record of a mesh (a `Mesh` or its dict): the one whose `distinct` dimension is above 1, the most
    dimensions first (replicas -> hsdp_tp, shards -> fsdp_tp), else the one that spans TP alone."""
    mesh = Mesh.of(mesh)
    ranked = sorted((r for r in RECORDS if "tp" in r.dims), key=lambda r: -len(r.dims))
    return next(r.name for r in ranked if not r.distinct or getattr(mesh, r.distinct) > 1)


def trainer_precision(bf16: bool, fp16: bool) -> str:
    """The Trainer's flags (--bf16 / --fp16) as the profiler and its summary name them: "bf16", "fp16" or "fp32"
    (the one mapping of the flags; `configured_precision` is the planner's name for them)."""
    return "bf16" if bf16 else "fp16" if fp16 else "fp32"


def configured_precision(bf16: bool, fp16: bool) -> str:
    """The planner's name for the Trainer's flags (--bf16 / --fp16): "bf16-mixed", "fp16-mixed" or "fp32"."""
    return PRECISION_ALIASES[trainer_precision(bf16, fp16)]


def strategy_from_summary(summary: dict) -> str | None:
    """The planner's name for a profiler summary's `strategy` (+ `strategy_detail`), or None."""
    name = str(summary.get("strategy", "")).lower().replace("-", "_")
    if name in STRATEGIES:
        return name
    detail = summary.get("strategy_detail") or {}
    if name.startswith(("deepspeed", "zero")) and detail.get("stage") is not None:
        offload = detail.get("offload_optimizer") or detail.get("offload_param")
        return named("deepspeed", zero_stage=int(detail["stage"]), offload=bool(offload))
    if name.startswith("fsdp"):
        sharding = str(detail.get("sharding_strategy", "FULL_SHARD")).split(".")[-1].upper()
        offload = bool(detail.get("cpu_offload") or detail.get("offload_params"))
        return named("fsdp", sharding=sharding, offload=offload) if offload or sharding in SHARDINGS else None
    if name in ("single", "multi_gpu", "multi_cpu", "no"):
        return "ddp"
    return None


def fsdp_settings(kind: str, raw: dict) -> dict:
    """accelerate-yaml names for the FSDP settings of an accelerate yaml or a Trainer fsdp_config."""
    if kind == "accelerate":
        return dict(raw.get("fsdp_config") or {})
    settings = {k if k.startswith("fsdp_") else f"fsdp_{k}": v for k, v in raw.items()}
    settings["fsdp_version"] = raw.get("version", raw.get("fsdp_version", 2))  # transformers' default is 2
    return settings


def tp_mesh_of_config(raw: dict) -> dict | None:
    """The `{"dp_replicate", "dp_shard", "tp"}` degrees of an accelerate yaml with tp_size > 1, else None."""
    pc = raw.get("parallelism_config") or {}
    sizes = {k: as_int(pc.get(f"parallelism_config_{k}_size")) or 1 for k in ("dp_replicate", "dp_shard", "tp")}
    return sizes if sizes["tp"] > 1 else None


def strategy_of_config(kind: str, raw: dict, read=None) -> str | None:
    """The planner's strategy name for an accelerate yaml / DeepSpeed JSON / Trainer fsdp_config (`kind`:
    "accelerate", "deepspeed", "fsdp"); `read(path) -> dict` loads a DeepSpeed file an accelerate yaml names."""
    if kind == "deepspeed":
        zero = raw.get("zero_optimization") or {}
        zero = zero if isinstance(zero, dict) else {}
        stage = as_int(zero.get("stage")) or 0
        offload = any(str((zero.get(k) or {}).get("device", "none")).lower() != "none"
                      for k in ("offload_optimizer", "offload_param"))
        return "ddp" if stage == 0 else named("deepspeed", zero_stage=stage, offload=offload)
    if kind == "accelerate":
        mesh = tp_mesh_of_config(raw)
        if mesh:
            return tp_strategy(mesh)
        dtype = raw.get("distributed_type", "NO")
        if dtype == "DEEPSPEED":
            ds = raw.get("deepspeed_config") or {}
            if ds.get("deepspeed_config_file") and read is not None:
                return strategy_of_config("deepspeed", read(ds["deepspeed_config_file"]))
            zero = {"stage": ds.get("zero_stage", 2), "offload_optimizer": {"device": ds.get("offload_optimizer_device")},
                    "offload_param": {"device": ds.get("offload_param_device")}}
            return strategy_of_config("deepspeed", {"zero_optimization": zero})
        if dtype != "FSDP":
            return "ddp"
    settings = fsdp_settings(kind, raw)
    offload = str(settings.get("fsdp_offload_params", settings.get("fsdp_cpu_offload", False))).lower() == "true"
    mode = str(settings.get("fsdp_sharding_strategy", settings.get("fsdp_reshard_after_forward", "true"))).upper()
    sharding = SHARDINGS.get(mode, "FULL_SHARD")
    replicas = as_int((raw.get("parallelism_config") or {}).get("parallelism_config_dp_replicate_size")) or 1
    if kind == "accelerate" and replicas > 1:  # FSDP2's 2-D mesh: replicas x shards, as a live run detects it
        sharding = "HYBRID_SHARD"
    return "ddp" if sharding == "NO_SHARD" and not offload else named("fsdp", sharding=sharding, offload=offload)


def num_nodes() -> int:
    """Nodes in the run, from the launcher's environment: world size / local world size (torchrun and
    accelerate set LOCAL_WORLD_SIZE; the `deepspeed` launcher sets LOCAL_SIZE instead)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 0)
    return max(1, int(os.environ.get("WORLD_SIZE", 1)) // local) if local else 1


def sequence_split(pc) -> dict:
    """A run's context (cp) or sequence (sp) split from accelerate's ParallelismConfig: {"mesh": {kind: degree},
    "degree", "details": {"sequence_parallel": {kind, degree, backend, group}}}, {} without one (the mesh's
    dp_shard is then the data-parallel shards: dp_replicate x dp_shard x tp x degree = world, as accelerate's).
    The group is the ranks that share this rank's sequences: DeepSpeed's sequence-parallel group (sp),
    accelerate's mesh order (cp)."""
    import torch

    kind = "sp" if pc is not None and pc.sp_size > 1 else "cp" if pc is not None and pc.cp_size > 1 else None
    if kind is None:
        return {}
    degree = pc.sp_size if kind == "sp" else pc.cp_size
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    group = None
    if kind == "sp":
        from deepspeed.utils import groups

        try:  # (what accelerate's deepspeed_ulysses_dl_adapter reads; KeyError before DeepSpeed set it up)
            group = torch.distributed.get_process_group_ranks(groups._get_sequence_parallel_group())
        except (KeyError, ValueError, RuntimeError):
            group = None
    if group is None:  # accelerate's mesh: (dp_replicate, dp_shard, cp/sp, tp), cp inside the data-parallel dims
        stride = pc.tp_size
        start = rank - rank % (degree * stride) + rank % stride
        group = [start + i * stride for i in range(degree)]
    backend = pc.sp_backend if kind == "sp" else pc.cp_backend
    return {"mesh": {kind: degree}, "degree": degree,
            "details": {"sequence_parallel": {"kind": kind, "degree": degree, "backend": backend, "group": group}}}


