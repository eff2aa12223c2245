"""The run being planned (`Setup`) and how its ranks are split: data-parallel replicas x shards x tensor-parallel.

Owns the one tensor-parallel validity rule (`tp_heads_problem`: each rank keeps whole attention and
KV heads), used by the planner, the dry run, doctor and the recipes.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from ..errors import UsageError
from ..model.spec import LORA_DEFAULT_TARGETS, ModelSpec
from ..strategy import OPTIMIZERS, PRECISIONS, TP_STRATEGIES, Mesh, strategy_record, tp_strategy


# The fraction of GPU memory a plan leaves free (`Setup.headroom`, `--headroom`): what no planned tensor
# accounts for, the CUDA caching allocator's fragmentation (memory reserved in blocks but not allocated),
# the CUDA context and NCCL's buffers. A run fits when its planned peak <= (1 - HEADROOM) x GPU memory
# (`planner.usable_bytes`); docs/planner.md, "Fits: the headroom", is where it is stated.
HEADROOM = 0.10


@dataclass(frozen=True)
class Setup:
    """The run being planned, as the user asks for it: the cluster (`gpus_per_node` x `nodes` ranks, one GPU each),
    the batch, the precision and the planner's policy. What a library decides is `LibraryKnobs`."""

    gpus_per_node: int = 1
    nodes: int = 1
    gpu_memory_bytes: int | None = None
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    micro_batch: int = 1
    seq_len: int = 2048                    # text; vision derives tokens from image/patch size
    image_size: int | None = None          # vision: overrides the config's image size
    activation_checkpointing: bool = False
    attention: str = "sdpa"                # "sdpa" (no s^2 scores kept) or "eager"
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = LORA_DEFAULT_TARGETS  # or ("all-linear",)
    grad_accum_steps: int = 1
    headroom: float = HEADROOM             # fraction of GPU memory kept free (see HEADROOM)
    cpu_memory_bytes: int | None = None    # per node; checked for offload rows when given
    prefer: str = "fsdp"                   # within a tier of the decision tree: "fsdp" or "deepspeed"
    tp_size: int | None = None             # tensor-parallel degree of tp/fsdp_tp/hsdp_tp; None: `tp_degree` default
    reference_model: bool = False          # a frozen copy of the model (DPO's reference), held like its parameters
    batch_inputs: str = "unpadded"         # how a micro-batch reaches the model: plan/batching.py's INPUTS

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def validate(self) -> "Setup":
        flag = {"gpus_per_node": "--gpus", "gpu_memory_bytes": "--gpu-memory", "cpu_memory_bytes": "--cpu-memory"}
        for key in ("gpus_per_node", "nodes", "micro_batch", "grad_accum_steps"):
            if getattr(self, key) < 1:
                name = flag.get(key, "--" + key.replace("_", "-"))
                raise UsageError(f"{name} must be at least 1, got {getattr(self, key)}")
        for key in ("seq_len", "lora_rank", "gpu_memory_bytes", "cpu_memory_bytes", "image_size"):
            if getattr(self, key) is not None and getattr(self, key) < (0 if key in ("seq_len", "lora_rank") else 1):
                name = flag.get(key, "--" + key.replace("_", "-"))
                raise UsageError(f"{name} must not be negative, got {getattr(self, key)}" if key in ("seq_len", "lora_rank")
                                 else f"{name} must be positive, got {getattr(self, key)}")
        if self.precision not in PRECISIONS:
            raise UsageError(f"unknown precision '{self.precision}' (choose from {', '.join(PRECISIONS)})")
        if self.optimizer not in OPTIMIZERS:
            raise UsageError(f"unknown optimizer '{self.optimizer}' (choose from {', '.join(OPTIMIZERS)})")
        if not 0 <= self.headroom < 1:
            raise UsageError(f"headroom must be in [0, 1), got {self.headroom}")
        if self.batch_inputs not in ("unpadded", "padded", "packed") or (
                self.batch_inputs == "packed" and self.micro_batch != 1):
            raise UsageError(f"batch inputs '{self.batch_inputs}': unpadded, padded, or packed (one row)")
        if self.tp_size is not None:
            if self.tp_size < 1:
                raise UsageError(f"--tp must be at least 1, got {self.tp_size}")
            if self.gpus_per_node % self.tp_size:
                raise UsageError(f"--tp {self.tp_size} must divide the GPUs per node (--gpus {self.gpus_per_node}): "
                                 f"a tensor-parallel group stays inside one node")
        return self


@dataclass(frozen=True)
class LibraryKnobs:
    """What a library decides for the run being planned, from its config or its own default (None: that default)."""

    fp32_grads: bool = False               # DeepSpeed data_types.grad_accum_dtype=fp32
    ddp_bucket_view: bool = False          # DDP(gradient_as_bucket_view=True): no bucket copy
    bucket_elements: int | None = None     # DeepSpeed reduce bucket; None: hidden^2 (Trainer "auto")
    zero_overlap_comm: bool | None = None  # DeepSpeed overlap_comm; None: its default (ZeRO-3 only)
    zero3_persistence_threshold: int | None = None  # None: 10 * hidden (Trainer "auto")
    zero_sub_group_size: int = 10 ** 9     # DeepSpeed zero_optimization.sub_group_size: ZeRO-3's fp32 grads per step
    zero3_max_reuse_distance: int = 10 ** 9  # DeepSpeed stage3_max_reuse_distance: what ZeRO-3 keeps gathered
    zero3_offload: str = "all"             # what zero3_offload moves to CPU: "all", "params" or "optimizer"
    zero_param_groups: int = 2             # Trainer: decay / no-decay groups
    fsdp_version: int = 2                  # 2: per-tensor shards (shipped default); 1: flat params


# The run as `plan --json` has always written it: the user's fields and the library's, in this order.
JSON_ORDER = ("gpus_per_node", "nodes", "gpu_memory_bytes", "precision", "optimizer", "micro_batch", "seq_len",
              "image_size", "activation_checkpointing", "attention", "lora_rank", "lora_targets", "fp32_grads",
              "ddp_bucket_view", "bucket_elements", "zero_overlap_comm", "zero3_persistence_threshold",
              "zero_sub_group_size", "zero3_offload", "zero_param_groups", "grad_accum_steps", "fsdp_version",
              "headroom", "cpu_memory_bytes", "prefer", "tp_size", "reference_model")


def run_dict(setup: Setup, knobs: LibraryKnobs) -> dict:
    """`setup` and `knobs` as one dict in `JSON_ORDER`, with the world size."""
    both = {**asdict(setup), **asdict(knobs)}
    return {**{key: both[key] for key in JSON_ORDER}, "world_size": setup.world_size}


def row_meshes(spec: ModelSpec, setup: Setup, strategies) -> dict:
    """Each strategy's row mesh on this setup (`tp_mesh`), in `strategies`' order: the TP rows (`tp_rows` at
    `tp_degree`) only where the model has a TP plan."""
    if not spec.tp_plan:
        if setup.tp_size is not None:
            tp_degree(spec, setup)  # raises: no plan
        return {s: tp_mesh(s, setup, 1) for s in strategies if s not in TP_STRATEGIES}
    t = tp_degree(spec, setup)
    kept = tp_rows(setup, t, strategies)
    return {s: tp_mesh(s, setup, t if s in TP_STRATEGIES else 1) for s in strategies
            if s not in TP_STRATEGIES or s in kept}


def tp_rows(setup: Setup, t: int, strategies=TP_STRATEGIES) -> tuple[str, ...]:
    """The TP rows of `strategies` at degree t, in `TP_STRATEGIES`' order (the one rule of which exist): those whose
    mesh is not the row's above (`Strategy.repeats`: fsdp_tp where TP spans every GPU, hsdp_tp on one node); tp
    always (on t GPUs of one node)."""
    return tuple(s for s in TP_STRATEGIES if s in strategies and not strategy_record(s).repeats(tp_mesh(s, setup, t)))


def tp_degree(spec: ModelSpec, setup: Setup) -> int:
    """The tensor-parallel degree t of the tp / fsdp_tp / hsdp_tp rows.

    `setup.tp_size` (`--tp`) when given: it must divide num_attention_heads and num_key_value_heads
    (each rank keeps whole heads) and the GPUs per node (checked by `Setup.validate`). Default: the
    GPUs per node capped to the largest degree that divides both head counts, i.e.
    gcd(GPUs per node, num_attention_heads, num_key_value_heads): 8 for Llama-2-70B (64 / 8 heads) on
    8 GPUs, 1 on one GPU (then the TP rows equal ddp / fsdp and are not recommended). The same rule
    holds for head counts assumed from `--params` (hidden / 128); an explicit `--tp` is not checked
    against assumed heads.
    """
    heads, kv = spec.heads
    assumed = any(a.startswith("heads=") for a in spec.assumed)  # --params without --heads
    if setup.tp_size is None:
        return math.gcd(setup.gpus_per_node, heads, kv)
    t = setup.tp_size
    if not spec.tp_plan:
        raise UsageError(f"--tp {t}: {spec.name} cannot be tensor-parallel here ({spec.tp_note})")
    if not assumed:
        check_tp_heads(t, heads, kv, spec.name)
    return t


def tp_heads_problem(t: int, heads: int, kv_heads: int) -> str | None:
    """Why tensor-parallel degree t cannot split these heads (each rank keeps whole heads), or None."""
    if heads % t or kv_heads % t:
        return f"{t} must divide num_attention_heads ({heads}) and num_key_value_heads ({kv_heads})"
    return None


def valid_tp_degrees(heads: int, kv_heads: int) -> list[int]:
    """Every degree that `tp_heads_problem` accepts."""
    common = math.gcd(heads or 1, kv_heads or 1)
    return [d for d in range(1, common + 1) if common % d == 0]


def check_tp_heads(t: int, heads: int, kv_heads: int, name: str) -> None:
    """One-line `UsageError` (`--tp`) unless t divides both head counts."""
    problem = tp_heads_problem(t, heads, kv_heads)
    if problem:
        raise UsageError(f"--tp {problem} of {name}")


def tp_mesh(strategy: str, setup: Setup, t: int) -> Mesh:
    """A row's mesh (the profiler summary's `mesh`): its record's (`Strategy.mesh_on`) on this setup at TP degree t.

    tp: t ranks of one node (world = t); fsdp_tp: FSDP2 over the other world / t ranks;
    hsdp_tp: replicated across the nodes, FSDP2 over gpus_per_node / t ranks inside each node.
    Ranks are laid out row-major over (dp_replicate, dp_shard, tp), as transformers' mesh
    (pp, dp_replicate, fsdp, tp) does, so a TP group is t consecutive ranks inside a node.
    """
    return strategy_record(strategy).mesh_on(setup.world_size, setup.nodes, t)


def setup_for_mesh(setup: Setup, mesh) -> tuple[str, Setup]:
    """The TP strategy name and a Setup whose row reproduces `mesh` (a `Mesh`, or a summary's `{"dp_replicate",
    "dp_shard", "tp"}`): nodes = dp_replicate, GPUs per node = dp_shard x tp, tp_size = tp."""
    mesh = Mesh.of(mesh)
    r, s, t = mesh.dp_replicate, mesh.dp_shard, mesh.tp
    return tp_strategy(mesh), replace(setup, gpus_per_node=s * t, nodes=r, tp_size=t)
